/*
 * routes.c - the route table: one table of {method, path, handler}, a
 * path exact or holding one {name} segment; a path with rows but none for
 * the method is a 405, a path with none a 404. Every path under /admin/, a
 * route or not, first passes the admin gate (admin.c).
 *
 * Three gates come before the table. The Host rule (admin.c): while
 * --host is loopback, no admin token is in force or --allowed-hosts is
 * set, a request whose Host is not the server's is a 403 on every route
 * but the health checks, so a page that reached a loopback server by DNS
 * rebinding can neither generate nor read, and a probe dialling a pod's
 * address is still answered. A CORS preflight (OPTIONS with a listed
 * Origin and Access-Control-Request-Method) is answered 204 at once, for
 * any path and without the API key: a browser sends it without
 * credentials, before the real request. With --api-key-file every other
 * request but /health, GET / (TGI's health) and the console's three static
 * files (console.c: a page load carries no credentials) wants "Authorization:
 * Bearer KEY" or Anthropic's "x-api-key: KEY", or gets a 401 (OpenAI's,
 * or Anthropic's on its routes); the admin routes are not asked for
 * it: they want the admin token in that same header, and a request has
 * only one Authorization header, so the two secrets cannot both be
 * required, and keeping them apart (as vLLM does) means the API key alone
 * never reaches the admin routes.
 *
 * Offers srv_route (internal/routes.h), which serve.c sets as
 * the hooks' on_request; owns the table, the server's own routes (GET
 * /health and GET /metrics) and the two gates. Touches the handlers of
 * api_tgi.c, api_openai.c, admin.c and console.c, request.c's errors and secret
 * compare, http.c's responses and CORS origin check, and metrics.c's text. Nothing in server/ but
 * serve.c calls here.
 */
#include "internal/routes.h"
#include "internal/admin.h"
#include "internal/api_chat.h"
#include "internal/api_messages.h"
#include "internal/api_openai.h"
#include "internal/api_responses.h"
#include "internal/api_tgi.h"
#include "internal/console.h"
#include "internal/http.h"
#include "internal/metrics.h"
#include "internal/request.h"

#include <cjson/cJSON.h>
#include <ctype.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <strings.h>

/* --- the server's own routes ------------------------------------------------------ */

static void health(srv_conn *c, const char *name)
{
    (void)name;
    srv_server *s = c->s;
    if (s->serving && !s->draining)
        srv_http_respond_json(c, 200, "{\"status\":\"ok\"}");
    else
        srv_req_fail(c, 503, s->draining ? "shutting down" : "the model is still loading");
}

static void metrics(srv_conn *c, const char *name)
{
    (void)name;
    size_t len = 0;
    char *text = srv_metrics_render(c->s, &len);
    if (!text) {
        srv_req_fail(c, 500, "out of memory");
        return;
    }
    srv_http_respond(c, 200, "text/plain; version=0.0.4", text, len, NULL);
    free(text);
}

/* --- the table ------------------------------------------------------------------------ */

/* Every route. A path with rows, none for the request's method, is a 405
 * that lists their methods in this order; a path with none is a 404. */
static const struct {
    uint8_t method;   /* llhttp_method_t */
    const char *path; /* exact, or with one {name} segment */
    srv_route_handler *handler;
} routes[] = {
    {HTTP_GET, "/", health}, /* TGI answers GET / as /health */
    {HTTP_POST, "/", srv_tgi_compat},
    {HTTP_POST, "/generate", srv_tgi_generate},
    {HTTP_POST, "/generate_stream", srv_tgi_generate_stream},
    {HTTP_GET, "/info", srv_tgi_info},
    {HTTP_POST, "/tokenize", srv_tgi_tokenize},
    {HTTP_POST, "/v1/completions", srv_oai_completions},
    {HTTP_POST, "/v1/chat/completions", srv_chat_completions},
    {HTTP_POST, "/chat_tokenize", srv_chat_tokenize},
    {HTTP_POST, "/v1/responses", srv_responses_create},
    {HTTP_GET, "/v1/responses/{name}", srv_responses_get},
    {HTTP_DELETE, "/v1/responses/{name}", srv_responses_delete},
    {HTTP_POST, "/v1/messages", srv_messages_create},
    {HTTP_POST, "/v1/messages/count_tokens", srv_messages_count_tokens},
    {HTTP_GET, "/v1/models", srv_oai_models},
    {HTTP_GET, "/health", health},
    {HTTP_GET, "/metrics", metrics},
    {HTTP_GET, "/admin/state", srv_admin_state},
    {HTTP_GET, "/admin/adapters", srv_admin_list},
    {HTTP_POST, "/admin/adapters", srv_admin_load},
    {HTTP_DELETE, "/admin/adapters/{name}", srv_admin_unload},
    {HTTP_POST, "/admin/adapters/{name}/merge", srv_admin_merge},
    {HTTP_POST, "/admin/adapters/{name}/unmerge", srv_admin_unmerge},
    {HTTP_GET, "/admin/engine", srv_admin_engine},
    {HTTP_POST, "/admin/engine/pause", srv_admin_pause},
    {HTTP_POST, "/admin/engine/resume", srv_admin_resume},
    {HTTP_GET, "/console", srv_console_page},
    {HTTP_GET, "/console.js", srv_console_js_file},
    {HTTP_GET, "/console.css", srv_console_css_file},
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

/* The methods path has rows for, appended to buf joined by sep, in the
 * table's order; how many. */
static int path_methods(const char *path, char *buf, size_t cap, const char *sep)
{
    char name[160];
    int n = 0;
    for (size_t i = 0; i < sizeof routes / sizeof *routes; i++) {
        if (!path_matches(routes[i].path, path, name, sizeof name))
            continue;
        size_t at = strlen(buf);
        snprintf(buf + at, cap - at, "%s%s", n ? sep : "",
                 llhttp_method_name((llhttp_method_t)routes[i].method));
        n++;
    }
    return n;
}

/* --- CORS preflights --------------------------------------------------------------- */

/* How long a browser may cache a preflight's answer, in seconds. 600 is
 * Chromium's old cap and short enough that a changed --cors-allow-origin
 * reaches browsers within minutes (Firefox caps at 86400). */
#define PREFLIGHT_MAX_AGE 600

/* The request headers a preflight may be told are allowed beyond
 * Authorization and Content-Type: those OpenAI's and Hugging Face's browser
 * clients send (the OpenAI SDK's x-stainless-* ones match by prefix). */
static bool allowed_request_header(const char *name, size_t len)
{
    static const char *const names[] = {"accept", "x-requested-with", "openai-organization",
                                        "openai-project", "openai-beta", "x-use-cache",
                                        "x-wait-for-model",
                                        /* Anthropic's clients */
                                        "x-api-key", "anthropic-version", "anthropic-beta",
                                        "anthropic-dangerous-direct-browser-access"};
    for (size_t i = 0; i < sizeof names / sizeof *names; i++)
        if (strlen(names[i]) == len && strncasecmp(names[i], name, len) == 0)
            return true;
    return len > 12 && strncasecmp(name, "x-stainless-", 12) == 0;
}

/* Access-Control-Allow-Headers' value into buf: Authorization,
 * Content-Type, and each header the preflight asked for (a comma-separated
 * list of tokens) that allowed_request_header takes, as the client wrote
 * it. */
static void allow_headers(const srv_conn *c, char *buf, size_t cap)
{
    snprintf(buf, cap, "Authorization, Content-Type");
    for (const char *at = c->req.cors_headers; *at;) {
        at += strspn(at, " \t,");
        size_t n = strcspn(at, " \t,");
        /* a token: letters, digits and the separators header names use */
        bool token = n > 0;
        for (size_t i = 0; i < n && token; i++)
            token = isalnum((unsigned char)at[i]) || at[i] == '-' || at[i] == '_';
        size_t have = strlen(buf);
        if (token && allowed_request_header(at, n) && have + n + 3 < cap)
            snprintf(buf + have, cap - have, ", %.*s", (int)n, at);
        at += n;
    }
}

/* Whether c is a preflight this server answers: OPTIONS from a listed
 * origin, naming the method it means to use. An OPTIONS without
 * Access-Control-Request-Method is no preflight and goes to the table
 * (405). */
static bool is_preflight(const srv_conn *c)
{
    return c->req.method == HTTP_OPTIONS && c->req.cors_method[0] && srv_http_cors_origin(c);
}

static void preflight(srv_conn *c, const char *path)
{
    char methods[96] = "", headers[sizeof c->req.cors_headers + 32], extra[768];
    if (path_methods(path, methods, sizeof methods, ", ") == 0)
        snprintf(methods, sizeof methods, "GET, POST, DELETE"); /* no route: every method we use */
    allow_headers(c, headers, sizeof headers);
    snprintf(extra, sizeof extra,
             "Access-Control-Allow-Methods: %s, OPTIONS\r\n"
             "Access-Control-Allow-Headers: %s\r\n"
             "Access-Control-Max-Age: %d\r\n",
             methods, headers, PREFLIGHT_MAX_AGE);
    srv_http_respond_empty(c, 204, extra);
}

/* --- the API key ---------------------------------------------------------------------- */

/* The health checks, GET /health and GET / (TGI's): a load balancer or
 * kubelet probes them without secrets, under whatever Host it dials (a pod's
 * address), and they tell a page nothing. */
static bool health_check(const srv_conn *c, const char *path)
{
    return strcmp(path, "/health") == 0 || (strcmp(path, "/") == 0 && c->req.method == HTTP_GET);
}

/* The requests --api-key-file does not cover: the health checks, the
 * admin routes (their own token, srv_admin_gate) and the console's files
 * (a browser fetches a page without credentials; console.c has its own
 * rule, and the page asks for the key before it reads anything). */
static bool key_exempt(const srv_conn *c, const char *path)
{
    return health_check(c, path) || strncmp(path, "/admin/", 7) == 0 || srv_console_path(path);
}

/* The 401's body, in OpenAI's shape unless the route is Anthropic's
 * (none: no key was given). */
static char *key_refusal(const srv_conn *c, bool none)
{
    if (c->req.error_shape == SRV_ERRORS_ANTHROPIC) /* api.anthropic.com's words */
        return srv_http_error_json(c, 401, NULL,
                                   none ? "x-api-key header is required" : "invalid x-api-key");
    cJSON *root = cJSON_CreateObject(), *err = cJSON_AddObjectToObject(root, "error");
    cJSON_AddStringToObject(err, "message",
                            none ? "You didn't provide an API key. You need to provide your API "
                                   "key in an Authorization header using Bearer auth (i.e. "
                                   "Authorization: Bearer YOUR_KEY)."
                                 : "Incorrect API key provided.");
    cJSON_AddStringToObject(err, "type", "invalid_request_error");
    cJSON_AddNullToObject(err, "param");
    if (none)
        cJSON_AddNullToObject(err, "code");
    else
        cJSON_AddStringToObject(err, "code", "invalid_api_key");
    char *text = cJSON_PrintUnformatted(root);
    cJSON_Delete(root);
    return text;
}

/*
 * Whether c carries the API key, or else its 401. The key is taken from
 * "Authorization: Bearer KEY" (OpenAI's clients) or "x-api-key: KEY"
 * (Anthropic's), on every route: either header that holds it is enough.
 * The body is OpenAI's, as api.openai.com sends it: {"error": {"message",
 * "type": "invalid_request_error", "param": null, "code"}}, code
 * "invalid_api_key" for a wrong key and null for none, so that OpenAI's
 * SDKs raise their AuthenticationError with our message; on Anthropic's
 * routes it is Anthropic's authentication_error, which its SDK raises as
 * its AuthenticationError. vLLM answers {"error": "Unauthorized"}, a shape
 * no OpenAI client reads a message from; TGI has no key.
 * WWW-Authenticate: Bearer, as RFC 9110 11.6.1 wants with a 401.
 */
static bool api_key_given(srv_conn *c)
{
    const char *key = c->s->cfg->api_key, *h = c->req.authorization;
    if (!key)
        return true;
    /* the scheme is case-insensitive (RFC 9110 11.1) */
    bool bearer = !c->req.auth_too_long && strncasecmp(h, "Bearer ", 7) == 0;
    const char *given = bearer ? h + 7 + strspn(h + 7, " ") : "";
    if (bearer && srv_secret_equal(given, strlen(given), key))
        return true;
    const char *x_key = c->req.api_key_too_long ? "" : c->req.api_key;
    if (x_key[0] && srv_secret_equal(x_key, strlen(x_key), key))
        return true;
    bool none = !c->req.auth_too_long && !h[0] && !c->req.api_key_too_long && !x_key[0];
    char *text = key_refusal(c, none);
    if (!text) {
        srv_req_fail(c, 500, "out of memory");
        return false;
    }
    srv_http_respond(c, 401, "application/json", text, strlen(text),
                     "WWW-Authenticate: Bearer\r\n");
    free(text);
    return false;
}

void srv_route(srv_conn *c)
{
    /* the path, without the query string */
    char path[512];
    size_t n = c->req.url ? strcspn(c->req.url, "?") : 0;
    if (n == 0 || n >= sizeof path) {
        srv_req_fail(c, n ? 414 : 400, "the request target is missing or too long");
        return;
    }
    memcpy(path, c->req.url, n);
    path[n] = 0;
    /* Anthropic's routes answer every error, the gates' too, in its shape */
    if (strcmp(path, "/v1/messages") == 0 || strncmp(path, "/v1/messages/", 13) == 0)
        c->req.error_shape = SRV_ERRORS_ANTHROPIC;
    if (!health_check(c, path) && srv_admin_host_rule_applies(c->s) && !srv_admin_host_allowed(c))
        return;
    if (is_preflight(c)) {
        preflight(c, path);
        return;
    }
    if (!key_exempt(c, path) && !api_key_given(c))
        return;
    if (strncmp(path, "/admin/", 7) == 0 && !srv_admin_gate(c))
        return;
    char name[160]; /* a {name}: one longer is no route (admin.c's admin_job holds 159) */
    for (size_t i = 0; i < sizeof routes / sizeof *routes; i++) {
        bool has_name = strstr(routes[i].path, "{name}") != NULL;
        if (routes[i].method == c->req.method &&
            path_matches(routes[i].path, path, name, sizeof name)) {
            routes[i].handler(c, has_name ? name : NULL);
            return;
        }
    }
    char allowed[64] = ""; /* the methods path has, for the 405 */
    int n_allowed = path_methods(path, allowed, sizeof allowed, " or ");
    if (n_allowed == 0)
        srv_req_fail(c, 404, "no route %s", path);
    else
        srv_req_fail(c, 405, "%s: %s%s", path, allowed, n_allowed == 1 ? " only" : "");
}

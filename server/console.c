/*
 * console.c - the console's three routes: GET /console (the page),
 * /console.js and /console.css, the bytes embed.cmake compiled in from
 * server/console/.
 *
 * Who may fetch them follows the admin routes' trust rules as far as a
 * browser's fetch of a page allows: with no admin token in force, only a
 * loopback client (the Host rule has passed in routes.c); with one, anyone
 * the Host rule lets in, since a navigation cannot carry a bearer token and
 * the page is the same static text for everyone. The page itself holds no
 * data: everything it shows it asks of the admin routes and the API with
 * the token typed into it, so it can do nothing a client of the admin API
 * could not.
 *
 * Every answer carries a Content-Security-Policy that lets the page run
 * only its own script and style from this origin (no inline code, no
 * other host), talk only to this origin, and not be framed; nosniff, no
 * Referer, and no caching (a new binary's page is the page).
 *
 * Offers srv_console_* (internal/console.h); touches http.c's responses,
 * request.c's error and admin.c's token.
 */
#include "internal/console.h"
#include "internal/admin.h"
#include "internal/http.h"
#include "internal/request.h"

#include <string.h>

#define SECURITY_HEADERS                                                                           \
    "Content-Security-Policy: default-src 'none'; script-src 'self'; style-src 'self'; "           \
    "connect-src 'self'; img-src 'self'; base-uri 'none'; form-action 'none'; "                    \
    "frame-ancestors 'none'\r\n"                                                                   \
    "X-Content-Type-Options: nosniff\r\n"                                                          \
    "X-Frame-Options: DENY\r\n"                                                                    \
    "Referrer-Policy: no-referrer\r\n"                                                             \
    "Cross-Origin-Opener-Policy: same-origin\r\n"                                                  \
    "Cache-Control: no-store\r\n"

bool srv_console_path(const char *path)
{
    return strcmp(path, "/console") == 0 || strcmp(path, "/console.js") == 0 ||
           strcmp(path, "/console.css") == 0;
}

/* Whether c may have the console's files: the admin routes' rule for a
 * request without credentials (answered 403 when not). */
static bool console_allowed(srv_conn *c)
{
    if (srv_admin_token(c->s) || c->loopback)
        return true;
    srv_req_fail(c, 403,
                 "the console answers only loopback clients when no admin token is configured "
                 "(--admin-token-file), as the admin routes do");
    return false;
}

static void serve_file(srv_conn *c, const char *type, const unsigned char *bytes, size_t len)
{
    if (console_allowed(c))
        srv_http_respond(c, 200, type, (const char *)bytes, len, SECURITY_HEADERS);
}

void srv_console_page(srv_conn *c, const char *name)
{
    (void)name;
    serve_file(c, "text/html; charset=utf-8", srv_console_html, srv_console_html_len);
}

void srv_console_js_file(srv_conn *c, const char *name)
{
    (void)name;
    serve_file(c, "text/javascript; charset=utf-8", srv_console_js, srv_console_js_len);
}

void srv_console_css_file(srv_conn *c, const char *name)
{
    (void)name;
    serve_file(c, "text/css; charset=utf-8", srv_console_css, srv_console_css_len);
}

/*
 * test_console.c - the operator's console (GET /console, server/console/).
 *
 * console_files: the three files as the server answers them, without a
 * browser: their types, the Content-Security-Policy that allows no inline
 * code, no API key asked of a page fetch, the admin routes' trust rule
 * (with no admin token, a client that is not loopback is refused, through
 * the connection seam server.h offers).
 *
 * console_browser: the page in a real browser. Debian's chromium, driven
 * by chromedriver over WebDriver (plain HTTP and JSON, spoken here with
 * http_client.h and cJSON), against the real binary serving the tiny
 * model with an admin token and an adapter folder: a wrong token refused,
 * the right one accepted, an adapter loaded, merged (the digest changes,
 * the cost chart appears, one bar per module), unmerged by keyboard alone
 * (the pristine mark and digest come back), a chat with the base and the
 * adapter side by side, the traffic plots, and a narrow window without a
 * horizontal scroll bar. A screenshot of each state goes to
 * QL_CONSOLE_SHOTS (build/console/NN-state.png). tests/console/run.sh
 * installs the browser first and skips (77) only where it cannot.
 */
#include <criterion/criterion.h>
#include <fcntl.h>
#include <netinet/in.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/prctl.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <unistd.h>

#include "lora_fixture.h"
#include "server.h"
#include "tiny_server.h"

#define ADMIN_TOKEN "console-admin-token"
#define API_KEY     "console-api-key"

static char secrets_dir[600];

/* ts_start_with's server with an admin token, an API key (key: else none)
 * and an adapter folder holding tiny-a. */
static void start_server(bool key)
{
    char tmp[512];
    test_tmpdir(tmp, sizeof tmp);
    cr_assert(tmp[0]);
    snprintf(secrets_dir, sizeof secrets_dir, "%s", tmp);
    static char token_file[700], key_file[700], adapters[700];
    snprintf(token_file, sizeof token_file, "%s/admin-token", secrets_dir);
    snprintf(key_file, sizeof key_file, "%s/api-key", secrets_dir);
    snprintf(adapters, sizeof adapters, "%s/adapters", secrets_dir);
    test_write_text(token_file, ADMIN_TOKEN "\n");
    test_write_text(key_file, API_KEY "\n");
    cr_assert_eq(mkdir(adapters, 0700), 0);
    lora_fix_write_tiny(adapters, "tiny-a", NULL, NULL);
    const char *extra[] = {"--admin-token-file",
                           token_file,
                           "--adapter-dir",
                           adapters,
                           key ? "--api-key-file" : NULL,
                           key_file,
                           NULL};
    ts_start_with(TS_JOIN_TEMPLATE, extra);
}

static void stop_server(void)
{
    ts_teardown();
    test_rmtree(secrets_dir);
}

/* ---- the files, as the server answers them ------------------------------------ */

static void files_setup(void)
{
    start_server(true);
}

TestSuite(console_files, .init = files_setup, .fini = stop_server, .timeout = 120);

/* GET path without credentials: 200 of type want_type with the console's
 * policy; the body (the caller frees it). */
static char *console_file(const char *path, const char *want_type)
{
    hc_response r = sp_request("GET", path, NULL, NULL);
    cr_assert_eq(r.status, 200, "GET %s without the API key: %d %s", path, r.status, r.body);
    char v[512];
    cr_assert(hc_header(&r, "Content-Type", v, sizeof v));
    cr_assert_str_eq(v, want_type, "GET %s", path);
    cr_assert(hc_header(&r, "Content-Security-Policy", v, sizeof v), "GET %s: no CSP", path);
    /* the page's own script and style only, no inline code, no other host */
    cr_assert(strstr(v, "default-src 'none'") && strstr(v, "script-src 'self';") &&
                  strstr(v, "style-src 'self';") && strstr(v, "connect-src 'self';") &&
                  strstr(v, "frame-ancestors 'none'") && !strstr(v, "unsafe"),
              "GET %s: CSP %s", path, v);
    cr_assert(hc_header(&r, "X-Content-Type-Options", v, sizeof v) && !strcmp(v, "nosniff"));
    char *body = strdup(r.body);
    hc_response_free(&r);
    return body;
}

Test(console_files, are_served_with_a_policy_that_allows_no_inline_code)
{
    char *html = console_file("/console", "text/html; charset=utf-8");
    cr_assert(strstr(html, "<script src=\"/console.js\" defer></script>"));
    cr_assert(strstr(html, "<link rel=\"stylesheet\" href=\"/console.css\">"));
    /* what the policy would block, so the page must not hold it: an
     * inline script, an event handler attribute, a style attribute */
    cr_assert_null(strstr(html, "<script>"));
    cr_assert_null(strstr(html, " onclick="));
    cr_assert_null(strstr(html, " style="));
    free(html);
    char *js = console_file("/console.js", "text/javascript; charset=utf-8");
    cr_assert(strstr(js, "/admin/adapters"));
    /* the secrets stay in the tab */
    cr_assert_null(strstr(js, "localStorage"));
    cr_assert_null(strstr(js, "document.cookie"));
    free(js);
    free(console_file("/console.css", "text/css; charset=utf-8"));
    /* the API key still guards the data the page reads */
    hc_response r = sp_request("GET", "/v1/models", NULL, NULL);
    cr_assert_eq(r.status, 401);
    hc_response_free(&r);
    r = sp_request("GET", "/admin/state", "Authorization: Bearer " API_KEY "\r\n", NULL);
    cr_assert_eq(r.status, 401, "the API key opened an admin route: %d", r.status);
    hc_response_free(&r);
}

Test(console_files, answer_only_get)
{
    hc_response r = sp_request("POST", "/console", NULL, "{}");
    cr_assert_eq(r.status, 405, "POST /console: %d", r.status);
    hc_response_free(&r);
    r = sp_request("GET", "/console/x", "Authorization: Bearer " API_KEY "\r\n", NULL);
    cr_assert_eq(r.status, 404, "GET /console/x: %d", r.status);
    hc_response_free(&r);
}

/* The status GET /console gets from a client (loopback or not) of a
 * server with or without an admin token, through the connection seam. */
static void status_sink(srv_conn *c, const char *data, size_t len)
{
    int *status = c->sink_data;
    if (*status == 0 && len > 12 && memcmp(data, "HTTP/1.1 ", 9) == 0)
        *status = atoi(data + 9);
}

static int console_status(const char *token, bool loopback)
{
    cfg_serve cfg = {.host = "127.0.0.1",
                     .admin_token = token,
                     .max_connections = 4,
                     .max_body_bytes = 4096,
                     .max_header_bytes = 4096,
                     .request_timeout_ms = 1000,
                     .keepalive_timeout_ms = 1000};
    srv_server *s = calloc(1, sizeof *s);
    srv_conn *c = calloc(1, sizeof *c);
    cr_assert(s && c);
    s->cfg = &cfg;
    srv_metrics_init(&s->metrics);
    srv_http_settings(&s->http_settings);
    int status = 0;
    c->sink = status_sink;
    c->sink_data = &status;
    srv_conn_init_detached(s, c);
    c->loopback = loopback;
    const char *request = "GET /console HTTP/1.1\r\nHost: 127.0.0.1\r\n\r\n";
    srv_conn_feed(c, request, strlen(request));
    srv_conn_release_detached(c);
    free(c);
    free(s);
    return status;
}

Test(console_files, follow_the_admin_routes_trust_rule)
{
    cr_assert_eq(console_status(NULL, true), 200, "no token, loopback");
    cr_assert_eq(console_status(NULL, false), 403, "no token, not loopback");
    cr_assert_eq(console_status("t0ken", false), 200, "a token in force: the page asks for it");
}

/* ---- the page in a browser ------------------------------------------------------ */

static pid_t driver_pid = -1;
static int driver_port;
static char session[128];
static char shots[512];

/* A free port for chromedriver: bound, read back, let go. */
static int free_port(void)
{
    int fd = socket(AF_INET, SOCK_STREAM, 0);
    struct sockaddr_in a = {.sin_family = AF_INET, .sin_addr.s_addr = htonl(INADDR_LOOPBACK)};
    socklen_t len = sizeof a;
    cr_assert(fd >= 0 && bind(fd, (struct sockaddr *)&a, sizeof a) == 0 &&
              getsockname(fd, (struct sockaddr *)&a, &len) == 0);
    close(fd);
    return ntohs(a.sin_port);
}

/* One WebDriver call: its "value" (the caller's to cJSON_Delete the
 * returned root; *value points into it). Fails the test on an error. */
static cJSON *wd_call(const char *method, const char *path, const char *body, cJSON **value)
{
    char full[512];
    if (path[0] == '/')
        snprintf(full, sizeof full, "%s", path);
    else
        snprintf(full, sizeof full, "/session/%s/%s", session, path);
    hc_response r;
    cr_assert(hc_request(driver_port, method, full, NULL, body, &r), "%s %s: no answer", method,
              full);
    cJSON *root = cJSON_Parse(r.body ? r.body : "");
    cr_assert(root, "%s %s: %d %s", method, full, r.status, r.body);
    cr_assert_eq(r.status, 200, "%s %s %s: %d %.2000s", method, full, body ? body : "", r.status,
                 r.body);
    hc_response_free(&r);
    if (value)
        *value = cJSON_GetObjectItemCaseSensitive(root, "value");
    return root;
}

static void wd_do(const char *method, const char *path, const char *body)
{
    cJSON_Delete(wd_call(method, path, body, NULL));
}

/* The element css selects (its WebDriver id into id). */
static void wd_find(const char *css, char *id, size_t cap)
{
    cJSON *q = cJSON_CreateObject(), *v;
    cJSON_AddStringToObject(q, "using", "css selector");
    cJSON_AddStringToObject(q, "value", css);
    char *body = cJSON_PrintUnformatted(q);
    cJSON *root = wd_call("POST", "element", body, &v);
    /* {"element-6066-...": "ID"}: the one member, whatever its key */
    cr_assert(v && v->child && cJSON_IsString(v->child), "no element %s", css);
    snprintf(id, cap, "%s", v->child->valuestring);
    cJSON_Delete(root);
    free(body);
    cJSON_Delete(q);
}

static void wd_click(const char *css)
{
    char id[128], path[256];
    wd_find(css, id, sizeof id);
    snprintf(path, sizeof path, "element/%s/click", id);
    wd_do("POST", path, "{}");
}

/* Clear the field css selects and type text into it. */
static void wd_type(const char *css, const char *text)
{
    char id[128], path[256];
    wd_find(css, id, sizeof id);
    snprintf(path, sizeof path, "element/%s/clear", id);
    wd_do("POST", path, "{}");
    snprintf(path, sizeof path, "element/%s/value", id);
    cJSON *b = cJSON_CreateObject();
    cJSON_AddStringToObject(b, "text", text);
    char *body = cJSON_PrintUnformatted(b);
    wd_do("POST", path, body);
    free(body);
    cJSON_Delete(b);
}

/* The page's answer to `return (script)` as text (JSON for a non-string),
 * malloc'd. */
static char *wd_eval(const char *script)
{
    cJSON *b = cJSON_CreateObject(), *v;
    char *code = malloc(strlen(script) + 16);
    sprintf(code, "return (%s);", script);
    cJSON_AddStringToObject(b, "script", code);
    cJSON_AddArrayToObject(b, "args");
    char *body = cJSON_PrintUnformatted(b);
    cJSON *root = wd_call("POST", "execute/sync", body, &v);
    char *out = cJSON_IsString(v) ? strdup(v->valuestring) : cJSON_PrintUnformatted(v);
    cJSON_Delete(root);
    free(body);
    free(code);
    cJSON_Delete(b);
    return out;
}

/* Wait until the page's `script` is true: polled at most 12000 times 10 ms
 * apart, over two minutes (a bound for a broken page, not a timing); fails
 * with what the page then shows. */
static void wd_until(const char *script, const char *what)
{
    char test[2048];
    snprintf(test, sizeof test, "!!(%s)", script);
    for (int i = 0; i < 12000; i++) {
        char *got = wd_eval(test);
        bool yes = strcmp(got, "true") == 0;
        free(got);
        if (yes)
            return;
        test_sleep_ms(10);
    }
    char *status = wd_eval("document.getElementById('auth-state').textContent + ' | ' + "
                           "document.getElementById('action-result').textContent");
    cr_assert_fail("the page never showed %s (%s); it says: %s", what, script, status);
}

/* base64 (RFC 4648, padded) into out; its length. */
static size_t unbase64(const char *in, unsigned char *out)
{
    static const char abc[] = "ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789+/";
    size_t n = 0;
    unsigned bits = 0, have = 0;
    for (; *in && *in != '='; in++) {
        const char *p = strchr(abc, *in);
        if (!p)
            continue;
        bits = (bits << 6) | (unsigned)(p - abc);
        have += 6;
        if (have >= 8) {
            have -= 8;
            out[n++] = (unsigned char)(bits >> have);
        }
    }
    return n;
}

/* The whole page (beyond the window) as shots/NAME.png. */
static void wd_shot(const char *name)
{
    cJSON *v;
    cJSON *root = wd_call("POST", "goog/cdp/execute",
                          "{\"cmd\": \"Page.captureScreenshot\", \"params\": {\"format\": \"png\", "
                          "\"captureBeyondViewport\": true}}",
                          &v);
    const cJSON *data = cJSON_GetObjectItemCaseSensitive(v, "data");
    cr_assert(cJSON_IsString(data), "no screenshot");
    unsigned char *png = malloc(strlen(data->valuestring));
    size_t n = unbase64(data->valuestring, png);
    cr_assert(n > 8 && memcmp(png, "\x89PNG", 4) == 0, "the screenshot is no PNG");
    char path[700];
    snprintf(path, sizeof path, "%s/%s.png", shots, name);
    test_write_bytes(path, png, n);
    free(png);
    cJSON_Delete(root);
}

static void wd_window(int width, int height)
{
    char body[96];
    snprintf(body, sizeof body, "{\"width\": %d, \"height\": %d}", width, height);
    wd_do("POST", "window/rect", body);
}

static void start_driver(void)
{
    const char *driver = getenv("QL_CHROMEDRIVER") ? getenv("QL_CHROMEDRIVER") : "chromedriver";
    driver_port = free_port();
    char port_flag[32];
    snprintf(port_flag, sizeof port_flag, "--port=%d", driver_port);
    fflush(NULL);
    pid_t parent = getpid();
    driver_pid = fork();
    cr_assert_geq(driver_pid, 0);
    if (driver_pid == 0) {
        prctl(PR_SET_PDEATHSIG, SIGKILL);
        if (getppid() != parent)
            _exit(127);
        int null = open("/dev/null", O_WRONLY);
        dup2(null, 1);
        execlp(driver, driver, port_flag, (char *)NULL);
        _exit(127);
    }
    for (int i = 0;; i++) { /* until it answers /status: a bound, not a timing */
        hc_response r;
        bool up = hc_request(driver_port, "GET", "/status", NULL, NULL, &r);
        hc_response_free(&r);
        if (up)
            break;
        int st;
        cr_assert_eq(waitpid(driver_pid, &st, WNOHANG), 0, "%s exited (status %d)", driver, st);
        cr_assert_lt(i, 3000, "%s never answered /status", driver);
        test_sleep_ms(10);
    }
    /* headless, and without the sandbox, which needs user namespaces a CI
     * container (and root) does not give */
    char body[1024];
    snprintf(body, sizeof body,
             "{\"capabilities\": {\"alwaysMatch\": {\"browserName\": \"chrome\", "
             "\"goog:loggingPrefs\": {\"browser\": \"ALL\"}, "
             "\"goog:chromeOptions\": {%s%s%s\"args\": [\"--headless=new\", \"--no-sandbox\", "
             "\"--disable-gpu\", \"--disable-dev-shm-usage\", \"--hide-scrollbars\", "
             "\"--force-device-scale-factor=1\", \"--window-size=1280,900\"]}}}}",
             getenv("QL_CHROMIUM") ? "\"binary\": \"" : "",
             getenv("QL_CHROMIUM") ? getenv("QL_CHROMIUM") : "",
             getenv("QL_CHROMIUM") ? "\", " : "");
    cJSON *v;
    cJSON *root = wd_call("POST", "/session", body, &v);
    const cJSON *id = cJSON_GetObjectItemCaseSensitive(v, "sessionId");
    cr_assert(cJSON_IsString(id));
    snprintf(session, sizeof session, "%s", id->valuestring);
    cJSON_Delete(root);
}

static void browser_setup(void)
{
    snprintf(shots, sizeof shots, "%s", QL_CONSOLE_SHOTS);
    mkdir(shots, 0755);
    start_server(false);
    start_driver();
}

static void browser_teardown(void)
{
    if (session[0]) {
        hc_response r;
        char path[200];
        snprintf(path, sizeof path, "/session/%s", session);
        hc_request(driver_port, "DELETE", path, NULL, NULL, &r);
        hc_response_free(&r);
    }
    if (driver_pid > 0) {
        kill(driver_pid, SIGTERM);
        waitpid(driver_pid, NULL, 0);
    }
    stop_server();
}

TestSuite(console_browser, .init = browser_setup, .fini = browser_teardown, .timeout = 240);

/* The text of the element with id. */
static char *text_of(const char *id)
{
    char script[160];
    snprintf(script, sizeof script, "document.getElementById('%s').textContent", id);
    return wd_eval(script);
}

/* Confirm the dialog an action opened, by keyboard: it opens with Cancel
 * focused, Shift+Tab reaches Confirm, Enter presses it. */
static void confirm_by_keyboard(void)
{
    wd_until("document.getElementById('confirm').open", "the confirmation dialog");
    wd_until("document.activeElement.id === 'confirm-no'", "Cancel focused in the dialog");
    wd_do("POST", "actions",
          "{\"actions\": [{\"type\": \"key\", \"id\": \"keys\", \"actions\": ["
          "{\"type\": \"keyDown\", \"value\": \"\\uE008\"}, {\"type\": \"keyDown\", \"value\": "
          "\"\\uE004\"}, {\"type\": \"keyUp\", \"value\": \"\\uE004\"}, {\"type\": \"keyUp\", "
          "\"value\": \"\\uE008\"}, {\"type\": \"keyDown\", \"value\": \"\\uE007\"}, {\"type\": "
          "\"keyUp\", \"value\": \"\\uE007\"}]}]}");
    wd_do("DELETE", "actions", NULL);
}

Test(console_browser, loads_merges_unmerges_and_chats)
{
    char url[128];
    snprintf(url, sizeof url, "{\"url\": \"http://127.0.0.1:%d/console?poll=300\"}", sp.port);
    wd_do("POST", "url", url);
    /* no token yet: the admin routes answer 401 and the page asks for one */
    wd_until("document.body.dataset.auth === '401'", "the admin API refusing a missing token");
    wd_shot("01-token-asked");

    wd_type("#token", "not-the-token");
    wd_click("#auth-use");
    wd_until("document.getElementById('auth-state').textContent.includes('refused') && "
             "document.body.dataset.auth === '401'",
             "a wrong token refused");
    char *said = text_of("auth-state");
    cr_assert(strstr(said, "a valid admin bearer token is required"), "%s", said);
    free(said);
    wd_shot("02-wrong-token");

    wd_type("#token", ADMIN_TOKEN);
    wd_click("#auth-use");
    wd_until("document.body.dataset.auth === 'ok' && "
             "document.getElementById('weights-mark').textContent === 'pristine'",
             "the token accepted and the pristine weights");
    char *pristine = text_of("weights-digest");
    cr_assert_eq(strlen(pristine), 16, "digest %s", pristine);
    char *arch = text_of("model-info");
    cr_assert(strstr(arch, "llama"), "the model's facts: %s", arch);
    free(arch);
    wd_shot("03-connected");

    /* load: the form, then the confirmation */
    wd_type("#load-name", "tiny-a");
    wd_type("#load-path", "tiny-a");
    wd_click("#load-go");
    wd_until("document.getElementById('confirm').open", "the load's confirmation");
    wd_click("#confirm-yes");
    wd_until("document.querySelector('#adapter-table tr[data-adapter=\"tiny-a\"]') && "
             "document.getElementById('action-result').dataset.status === '201'",
             "the adapter loaded");
    wd_shot("04-loaded");

    /* merge: the digest changes, the mark says merged, the chart has a
     * bar per module the report names */
    wd_click("button[data-action=merge][data-adapter=\"tiny-a\"]");
    wd_until("document.getElementById('confirm').open", "the merge's confirmation");
    wd_click("#confirm-yes");
    wd_until("document.getElementById('weights-mark').textContent === 'merged' && "
             "document.querySelectorAll('#cost-chart svg.delta_retained rect').length > 0",
             "the merge and its chart");
    char *merged = text_of("weights-digest");
    cr_assert_str_neq(merged, pristine, "the digest did not change with the merge");
    char *bars = wd_eval("document.querySelectorAll('#cost-chart svg.delta_retained rect').length "
                         "+ ' ' + document.querySelectorAll('#cost-chart svg.relative_error "
                         "rect').length + ' ' + document.querySelectorAll('#cost-chart details "
                         "tbody tr').length");
    int n_delta = 0, n_err = 0, n_rows = 0;
    cr_assert_eq(sscanf(bars, "%d %d %d", &n_delta, &n_err, &n_rows), 3, "%s", bars);
    /* the tiny model: 2 layers of 7 projections, each a module the adapter targets */
    cr_assert(n_delta == n_rows && n_err == n_rows && n_rows == 14, "bars %s", bars);
    free(bars);
    free(merged);
    wd_shot("05-merged");

    /* unmerge, by keyboard alone: focus the button, Enter, confirm */
    char id[128], path[256];
    wd_find("button[data-action=unmerge][data-adapter=\"tiny-a\"]", id, sizeof id);
    snprintf(path, sizeof path, "element/%s/value", id);
    wd_do("POST", path, "{\"text\": \"\\uE007\"}");
    confirm_by_keyboard();
    wd_until("document.getElementById('weights-mark').textContent === 'pristine'",
             "the pristine mark again");
    char *back = text_of("weights-digest");
    cr_assert_str_eq(back, pristine, "the unmerge did not bring the pristine digest back");
    free(back);
    free(pristine);
    wd_shot("06-unmerged");

    /* chat: the base on the left, the adapter on the right */
    char *models = wd_eval("document.getElementById('chat-model-0').value + ' ' + "
                           "document.getElementById('chat-model-1').value");
    cr_assert(strstr(models, " tiny-a") && strncmp(models, "tiny-a", 6) != 0, "%s", models);
    free(models);
    wd_type("#chat-max", "12");
    wd_click("#chat-send");
    wd_until("document.getElementById('pane-0').dataset.state === 'done' && "
             "document.getElementById('pane-1').dataset.state === 'done'",
             "both answers streamed to their end");
    for (int k = 0; k < 2; k++) {
        char pane[16];
        snprintf(pane, sizeof pane, "finish-%d", k);
        char *fin = text_of(pane);
        cr_assert(strstr(fin, "finish_reason length") || strstr(fin, "finish_reason stop"), "%s",
                  fin);
        free(fin);
    }
    wd_shot("07-chat");

    /* traffic: the adapter's requests plotted beside the rest */
    wd_until("document.querySelector('#plot-requests [data-series=\"tiny-a\"]') && "
             "Number(document.getElementById('plots').dataset.samples) >= 3 && "
             "document.querySelector('#plot-tokens path')",
             "the traffic plots with the adapter's requests");
    wd_shot("08-traffic");

    /* a narrow window (what 200% zoom makes of 840 pixels): one column, no
     * horizontal scroll */
    wd_window(420, 900);
    wd_until("document.documentElement.scrollWidth <= window.innerWidth",
             "the page fitting a narrow window");
    wd_shot("09-narrow");

    /* nothing the policy refused, no script error, all along */
    cJSON *log;
    cJSON *root = wd_call("POST", "se/log", "{\"type\": \"browser\"}", &log);
    const cJSON *entry;
    cJSON_ArrayForEach (entry, log) {
        const cJSON *m = cJSON_GetObjectItemCaseSensitive(entry, "message");
        const char *text = cJSON_IsString(m) ? m->valuestring : "";
        cr_expect(!strstr(text, "Content Security Policy") && !strstr(text, "Uncaught"),
                  "the browser's console: %s", text);
    }
    cJSON_Delete(root);
}

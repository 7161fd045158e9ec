/*
 * test_server_auth.c - the API key (--api-key-file) and CORS
 * (--cors-allow-origin) end to end: the real binary on a tiny random
 * model, spoken to over TCP (tests/server_process.h), plus the
 * constant-time compare (srv_secret_equal) on its own.
 *
 * What is pinned: with a key, /health and GET / answer anyone and every
 * other route (streams, /metrics, an unknown path) answers 401 in OpenAI's
 * shape with WWW-Authenticate: Bearer until the right key comes; the admin
 * routes want the admin token, never the API key; a key file that is empty
 * or holds a control character stops the server with a message naming the
 * file. A listed origin gets Access-Control-Allow-Origin and Vary: Origin on
 * every answer (a 401 and a stream too), an unlisted one none; a preflight
 * from a listed origin is a 204 without the key, naming the route's
 * methods and the allowed headers it asked for; "*" lets any origin in;
 * without the flag an OPTIONS is the 405 it always was. Without an admin
 * token the admin routes refuse what a web page can send (a simple
 * cross-site POST, a foreign Origin, a DNS-rebound Host, which the
 * inference routes of a loopback server refuse too); --allowed-hosts lets
 * a proxy's name in; a network --host without a token gets one generated
 * (mode 0600).
 */
#define _GNU_SOURCE /* unshare, CLONE_NEWNET */
#include <arpa/inet.h>
#include <criterion/criterion.h>
#include <errno.h>
#include <net/if.h>
#include <sched.h>
#include <stdlib.h>
#include <string.h>
#include <sys/ioctl.h>
#include <sys/stat.h>

#include "http_client.h"
#include "server.h"
#include "server_process.h"
#include "test_util.h"
#include "tiny_model.h"

static char dir[512];
static char model_dir[600];
static char log_path[600];
static char key_file[600];
static char token_file[600];

#define KEY         "sk-qlserve-test-key-0123456789"
#define ADMIN_TOKEN "admin-s3cret"
#define WITH_KEY    "Authorization: Bearer " KEY "\r\n"

static void setup(void)
{
    test_tmpdir(dir, sizeof dir);
    cr_assert(dir[0]);
    snprintf(model_dir, sizeof model_dir, "%s/tiny", dir);
    snprintf(log_path, sizeof log_path, "%s/server.log", dir);
    snprintf(key_file, sizeof key_file, "%s/api-key", dir);
    snprintf(token_file, sizeof token_file, "%s/admin-token", dir);
    cr_assert_eq(mkdir(model_dir, 0700), 0);
    tiny_spec spec = tiny_default();
    tiny_write_hf(model_dir, &spec);
}

static void teardown(void)
{
    sp_kill();
    test_rmtree(dir);
}

TestSuite(auth, .init = setup, .fini = teardown, .timeout = 300);
TestSuite(cors, .init = setup, .fini = teardown, .timeout = 300);

/* The server with the flags in extra (NULL-terminated) after the usual
 * ones; returns once /health says 200. */
static void start(const char *const *extra)
{
    const char *argv[32] = {QL_BINARY, "serve",     "--model", model_dir,  "--port",
                            "0",       "--threads", "2",       "--kv-mib", "16"};
    size_t n = 10;
    for (size_t i = 0; extra && extra[i]; i++)
        argv[n++] = extra[i];
    argv[n] = NULL;
    sp_spawn(argv, log_path);
    sp_wait_ready();
}

/* r is OpenAI's 401: code "invalid_api_key" (wrong key) or null (none). */
static void expect_key_refused(hc_response *r, bool none, const char *what)
{
    cr_assert_eq(r->status, 401, "%s: %d %s", what, r->status, r->body);
    char v[64];
    cr_assert(hc_header(r, "WWW-Authenticate", v, sizeof v), "%s: no WWW-Authenticate", what);
    cr_assert_str_eq(v, "Bearer");
    cJSON *j = sp_json(r->body);
    const cJSON *err = cJSON_GetObjectItemCaseSensitive(j, "error");
    cr_assert(cJSON_IsObject(err), "%s: %s", what, r->body);
    cr_assert_str_eq(sp_str_at(err, "type"), "invalid_request_error", "%s", what);
    cr_assert(strlen(sp_str_at(err, "message")) > 10, "%s", what);
    cr_assert(cJSON_IsNull(cJSON_GetObjectItemCaseSensitive(err, "param")), "%s", what);
    const cJSON *code = cJSON_GetObjectItemCaseSensitive(err, "code");
    if (none) {
        cr_assert(cJSON_IsNull(code), "%s: %s", what, r->body);
        cr_assert(strstr(sp_str_at(err, "message"), "didn't provide an API key"), "%s", what);
    } else {
        cr_assert(cJSON_IsString(code) && strcmp(code->valuestring, "invalid_api_key") == 0,
                  "%s: %s", what, r->body);
    }
    cr_assert_eq(cJSON_GetArraySize(err), 4, "%s: %s", what, r->body);
    cJSON_Delete(j);
}

static const char completion[] = "{\"prompt\": \"Hi\", \"max_tokens\": 2}";
static const char generation[] = "{\"inputs\": \"Hi\", \"parameters\": {\"max_new_tokens\": 2}}";

/* --- the constant-time compare ------------------------------------------------------ */

Test(secret, equal_only_when_every_byte_and_the_length_agree)
{
    cr_assert(srv_secret_equal("abc", 3, "abc"));
    cr_assert_not(srv_secret_equal("abd", 3, "abc"));
    cr_assert_not(srv_secret_equal("xbc", 3, "abc"));
    cr_assert_not(srv_secret_equal("ab", 2, "abc"));    /* a prefix */
    cr_assert_not(srv_secret_equal("abcd", 4, "abc"));  /* longer */
    cr_assert_not(srv_secret_equal("abc\0", 4, "abc")); /* a NUL past the key */
    cr_assert_not(srv_secret_equal("", 0, "abc"));
    cr_assert(srv_secret_equal("abc", 2, "ab")); /* only given_len bytes count */
    char longest[CFG_SECRET_MAX + 2];
    memset(longest, 'k', sizeof longest);
    longest[CFG_SECRET_MAX] = 0;
    cr_assert(srv_secret_equal(longest, CFG_SECRET_MAX, longest));
    char other[CFG_SECRET_MAX + 1];
    memcpy(other, longest, sizeof other);
    other[CFG_SECRET_MAX - 1] = 'j'; /* the last byte differs */
    cr_assert_not(srv_secret_equal(other, CFG_SECRET_MAX, longest));
    longest[CFG_SECRET_MAX] = 'k'; /* one over the limit, on either side */
    longest[CFG_SECRET_MAX + 1] = 0;
    cr_assert_not(srv_secret_equal(longest, CFG_SECRET_MAX + 1, longest));
    cr_assert_not(srv_secret_equal("k", 1, longest));
}

/* --- the API key --------------------------------------------------------------------- */

Test(auth, health_is_open_and_every_other_route_wants_the_key)
{
    test_write_text(key_file, KEY "\n");
    start((const char *[]){"--api-key-file", key_file, NULL});
    hc_response r = sp_request("GET", "/health", NULL, NULL);
    cr_assert_eq(r.status, 200, "%s", r.body);
    hc_response_free(&r);
    r = sp_request("GET", "/", NULL, NULL);
    cr_assert_eq(r.status, 200, "GET / is TGI's health: %s", r.body);
    hc_response_free(&r);

    static const struct {
        const char *method, *path, *body;
    } routes[] = {
        {"GET", "/v1/models", NULL},
        {"GET", "/info", NULL},
        {"GET", "/metrics", NULL},
        {"POST", "/v1/completions", completion},
        {"POST", "/generate", generation},
        {"POST", "/", generation},
        {"POST", "/tokenize", "{\"inputs\": \"Hi\"}"},
        {"GET", "/no/such/route", NULL}, /* 401 before 404: no key, no map of the routes */
        {"POST", "/health", NULL},       /* the 405 is open, as /health is */
    };
    static const char *const wrong[] = {
        "Authorization: Bearer sk-qlserve-test-key-012345678\r\n",   /* one short */
        "Authorization: Bearer sk-qlserve-test-key-01234567890\r\n", /* one more */
        "Authorization: Bearer sk-qlserve-test-key-0123456788\r\n",  /* the last differs */
        "Authorization: Basic " KEY "\r\n",                          /* not Bearer */
        "Authorization: Bearer " ADMIN_TOKEN "\r\n",
    };
    for (size_t i = 0; i < sizeof routes / sizeof *routes; i++) {
        char what[128];
        snprintf(what, sizeof what, "%s %s", routes[i].method, routes[i].path);
        bool open = strcmp(routes[i].path, "/health") == 0;
        r = sp_request(routes[i].method, routes[i].path, NULL, routes[i].body);
        if (open)
            cr_assert_eq(r.status, 405, "%s: %d", what, r.status);
        else
            expect_key_refused(&r, true, what);
        hc_response_free(&r);
        for (size_t k = 0; k < sizeof wrong / sizeof *wrong && !open; k++) {
            r = sp_request(routes[i].method, routes[i].path, wrong[k], routes[i].body);
            expect_key_refused(&r, false, what);
            hc_response_free(&r);
        }
        r = sp_request(routes[i].method, routes[i].path, WITH_KEY, routes[i].body);
        int want = strcmp(routes[i].path, "/no/such/route") == 0 ? 404 : open ? 405 : 200;
        cr_assert_eq(r.status, want, "%s with the key: %d %s", what, r.status, r.body);
        hc_response_free(&r);
    }
    /* the scheme is case-insensitive */
    r = sp_request("GET", "/v1/models", "Authorization: bearer " KEY "\r\n", NULL);
    cr_assert_eq(r.status, 200, "%s", r.body);
    hc_response_free(&r);
    sp_stop_cleanly();
}

Test(auth, streams_want_the_key_too)
{
    test_write_text(key_file, KEY);
    start((const char *[]){"--api-key-file", key_file, NULL});
    hc_response r = sp_request("POST", "/generate_stream", NULL, generation);
    expect_key_refused(&r, true, "/generate_stream");
    hc_response_free(&r);
    r = sp_request("POST", "/v1/completions", "Authorization: Bearer nope\r\n",
                   "{\"prompt\": \"Hi\", \"max_tokens\": 2, \"stream\": true}");
    expect_key_refused(&r, false, "/v1/completions stream");
    hc_response_free(&r);

    hc_conn c;
    r = (hc_response){0};
    cr_assert(hc_open(&c, sp.port));
    cr_assert(hc_send_request(&c, "POST", "/generate_stream", WITH_KEY, generation));
    cr_assert(hc_read_head(&c, &r));
    cr_assert_eq(r.status, 200);
    int events = 0;
    for (char *ev; (ev = hc_next_event(&c, &r)); events++)
        free(ev);
    cr_assert_geq(events, 1, "the stream carries its tokens");
    cr_assert(r.body_done);
    hc_response_free(&r);
    hc_close(&c);
    sp_stop_cleanly();
}

Test(auth, admin_routes_want_the_admin_token_not_the_api_key)
{
    test_write_text(key_file, KEY "\n");
    test_write_text(token_file, ADMIN_TOKEN "\n");
    start((const char *[]){"--api-key-file", key_file, "--admin-token-file", token_file, NULL});
    hc_response r = sp_request("GET", "/admin/state", WITH_KEY, NULL);
    cr_assert_eq(r.status, 401, "the API key is no admin token: %s", r.body);
    cr_assert(strstr(r.body, "admin bearer token"), "%s", r.body);
    hc_response_free(&r);
    r = sp_request("GET", "/admin/state", "Authorization: Bearer " ADMIN_TOKEN "\r\n", NULL);
    cr_assert_eq(r.status, 200, "%s", r.body);
    hc_response_free(&r);
    r = sp_request("GET", "/v1/models", "Authorization: Bearer " ADMIN_TOKEN "\r\n", NULL);
    expect_key_refused(&r, false, "the admin token is no API key");
    hc_response_free(&r);
    sp_stop_cleanly();
}

/* A local address outside 127.0.0.0/8, held by this test alone. */
#define ELSEWHERE "10.29.0.1"

/*
 * Move this test's process (Criterion runs each test in its own) into a
 * network namespace of its own, whose loopback interface also holds
 * ELSEWHERE: the server it then starts listens there, and a client bound to
 * ELSEWHERE is a peer outside 127.0.0.0/8 without any other machine or
 * interface, and without touching the host's network. Needs root
 * (CAP_SYS_ADMIN for the namespace, CAP_NET_ADMIN inside it); without it
 * the test cannot run, loudly (a failure under QL_REQUIRE_ALL=1).
 */
static void enter_network_with_elsewhere(void)
{
    if (unshare(CLONE_NEWNET) != 0)
        test_cannot_run("a network namespace of its own needs root: unshare: %s", strerror(errno));
    int fd = socket(AF_INET, SOCK_DGRAM, 0);
    cr_assert_geq(fd, 0, "socket: %s", strerror(errno));
    struct ifreq ifr = {0};
    snprintf(ifr.ifr_name, sizeof ifr.ifr_name, "lo");
    cr_assert_eq(ioctl(fd, SIOCGIFFLAGS, &ifr), 0, "lo's flags: %s", strerror(errno));
    ifr.ifr_flags |= IFF_UP;
    cr_assert_eq(ioctl(fd, SIOCSIFFLAGS, &ifr), 0, "lo up: %s", strerror(errno));
    /* a second address on lo, under the alias label lo:1 */
    memset(&ifr, 0, sizeof ifr);
    snprintf(ifr.ifr_name, sizeof ifr.ifr_name, "lo:1");
    struct sockaddr_in *a = (struct sockaddr_in *)&ifr.ifr_addr;
    a->sin_family = AF_INET;
    cr_assert_eq(inet_pton(AF_INET, ELSEWHERE, &a->sin_addr), 1);
    cr_assert_eq(ioctl(fd, SIOCSIFADDR, &ifr), 0, "%s on lo: %s", ELSEWHERE, strerror(errno));
    close(fd);
}

/* GET path with headers (NULL: none) on the server, from a client bound to
 * source (not 127.0.0.1). */
static hc_response request_from(const char *source, const char *path, const char *headers)
{
    hc_conn c = {.fd = socket(AF_INET, SOCK_STREAM, 0)};
    cr_assert_geq(c.fd, 0, "socket: %s", strerror(errno));
    struct sockaddr_in from = {.sin_family = AF_INET};
    cr_assert_eq(inet_pton(AF_INET, source, &from.sin_addr), 1);
    cr_assert_eq(bind(c.fd, (struct sockaddr *)&from, sizeof from), 0, "bind %s: %s", source,
                 strerror(errno));
    struct sockaddr_in to = {.sin_family = AF_INET, .sin_port = htons((uint16_t)sp.port)};
    to.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
    cr_assert_eq(connect(c.fd, (struct sockaddr *)&to, sizeof to), 0, "connect from %s: %s", source,
                 strerror(errno));
    hc_response r = {0};
    char head[512];
    snprintf(head, sizeof head, "Connection: close\r\n%s", headers ? headers : "");
    cr_assert(hc_send_request(&c, "GET", path, head, NULL) && hc_read_response(&c, &r),
              "GET %s from %s: no response", path, source);
    hc_close(&c);
    return r;
}

/* Without an admin token the admin routes answer a loopback client, key
 * or no key, and refuse any other peer with a 403; the same request from
 * both, to the same server, so only the peer's address differs. */
Test(auth, without_an_admin_token_admin_stays_loopback_only_and_key_free)
{
    enter_network_with_elsewhere();
    test_write_text(key_file, KEY "\n");
    start((const char *[]){"--api-key-file", key_file, NULL});
    hc_response r = sp_request("GET", "/admin/adapters", NULL, NULL);
    cr_assert_eq(r.status, 200, "%s", r.body);
    hc_response_free(&r);
    r = request_from(ELSEWHERE, "/admin/adapters", NULL);
    cr_assert_eq(r.status, 403, "a peer at %s reached the admin routes: %d %s", ELSEWHERE, r.status,
                 r.body);
    cr_assert(strstr(r.body, "only to loopback clients"), "%s", r.body);
    hc_response_free(&r);
    /* the API is not loopback-only: the same peer with the key is served */
    r = request_from(ELSEWHERE, "/v1/models", WITH_KEY);
    cr_assert_eq(r.status, 200, "%s", r.body);
    hc_response_free(&r);
    sp_stop_cleanly();
}

/* The server exits at start with status 2 and a message naming the file
 * and what is wrong with it. */
static void expect_refused_at_start(const char *file_text, const char *needle)
{
    if (file_text)
        test_write_text(key_file, file_text);
    const char *argv[] = {QL_BINARY, "serve",          "--model", model_dir, "--port",
                          "0",       "--api-key-file", key_file,  NULL};
    sp_spawn(argv, log_path);
    int st = 0;
    cr_assert_eq(waitpid(sp.pid, &st, 0), sp.pid);
    sp.pid = -1;
    char *log = sp_read_log();
    cr_assert(WIFEXITED(st) && WEXITSTATUS(st) != 0, "it served: %s", log);
    cr_assert(strstr(log, key_file), "the message does not name %s: %s", key_file, log);
    cr_assert(strstr(log, needle), "wanted \"%s\": %s", needle, log);
    cr_assert_null(strstr(log, "listening"), "%s", log);
    free(log);
}

Test(auth, a_bad_key_file_stops_the_server_naming_it)
{
    expect_refused_at_start("", "the file is empty");
    expect_refused_at_start("\n", "the API key is empty");
    expect_refused_at_start("sk-with\x01"
                            "control\n",
                            "control character");
    expect_refused_at_start("sk with space\n", "space or control character");
    unlink(key_file);
    expect_refused_at_start(NULL, "cannot read the API key");
}

/* --- what a web page can send ------------------------------------------------------- */

/* method path with exactly the request head lines given (host: the Host
 * header's value, NULL: none; more: whole lines or NULL) and body (NULL:
 * none, else sent with Content-Length and no Content-Type unless more has
 * one): what a browser's request looks like, which hc_request cannot make. */
static hc_response raw_request(const char *method, const char *path, const char *host,
                               const char *more, const char *body)
{
    hc_conn c;
    cr_assert(hc_open(&c, sp.port));
    char head[2048];
    int n = snprintf(head, sizeof head, "%s %s HTTP/1.1\r\n", method, path);
    if (host)
        n += snprintf(head + n, sizeof head - (size_t)n, "Host: %s\r\n", host);
    n += snprintf(head + n, sizeof head - (size_t)n, "Connection: close\r\n%s", more ? more : "");
    if (body)
        n += snprintf(head + n, sizeof head - (size_t)n, "Content-Length: %zu\r\n", strlen(body));
    snprintf(head + n, sizeof head - (size_t)n, "\r\n%s", body ? body : "");
    hc_response r = {0};
    cr_assert(hc_send_str(&c, head) && hc_read_response(&c, &r), "%s %s: no response", method,
              path);
    hc_close(&c);
    return r;
}

/* r is a 403 whose message holds needle. */
static void expect_forbidden(hc_response *r, const char *needle, const char *what)
{
    cr_assert_eq(r->status, 403, "%s: %d %s", what, r->status, r->body);
    cr_assert(strstr(r->body, needle), "%s: the 403 does not say \"%s\": %s", what, needle,
              r->body);
    hc_response_free(r);
}

#define JSON_TYPE "Content-Type: application/json\r\n"

/* Without an admin token, a loopback server's admin routes take what curl
 * and scripts send (JSON, a loopback Host) and refuse what a web page the
 * user opens can send: a "simple" cross-site POST (text/plain, a form, no
 * body type), a foreign Origin, a DNS-rebound Host (evil.example:PORT),
 * which guards the inference routes too. Each 403 names its reason. */
Test(auth, without_a_token_admin_refuses_what_a_web_page_can_send)
{
    start(NULL);
    char own[64], rebound[64], own_origin[96];
    snprintf(own, sizeof own, "127.0.0.1:%d", sp.port);
    snprintf(rebound, sizeof rebound, "evil.example:%d", sp.port);
    snprintf(own_origin, sizeof own_origin, "Origin: http://127.0.0.1:%d\r\n" JSON_TYPE, sp.port);
    const char *merge = "/admin/engine/resume", *body = "{}";
    hc_response r = raw_request("POST", merge, own, "Content-Type: text/plain\r\n", body);
    expect_forbidden(&r, "Content-Type text/plain", "a simple cross-site POST");
    r = raw_request("POST", merge, own, "Content-Type: application/x-www-form-urlencoded\r\n",
                    body);
    expect_forbidden(&r, "Content-Type application/x-www-form-urlencoded", "a form");
    r = raw_request("POST", merge, own, NULL, NULL);
    expect_forbidden(&r, "Content-Type (none)", "a POST without a body");
    r = raw_request("POST", merge, own, "Origin: http://evil.example\r\n" JSON_TYPE, body);
    expect_forbidden(&r, "Origin http://evil.example", "a foreign origin, even with JSON");
    r = raw_request("POST", merge, own, "Origin: null\r\n" JSON_TYPE, body);
    expect_forbidden(&r, "Origin null", "a sandboxed page");
    r = raw_request("POST", merge, rebound, JSON_TYPE, body);
    expect_forbidden(&r, "Host evil.example", "DNS rebinding, a POST");
    r = raw_request("GET", "/admin/adapters", rebound, NULL, NULL);
    expect_forbidden(&r, "Host evil.example", "DNS rebinding, an admin read");
    r = raw_request("GET", "/admin/adapters", own, "Origin: http://evil.example\r\n", NULL);
    expect_forbidden(&r, "Origin http://evil.example", "a cross-origin admin read");
    r = raw_request("GET", "/v1/models", rebound, NULL, NULL);
    expect_forbidden(&r, "--allowed-hosts", "DNS rebinding, the inference routes");
    r = raw_request("POST", "/v1/completions", rebound, JSON_TYPE, completion);
    expect_forbidden(&r, "Host evil.example", "DNS rebinding, a generation");
    r = raw_request("GET", "/v1/models", "localhost:1", NULL, NULL);
    expect_forbidden(&r, "Host localhost:1", "a loopback name with another port");

    /* what curl, the SDKs and a same-origin page send is served */
    const char *fine[][2] = {
        {own, JSON_TYPE},
        {"localhost", "Content-Type: Application/JSON; charset=utf-8\r\n"},
        {own, own_origin},
    };
    for (size_t i = 0; i < sizeof fine / sizeof *fine; i++) {
        r = raw_request("POST", merge, fine[i][0], fine[i][1], body);
        cr_assert_eq(r.status, 200, "%zu: %d %s", i, r.status, r.body);
        hc_response_free(&r);
    }
    char v6[64];
    snprintf(v6, sizeof v6, "[::1]:%d", sp.port);
    const char *hosts[] = {own, v6, "localhost", "127.0.0.2", NULL /* HTTP/1.0 style */};
    for (size_t i = 0; i < sizeof hosts / sizeof *hosts; i++) {
        r = raw_request("GET", "/v1/models", hosts[i], NULL, NULL);
        cr_assert_eq(r.status, 200, "Host %s: %d %s", hosts[i] ? hosts[i] : "(none)", r.status,
                     r.body);
        hc_response_free(&r);
    }
    /* a DELETE is never sent cross-site unasked: no Content-Type wanted */
    r = raw_request("DELETE", "/admin/adapters/nope", own, NULL, NULL);
    cr_assert_eq(r.status, 404, "%d %s", r.status, r.body);
    hc_response_free(&r);
    sp_stop_cleanly();
}

/* A reverse proxy or tunnel that sends its own Host is let in by
 * --allowed-hosts: a name alone takes any port, name:port that port. */
Test(auth, allowed_hosts_lets_a_proxy_name_in)
{
    start((const char *[]){"--allowed-hosts", "llm.internal, localhost:9000", NULL});
    const char *ok[] = {"llm.internal", "LLM.internal:443", "localhost:9000"};
    for (size_t i = 0; i < sizeof ok / sizeof *ok; i++) {
        hc_response r = raw_request("GET", "/v1/models", ok[i], NULL, NULL);
        cr_assert_eq(r.status, 200, "Host %s: %d %s", ok[i], r.status, r.body);
        hc_response_free(&r);
    }
    hc_response r = raw_request("GET", "/v1/models", "localhost:9001", NULL, NULL);
    expect_forbidden(&r, "one of --allowed-hosts llm.internal, localhost:9000", "another port");
    r = raw_request("GET", "/v1/models", "evil.example", NULL, NULL);
    expect_forbidden(&r, "Host evil.example", "a name not listed");
    /* a probe dials an address the server cannot know: health answers */
    r = raw_request("GET", "/health", "10.1.2.3:8080", NULL, NULL);
    cr_assert_eq(r.status, 200, "%d %s", r.status, r.body);
    hc_response_free(&r);
    sp_stop_cleanly();
}

/* --host 0.0.0.0 (the rule is about the address listened on, not the
 * peer: the test connects through 127.0.0.1) with no admin token: one is
 * generated into the state directory, mode 0600, the log says where, and
 * the admin routes want it from every peer, loopback included; the Host
 * rule, a loopback server's, is off. A restart keeps the same token. */
Test(auth, a_network_host_without_a_token_generates_one)
{
    const char *args[] = {"--host", "0.0.0.0", NULL};
    start(args);
    char state_dir[660], path[700];
    sp_state_dir(log_path, state_dir, sizeof state_dir);
    snprintf(path, sizeof path, "%s/admin-token", state_dir);
    struct stat sb;
    cr_assert_eq(stat(path, &sb), 0, "no token file %s: %s", path, sp_read_log());
    cr_assert_eq(sb.st_mode & 0777, 0600, "mode %o", sb.st_mode & 0777);
    char *log = sp_read_log();
    cr_assert(strstr(log, path) && strstr(log, "generated"), "the log does not say where: %s", log);
    FILE *f = fopen(path, "rb");
    cr_assert(f);
    char token[128] = "", auth[200];
    cr_assert(fgets(token, sizeof token, f));
    fclose(f);
    token[strcspn(token, "\n")] = 0;
    cr_assert_eq(strlen(token), 64, "%s", token);
    cr_assert_null(strstr(log, token), "the log shows the token");
    free(log);
    hc_response r = sp_request("POST", "/admin/engine/resume", NULL, "{}");
    cr_assert_eq(r.status, 401, "a loopback peer without the token: %d %s", r.status, r.body);
    hc_response_free(&r);
    r = sp_request("GET", "/admin/adapters", NULL, NULL);
    cr_assert_eq(r.status, 401, "%d %s", r.status, r.body);
    hc_response_free(&r);
    snprintf(auth, sizeof auth, "Authorization: Bearer %s\r\n", token);
    r = sp_request("POST", "/admin/engine/resume", auth, "{}");
    cr_assert_eq(r.status, 200, "%d %s", r.status, r.body);
    hc_response_free(&r);
    r = raw_request("GET", "/v1/models", "llm.example.com", NULL, NULL);
    cr_assert_eq(r.status, 200, "a network server answers any Host: %d %s", r.status, r.body);
    hc_response_free(&r);
    sp_stop_cleanly();

    start(args);
    log = sp_read_log();
    cr_assert(strstr(log, "kept in") && strstr(log, path), "%s", log);
    free(log);
    r = sp_request("GET", "/admin/adapters", auth, NULL);
    cr_assert_eq(r.status, 200, "the same token after a restart: %d %s", r.status, r.body);
    hc_response_free(&r);
    sp_stop_cleanly();
}

/* --- CORS ---------------------------------------------------------------------------- */

/* r's Access-Control-Allow-Origin is want (NULL: absent); Vary: Origin
 * when there is one, or when vary (the flag is set: every answer varies
 * by origin, listed or not). */
static void expect_cors(const hc_response *r, const char *want, bool vary, const char *what)
{
    char v[300];
    bool has = hc_header(r, "Access-Control-Allow-Origin", v, sizeof v);
    if (!want) {
        cr_assert_not(has, "%s: Access-Control-Allow-Origin: %s", what, v);
        if (vary) {
            cr_assert(hc_header(r, "Vary", v, sizeof v), "%s: no Vary", what);
            cr_assert_str_eq(v, "Origin", "%s", what);
        } else {
            cr_assert_not(hc_header(r, "Vary", v, sizeof v), "%s: Vary: %s", what, v);
        }
        return;
    }
    cr_assert(has, "%s: no Access-Control-Allow-Origin in %s", what, r->head);
    cr_assert_str_eq(v, want, "%s", what);
    cr_assert(hc_header(r, "Vary", v, sizeof v), "%s: no Vary", what);
    cr_assert_str_eq(v, "Origin", "%s", what);
}

static void expect_allow_origin(const hc_response *r, const char *want, const char *what)
{
    expect_cors(r, want, true, what);
}

static hc_response preflight(const char *path, const char *origin, const char *method,
                             const char *asked)
{
    char headers[1024];
    snprintf(headers, sizeof headers, "Origin: %s\r\nAccess-Control-Request-Method: %s\r\n%s%s%s",
             origin, method, asked ? "Access-Control-Request-Headers: " : "", asked ? asked : "",
             asked ? "\r\n" : "");
    return sp_request("OPTIONS", path, headers, NULL);
}

static void expect_header(const hc_response *r, const char *name, const char *want)
{
    char v[600];
    cr_assert(hc_header(r, name, v, sizeof v), "no %s in %s", name, r->head);
    cr_assert_str_eq(v, want, "%s", name);
}

Test(cors, listed_origins_get_the_headers_and_preflights_need_no_key)
{
    test_write_text(key_file, KEY "\n");
    start((const char *[]){"--api-key-file", key_file, "--cors-allow-origin",
                           "https://app.example, http://localhost:5173", NULL});
    static const char app[] = "Origin: https://app.example\r\n";
    hc_response r = sp_request("GET", "/health", app, NULL);
    cr_assert_eq(r.status, 200);
    expect_allow_origin(&r, "https://app.example", "GET /health");
    hc_response_free(&r);
    r = sp_request("GET", "/v1/models", "Origin: http://localhost:5173\r\n" WITH_KEY, NULL);
    cr_assert_eq(r.status, 200, "%s", r.body);
    expect_allow_origin(&r, "http://localhost:5173", "the second origin");
    hc_response_free(&r);
    /* the 401 too, so that the page can read why */
    r = sp_request("GET", "/v1/models", app, NULL);
    expect_key_refused(&r, true, "listed origin, no key");
    expect_allow_origin(&r, "https://app.example", "the 401");
    hc_response_free(&r);
    static const char *const unlisted[] = {"Origin: https://evil.example\r\n",
                                           "Origin: https://app.example.evil\r\n",
                                           "Origin: https://app.exampl\r\n",
                                           "Origin: http://app.example\r\n",
                                           "Origin: null\r\n",
                                           NULL};
    for (size_t i = 0; unlisted[i]; i++) {
        r = sp_request("GET", "/health", unlisted[i], NULL);
        expect_allow_origin(&r, NULL, unlisted[i]);
        hc_response_free(&r);
    }
    r = sp_request("GET", "/health", NULL, NULL);
    expect_allow_origin(&r, NULL, "no Origin");
    hc_response_free(&r);

    /* a preflight: no key, a 204 without a body */
    r = preflight("/v1/chat/completions", "https://app.example", "POST",
                  "authorization, content-type, x-stainless-os,X-Evil, openai-beta");
    cr_assert_eq(r.status, 204, "%s", r.head);
    char v[64];
    cr_assert_not(hc_header(&r, "Content-Length", v, sizeof v), "a 204 has no Content-Length");
    expect_allow_origin(&r, "https://app.example", "the preflight");
    expect_header(&r, "Access-Control-Allow-Methods", "POST, OPTIONS");
    expect_header(&r, "Access-Control-Allow-Headers",
                  "Authorization, Content-Type, x-stainless-os, openai-beta");
    expect_header(&r, "Access-Control-Max-Age", "600");
    hc_response_free(&r);
    r = preflight("/admin/adapters/alpha", "https://app.example", "DELETE", NULL);
    cr_assert_eq(r.status, 204);
    expect_header(&r, "Access-Control-Allow-Methods", "DELETE, OPTIONS");
    expect_header(&r, "Access-Control-Allow-Headers", "Authorization, Content-Type");
    hc_response_free(&r);
    r = preflight("/admin/adapters", "https://app.example", "POST", NULL);
    expect_header(&r, "Access-Control-Allow-Methods", "GET, POST, OPTIONS");
    hc_response_free(&r);
    r = preflight("/not/a/route", "https://app.example", "POST", NULL);
    cr_assert_eq(r.status, 204);
    expect_header(&r, "Access-Control-Allow-Methods", "GET, POST, DELETE, OPTIONS");
    hc_response_free(&r);
    /* an unlisted origin's preflight is an OPTIONS like any other */
    r = preflight("/v1/chat/completions", "https://evil.example", "POST", NULL);
    expect_key_refused(&r, true, "an unlisted preflight");
    expect_allow_origin(&r, NULL, "an unlisted preflight");
    hc_response_free(&r);

    /* a stream to a listed origin */
    hc_conn c;
    r = (hc_response){0};
    cr_assert(hc_open(&c, sp.port));
    cr_assert(hc_send_request(&c, "POST", "/generate_stream",
                              "Origin: https://app.example\r\n" WITH_KEY, generation));
    cr_assert(hc_read_head(&c, &r));
    cr_assert_eq(r.status, 200);
    expect_allow_origin(&r, "https://app.example", "the stream");
    for (char *ev; (ev = hc_next_event(&c, &r));)
        free(ev);
    cr_assert(r.body_done);
    hc_response_free(&r);
    hc_close(&c);
    sp_stop_cleanly();
}

Test(cors, a_star_lets_every_origin_in)
{
    start((const char *[]){"--cors-allow-origin", "*", NULL});
    hc_response r = sp_request("GET", "/v1/models", "Origin: https://anywhere.example\r\n", NULL);
    cr_assert_eq(r.status, 200);
    expect_allow_origin(&r, "*", "*");
    hc_response_free(&r);
    r = preflight("/generate", "http://127.0.0.1:3000", "POST", "content-type");
    cr_assert_eq(r.status, 204);
    expect_allow_origin(&r, "*", "a * preflight");
    /* asked for one already allowed: not repeated */
    expect_header(&r, "Access-Control-Allow-Headers", "Authorization, Content-Type");
    hc_response_free(&r);
    /* OPTIONS that is no preflight (no Access-Control-Request-Method) */
    r = sp_request("OPTIONS", "/generate", "Origin: https://anywhere.example\r\n", NULL);
    cr_assert_eq(r.status, 405, "%s", r.body);
    expect_allow_origin(&r, "*", "a plain OPTIONS");
    hc_response_free(&r);
    sp_stop_cleanly();
}

Test(cors, without_the_flag_nothing_changes)
{
    start(NULL);
    hc_response r = sp_request("GET", "/v1/models", "Origin: https://app.example\r\n", NULL);
    cr_assert_eq(r.status, 200, "no key configured: open");
    expect_cors(&r, NULL, false, "no --cors-allow-origin");
    hc_response_free(&r);
    r = preflight("/v1/completions", "https://app.example", "POST", "authorization");
    cr_assert_eq(r.status, 405, "%s", r.body);
    expect_cors(&r, NULL, false, "preflight without the flag");
    hc_response_free(&r);
    r = preflight("/nowhere", "https://app.example", "POST", NULL);
    cr_assert_eq(r.status, 404, "%s", r.body);
    hc_response_free(&r);
    sp_stop_cleanly();
}

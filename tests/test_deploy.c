/*
 * test_deploy.c - the container and cluster files checked against the
 * server they deploy. No Docker engine and no cluster run in CI, so what can
 * drift is pinned here, statically: the Dockerfile (read line by line), the
 * compose file and the Kubernetes manifests (read with libyaml), the
 * .dockerignore patterns, the admin fan-out script and the operator's guide.
 *
 * "Agrees with the server" means: every config file they carry is fed to
 * cfg_parse_serve with the command line and environment they give it (so an
 * unknown key, a bad value or a missing model stops the test as it would stop
 * the server); the port they expose, publish and probe is the one that
 * config serves on and the server's default; the path their health checks
 * ask for is answered by the server's own router, 200 when serving and 503
 * while loading or draining; the time they allow a stopping container covers
 * the drain grace period; every QLSERVE_ variable they set is one `qlserve
 * serve --help` documents. And the builder stages run the commands CI runs
 * (scripts/install-deps.sh, scripts/test.sh), so a green CI vouches for them.
 *
 * The inference-gateway objects (deploy/gateway) are validated as the API
 * server would validate them, against the CRD schemas copied in deploy/crds
 * (a structural OpenAPI v3 validator below; the CEL rules by hand), and tied
 * to the Deployment they route to: the pool's selector and port, the
 * read-only shared adapter folder.
 *
 * What this cannot see: that the base images exist, that Ubuntu's packages
 * carry what Debian's do, that a cluster accepts the objects. The guide
 * (docs/operations.md) says what was checked where.
 */
#define _GNU_SOURCE /* strcasestr */
#include <cjson/cJSON.h>
#include <criterion/criterion.h>
#include <ctype.h>
#include <dirent.h>
#include <errno.h>
#include <fnmatch.h>
#include <regex.h>
#include <stdarg.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>
#include <yaml.h>

#include "config.h"
#include "lora.h"
#include "pattern.h" /* adapters/internal: lora_pattern_compile */
#include "ql_base.h"
#include "server.h"
#include "test_util.h"

extern char **environ;

/* ---- files of the source tree --------------------------------------------- */

static char *read_text(const char *rel)
{
    char path[1024];
    snprintf(path, sizeof path, "%s/%s", QL_SOURCE_DIR, rel);
    char *text = test_read_file(path, NULL);
    cr_assert(text, "%s: cannot read: %s", rel, strerror(errno));
    return text;
}

static bool source_file_is(const char *rel, bool executable)
{
    char path[1024];
    struct stat st;
    snprintf(path, sizeof path, "%s/%s", QL_SOURCE_DIR, rel);
    return stat(path, &st) == 0 && S_ISREG(st.st_mode) && (!executable || access(path, X_OK) == 0);
}

static char *trim(char *s)
{
    while (isspace((unsigned char)*s))
        s++;
    size_t n = strlen(s);
    while (n && isspace((unsigned char)s[n - 1]))
        s[--n] = 0;
    return s;
}

/* a and b are both there and equal (a YAML lookup may find nothing) */
static bool same(const char *a, const char *b)
{
    return a && b && strcmp(a, b) == 0;
}

static bool starts_with(const char *s, const char *prefix)
{
    return strncmp(s, prefix, strlen(prefix)) == 0;
}

/* name occurs in text as a whole word: not inside a longer name */
static bool has_name(const char *text, const char *name)
{
    size_t n = strlen(name);
    for (const char *p = strstr(text, name); p; p = strstr(p + 1, name)) {
        bool before = p == text || !(isalnum((unsigned char)p[-1]) || strchr("_-./", p[-1]));
        bool after = !(isalnum((unsigned char)p[n]) || p[n] == '_' || p[n] == '-');
        if (before && after)
            return true;
    }
    return false;
}

/* some maximal run of digits in text is n ("127.0.0.1:8080" holds 8080) */
static bool has_number(const char *text, long n)
{
    for (const char *p = text; *p;) {
        if (!isdigit((unsigned char)*p)) {
            p++;
            continue;
        }
        char *end;
        long v = strtol(p, &end, 10);
        if (v == n)
            return true;
        p = end;
    }
    return false;
}

/* The path a health check asks for: the first "/health..." in its command. */
static void health_path(const char *command, char *path, size_t len, const char *where)
{
    const char *p = strstr(command, "/health");
    cr_assert(p, "%s: the health check asks no /health path: %s", where, command);
    size_t n = strspn(p, "abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789_-./");
    cr_assert(n < len);
    memcpy(path, p, n);
    path[n] = 0;
}

/* ---- the server's own answers ---------------------------------------------- */

static void clear_qlserve_env(void)
{
    for (;;) {
        char name[256] = "";
        for (char **e = environ; *e; e++) {
            if (strncmp(*e, "QLSERVE_", 8) == 0) {
                snprintf(name, sizeof name, "%.*s", (int)strcspn(*e, "="), *e);
                break;
            }
        }
        if (!name[0])
            return;
        unsetenv(name);
    }
}

/* What a config makes the server do, copied out of its cfg_serve. */
typedef struct served {
    char host[256];
    int port;
    int grace_ms;
    char model[1024];
    char adapter_dir[1024];
} served;

/* `qlserve serve ARGS` as a deployment runs it: args[0] is "serve"; the
 * value after "--config" is replaced by a file holding config_text (which
 * must be there: deployments name their config). The environment holds the
 * QLSERVE_ variables the caller set, and nothing else of ours. */
static served serve_with(const char *config_text, const cJSON *args, const char *where)
{
    char dir[512], path[600], msg[2048] = "";
    test_tmpdir(dir, sizeof dir);
    cr_assert(dir[0]);
    snprintf(path, sizeof path, "%s/config.json", dir);
    FILE *f = fopen(path, "wb");
    cr_assert(f);
    cr_assert_eq(fwrite(config_text, 1, strlen(config_text), f), strlen(config_text));
    fclose(f);

    int argc = cJSON_GetArraySize(args);
    cr_assert(argc >= 1 && argc < 64, "%s: no command", where);
    char *argv[64];
    bool config_named = false;
    for (int i = 0; i < argc; i++) {
        const cJSON *a = cJSON_GetArrayItem(args, i);
        cr_assert(cJSON_IsString(a), "%s: the command's words must be strings", where);
        argv[i] = a->valuestring;
        if (i > 0 && strcmp(argv[i - 1], "--config") == 0) {
            argv[i] = path;
            config_named = true;
        }
    }
    argv[argc] = NULL;
    cr_assert_str_eq(argv[0], "serve", "%s: the command is not `qlserve serve`", where);
    cr_assert(config_named, "%s: the command names no --config FILE", where);

    cfg_serve c;
    int rc = cfg_parse_serve(argc, argv, &c, msg, sizeof msg);
    cr_assert_eq(rc, QL_OK, "%s: qlserve serve refuses it: %s", where, msg);
    served s = {.port = c.port, .grace_ms = c.grace_ms};
    snprintf(s.host, sizeof s.host, "%s", c.host);
    snprintf(s.model, sizeof s.model, "%s", c.model.path);
    snprintf(s.adapter_dir, sizeof s.adapter_dir, "%s", c.adapter_dir ? c.adapter_dir : "");
    cfg_serve_free(&c);
    test_rmtree(dir);
    return s;
}

/* The defaults, with nothing but a model named. */
static served server_defaults(void)
{
    char *argv[] = {"serve", "--model", "m", NULL};
    char msg[1024];
    cfg_serve c;
    clear_qlserve_env();
    cr_assert_eq(cfg_parse_serve(3, argv, &c, msg, sizeof msg), QL_OK, "%s", msg);
    served s = {.port = c.port, .grace_ms = c.grace_ms};
    snprintf(s.host, sizeof s.host, "%s", c.host);
    cfg_serve_free(&c);
    return s;
}

static bool loopback_host(const char *host)
{
    return starts_with(host, "127.") || strcmp(host, "localhost") == 0 || strcmp(host, "::1") == 0;
}

/* `qlserve serve --help`: every QLSERVE_ variable is named there as "env X" */
static bool documented_variable(const char *name)
{
    char *usage = NULL;
    size_t len = 0;
    FILE *f = open_memstream(&usage, &len);
    cr_assert(f);
    cfg_print_usage(f, "serve");
    fclose(f);
    char want[300];
    snprintf(want, sizeof want, "env %s", name);
    bool found = false;
    for (const char *p = strstr(usage, want); p && !found; p = strstr(p + 1, want)) {
        char next = p[strlen(want)];
        found = !(isalnum((unsigned char)next) || next == '_');
    }
    free(usage);
    return found;
}

typedef struct first_status {
    int status;
} first_status;

static void status_sink(srv_conn *c, const char *data, size_t len)
{
    first_status *st = c->sink_data;
    if (st->status == 0 && len > 12 && memcmp(data, "HTTP/1.1 ", 9) == 0)
        st->status = atoi(data + 9);
}

/* The status the server's router gives GET path from a remote client (a
 * kubelet, Docker's health checker) on a server with no engine: loading
 * (serving false), serving, or draining. The fuzz target's setup. */
static int route_status(const char *path, bool serving, bool draining)
{
    cfg_serve cfg = {
        .host = "0.0.0.0",
        /* as deployed: a network listener always has an admin token (the
         * files give one; the server generates one otherwise), so the Host
         * rule of a loopback or tokenless server does not apply */
        .admin_token = "probe-admin-token",
        .kv_mib = 16,
        .max_running = 4,
        .max_queued = 8,
        .max_new_tokens = 16,
        .max_context = 64,
        .max_connections = 8,
        .max_body_bytes = 65536,
        .max_header_bytes = 8192,
        .request_timeout_ms = 30000,
        .keepalive_timeout_ms = 60000,
        .grace_ms = 1000,
        .merge_threads = 1,
    };
    srv_server *s = calloc(1, sizeof *s);
    srv_conn *c = calloc(1, sizeof *c);
    cr_assert(s && c);
    s->cfg = &cfg;
    s->serving = serving;
    s->draining = draining;
    snprintf(s->model_id, sizeof s->model_id, "probe-model");
    srv_metrics_init(&s->metrics);
    srv_http_settings(&s->http_settings);
    first_status st = {0};
    c->sink = status_sink;
    c->sink_data = &st;
    srv_conn_init_detached(s, c);
    c->loopback = false;
    char request[700];
    snprintf(request, sizeof request, "GET %s HTTP/1.1\r\nHost: probe\r\n\r\n", path);
    srv_conn_feed(c, request, strlen(request));
    srv_conn_release_detached(c);
    free(c);
    free(s);
    return st.status;
}

/* path is the server's health route: 200 serving, 503 loading and draining */
static void assert_health_route(const char *path, const char *where)
{
    cr_assert_eq(route_status(path, true, false), 200,
                 "%s: GET %s on a serving server answers %d, not 200", where, path,
                 route_status(path, true, false));
    cr_assert_eq(route_status(path, false, false), 503,
                 "%s: GET %s while the model loads answers %d, not 503", where, path,
                 route_status(path, false, false));
    cr_assert_eq(route_status(path, true, true), 503,
                 "%s: GET %s while draining answers %d, not 503", where, path,
                 route_status(path, true, true));
}

/* ---- the Dockerfile, line by line ------------------------------------------ */

#define MAX_INSTR  128
#define MAX_STAGES 8
#define MAX_ARGS   8

typedef struct instr {
    char cmd[16]; /* upper case */
    char *args;   /* the rest, continuation lines joined */
    int line;
    int stage; /* -1 before the first FROM */
} instr;

typedef struct stage {
    char name[64];
    char base[256]; /* global ARGs substituted */
} stage;

typedef struct dockerfile {
    instr in[MAX_INSTR];
    size_t n;
    stage st[MAX_STAGES];
    int n_st;
    char arg_name[MAX_ARGS][64], arg_value[MAX_ARGS][256];
    size_t n_args;
} dockerfile;

/* ${NAME} and $NAME replaced by the global ARGs' defaults */
static void expand_args(const dockerfile *df, const char *in, char *out, size_t len)
{
    size_t o = 0;
    while (*in && o + 1 < len) {
        if (*in != '$') {
            out[o++] = *in++;
            continue;
        }
        bool braced = in[1] == '{';
        const char *name = in + 1 + braced;
        size_t n = strspn(name, "ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789_");
        const char *value = "";
        for (size_t a = 0; a < df->n_args; a++)
            if (strlen(df->arg_name[a]) == n && strncmp(df->arg_name[a], name, n) == 0)
                value = df->arg_value[a];
        o += (size_t)snprintf(out + o, len - o, "%s", value);
        in = name + n + (braced && name[n] == '}');
    }
    out[o < len ? o : len - 1] = 0;
}

static void finish_instr(dockerfile *df, char *text, int line)
{
    char *t = trim(text);
    if (!*t)
        return;
    cr_assert(df->n < MAX_INSTR);
    instr *in = &df->in[df->n++];
    size_t k = strcspn(t, " \t");
    cr_assert(k < sizeof in->cmd, "Dockerfile:%d: %s", line, t);
    for (size_t i = 0; i < k; i++)
        in->cmd[i] = (char)toupper((unsigned char)t[i]);
    in->args = strdup(trim(t + k));
    in->line = line;
    if (strcmp(in->cmd, "ARG") == 0 && df->n_st == 0) {
        cr_assert(df->n_args < MAX_ARGS);
        size_t eq = strcspn(in->args, "=");
        snprintf(df->arg_name[df->n_args], sizeof df->arg_name[0], "%.*s", (int)eq, in->args);
        snprintf(df->arg_value[df->n_args], sizeof df->arg_value[0], "%s",
                 in->args[eq] ? in->args + eq + 1 : "");
        df->n_args++;
    }
    if (strcmp(in->cmd, "FROM") == 0) {
        cr_assert(df->n_st < MAX_STAGES);
        stage *s = &df->st[df->n_st++];
        char words[3][256] = {{0}};
        int n = 0;
        char *copy = strdup(in->args), *save = NULL;
        for (char *w = strtok_r(copy, " \t", &save); w && n < 3; w = strtok_r(NULL, " \t", &save))
            if (!starts_with(w, "--"))
                snprintf(words[n++], sizeof words[0], "%s", w);
        free(copy);
        expand_args(df, words[0], s->base, sizeof s->base);
        if (n == 3 && strcasecmp(words[1], "AS") == 0)
            snprintf(s->name, sizeof s->name, "%.63s", words[2]);
    }
    in->stage = df->n_st - 1;
}

static void dockerfile_load(dockerfile *df)
{
    memset(df, 0, sizeof *df);
    char *text = read_text("Dockerfile");
    size_t cap = strlen(text) + 1, used = 0;
    char *joined = malloc(cap);
    cr_assert(joined);
    joined[0] = 0;
    int lineno = 0, start = 0;
    for (char *p = text; *p;) {
        size_t len = strcspn(p, "\n");
        char *line = strndup(p, len);
        p += len + (p[len] == '\n');
        lineno++;
        char *t = trim(line);
        /* comments go, even between continuation lines, as Docker drops them */
        if (*t && *t != '#') {
            if (!used)
                start = lineno;
            used += (size_t)snprintf(joined + used, cap - used, "%s%s", used ? " " : "", t);
            if (joined[used - 1] == '\\') {
                joined[--used] = 0;
            } else {
                finish_instr(df, joined, start);
                used = 0;
                joined[0] = 0;
            }
        }
        free(line);
    }
    if (used)
        finish_instr(df, joined, start);
    free(joined);
    free(text);
}

static void dockerfile_free(dockerfile *df)
{
    for (size_t i = 0; i < df->n; i++)
        free(df->in[i].args);
}

static int stage_named(const dockerfile *df, const char *name)
{
    for (int s = 0; s < df->n_st; s++)
        if (strcmp(df->st[s].name, name) == 0)
            return s;
    return -1;
}

/* the last instruction cmd of stage s (the one that counts), or NULL */
static const instr *last_in_stage(const dockerfile *df, int s, const char *cmd)
{
    const instr *found = NULL;
    for (size_t i = 0; i < df->n; i++)
        if (df->in[i].stage == s && strcmp(df->in[i].cmd, cmd) == 0)
            found = &df->in[i];
    return found;
}

/* The stage a runtime stage copies the qlserve binary from. */
static int builder_of(const dockerfile *df, int s)
{
    for (size_t i = 0; i < df->n; i++) {
        const instr *in = &df->in[i];
        if (in->stage != s || strcmp(in->cmd, "COPY") != 0 || !starts_with(in->args, "--from="))
            continue;
        char from[64];
        snprintf(from, sizeof from, "%.*s", (int)strcspn(in->args + 7, " \t"), in->args + 7);
        if (strstr(in->args, "/qlserve "))
            return stage_named(df, from);
    }
    return -1;
}

/* The runtime stages: `cpu`, and the last one (the default target). */
static void runtime_stages(const dockerfile *df, int out[2])
{
    out[0] = stage_named(df, "cpu");
    out[1] = df->n_st - 1;
    cr_assert(out[0] >= 0, "Dockerfile: no stage named cpu (docker build --target cpu)");
    cr_assert(out[1] != out[0], "Dockerfile: the CUDA image must be the last (default) stage");
}

/* The exec form (["a", "b"]) of an instruction's arguments. */
static cJSON *exec_form(const instr *in)
{
    cJSON *a = cJSON_Parse(in->args);
    cr_assert(cJSON_IsArray(a), "Dockerfile:%d: %s is not in exec form", in->line, in->cmd);
    return a;
}

/* The HEALTHCHECK's command as one string (its CMD, exec form joined). */
static void healthcheck_command(const instr *in, char *out, size_t len)
{
    const char *cmd = strstr(in->args, "CMD ");
    cr_assert(cmd, "Dockerfile:%d: HEALTHCHECK has no CMD", in->line);
    const char *rest = cmd + 4;
    while (isspace((unsigned char)*rest))
        rest++;
    out[0] = 0;
    if (*rest != '[') {
        snprintf(out, len, "%s", rest);
        return;
    }
    cJSON *a = cJSON_Parse(rest);
    cr_assert(cJSON_IsArray(a), "Dockerfile:%d: HEALTHCHECK CMD is not valid JSON", in->line);
    const cJSON *w;
    size_t o = 0;
    cJSON_ArrayForEach (w, a) {
        cr_assert(cJSON_IsString(w), "Dockerfile:%d: HEALTHCHECK CMD holds a non-string", in->line);
        o += (size_t)snprintf(out + o, o < len ? len - o : 0, "%s ", w->valuestring);
    }
    cJSON_Delete(a);
}

/* The file of the source tree a stage copies to dest (COPY SRC DEST). */
static bool copied_to(const dockerfile *df, int s, const char *dest, char *src, size_t len)
{
    for (size_t i = 0; i < df->n; i++) {
        const instr *in = &df->in[i];
        if (in->stage != s || strcmp(in->cmd, "COPY") != 0 || starts_with(in->args, "--from="))
            continue;
        char a[512], b[512];
        if (sscanf(in->args, "%511s %511s", a, b) == 2 && strcmp(b, dest) == 0) {
            snprintf(src, len, "%s", a);
            return true;
        }
    }
    return false;
}

/* ---- YAML, through libyaml's document tree ---------------------------------- */

#define MAX_DOCS  8
#define MAX_FILES 12

typedef struct yfile {
    char name[256];
    yaml_document_t docs[MAX_DOCS];
    size_t n;
} yfile;

/* A node and the document it lives in; node NULL: absent. */
typedef struct yref {
    yaml_document_t *doc;
    yaml_node_t *node;
} yref;

static void yaml_load(const char *rel, yfile *yf)
{
    memset(yf, 0, sizeof *yf);
    snprintf(yf->name, sizeof yf->name, "%s", rel);
    char *text = read_text(rel);
    yaml_parser_t p;
    cr_assert(yaml_parser_initialize(&p));
    yaml_parser_set_input_string(&p, (const unsigned char *)text, strlen(text));
    for (;;) {
        cr_assert(yf->n < MAX_DOCS, "%s: too many documents", rel);
        yaml_document_t *d = &yf->docs[yf->n];
        cr_assert(yaml_parser_load(&p, d), "%s:%zu: not valid YAML: %s", rel,
                  p.problem_mark.line + 1, p.problem ? p.problem : "?");
        if (!yaml_document_get_root_node(d)) {
            yaml_document_delete(d);
            break;
        }
        yf->n++;
    }
    yaml_parser_delete(&p);
    free(text);
}

static void yaml_free(yfile *yf)
{
    for (size_t i = 0; i < yf->n; i++)
        yaml_document_delete(&yf->docs[i]);
}

static yref yroot(yaml_document_t *d)
{
    return (yref){d, yaml_document_get_root_node(d)};
}

static const char *ystr(yref r)
{
    return r.node && r.node->type == YAML_SCALAR_NODE ? (const char *)r.node->data.scalar.value
                                                      : NULL;
}

static yref yget(yref m, const char *key)
{
    yref none = {m.doc, NULL};
    if (!m.node || m.node->type != YAML_MAPPING_NODE)
        return none;
    for (yaml_node_pair_t *p = m.node->data.mapping.pairs.start; p < m.node->data.mapping.pairs.top;
         p++) {
        const char *k = ystr((yref){m.doc, yaml_document_get_node(m.doc, p->key)});
        if (k && strcmp(k, key) == 0)
            return (yref){m.doc, yaml_document_get_node(m.doc, p->value)};
    }
    return none;
}

/* "spec.template.spec": keys joined by dots (keys holding a dot: yget) */
static yref ypath(yref r, const char *dotted)
{
    char buf[256];
    snprintf(buf, sizeof buf, "%s", dotted);
    char *save = NULL;
    for (char *k = strtok_r(buf, ".", &save); k && r.node; k = strtok_r(NULL, ".", &save))
        r = yget(r, k);
    return r;
}

static size_t ylen(yref s)
{
    if (!s.node || s.node->type != YAML_SEQUENCE_NODE)
        return 0;
    return (size_t)(s.node->data.sequence.items.top - s.node->data.sequence.items.start);
}

static yref yat(yref s, size_t i)
{
    return (yref){s.doc, yaml_document_get_node(s.doc, s.node->data.sequence.items.start[i])};
}

static size_t ypairs(yref m)
{
    if (!m.node || m.node->type != YAML_MAPPING_NODE)
        return 0;
    return (size_t)(m.node->data.mapping.pairs.top - m.node->data.mapping.pairs.start);
}

static const char *ykey_at(yref m, size_t i)
{
    return ystr(
        (yref){m.doc, yaml_document_get_node(m.doc, m.node->data.mapping.pairs.start[i].key)});
}

static yref yvalue_at(yref m, size_t i)
{
    return (yref){m.doc, yaml_document_get_node(m.doc, m.node->data.mapping.pairs.start[i].value)};
}

static long yint(yref r, long fallback)
{
    const char *s = ystr(r);
    return s ? strtol(s, NULL, 10) : fallback;
}

/* A sequence of scalars as a cJSON array of strings (a command line). */
static cJSON *ystrings(yref s)
{
    cJSON *a = cJSON_CreateArray();
    for (size_t i = 0; i < ylen(s); i++) {
        const char *w = ystr(yat(s, i));
        cr_assert(w, "a command word is not a string");
        cJSON_AddItemToArray(a, cJSON_CreateString(w));
    }
    return a;
}

/* every label of sel is on labels, with the same value (and sel has some) */
static bool selects(yref sel, yref labels)
{
    if (ypairs(sel) == 0)
        return false;
    for (size_t i = 0; i < ypairs(sel); i++) {
        const char *want = ystr(yvalue_at(sel, i)), *have = ystr(yget(labels, ykey_at(sel, i)));
        if (!want || !have || strcmp(want, have) != 0)
            return false;
    }
    return true;
}

/* ---- the image's command: shared by the Dockerfile, compose and k8s checks -- */

typedef struct image_command {
    cJSON *cmd;            /* the last stage's CMD, exec form */
    char config_path[512]; /* what it gives --config */
    char *baked_config;    /* the file the image copies there */
} image_command;

static void image_command_load(image_command *ic)
{
    dockerfile df;
    dockerfile_load(&df);
    int rt[2];
    runtime_stages(&df, rt);
    const instr *cmd = last_in_stage(&df, rt[1], "CMD");
    cr_assert(cmd, "Dockerfile: the CUDA stage has no CMD");
    ic->cmd = exec_form(cmd);
    ic->config_path[0] = 0;
    for (int i = 1; i < cJSON_GetArraySize(ic->cmd); i++)
        if (strcmp(cJSON_GetArrayItem(ic->cmd, i - 1)->valuestring, "--config") == 0)
            snprintf(ic->config_path, sizeof ic->config_path, "%s",
                     cJSON_GetArrayItem(ic->cmd, i)->valuestring);
    cr_assert(ic->config_path[0], "Dockerfile: CMD names no --config FILE");
    char src[512];
    cr_assert(copied_to(&df, rt[1], ic->config_path, src, sizeof src),
              "Dockerfile: nothing is copied to %s", ic->config_path);
    ic->baked_config = read_text(src);
    dockerfile_free(&df);
}

static void image_command_free(image_command *ic)
{
    cJSON_Delete(ic->cmd);
    free(ic->baked_config);
}

/* ---- the Dockerfile ---------------------------------------------------------- */

TestSuite(dockerfile, .init = clear_qlserve_env);

Test(dockerfile, builds_cuda_by_default_and_cpu_on_debian)
{
    dockerfile df;
    dockerfile_load(&df);
    int rt[2];
    runtime_stages(&df, rt);
    const char *cpu = df.st[rt[0]].base, *cuda = df.st[rt[1]].base;
    cr_assert(starts_with(cpu, "debian:"), "the cpu image is on %s, not plain Debian", cpu);
    cr_assert(starts_with(cuda, "nvidia/cuda:") && strstr(cuda, "-runtime-"),
              "the default image is on %s, not a CUDA runtime image", cuda);

    int cpu_builder = builder_of(&df, rt[0]), cuda_builder = builder_of(&df, rt[1]);
    cr_assert(cpu_builder >= 0 && cuda_builder >= 0, "a runtime stage copies no qlserve binary");
    cr_assert(starts_with(df.st[cpu_builder].base, "debian:"),
              "the cpu binary is built on %s, not Debian", df.st[cpu_builder].base);
    /* the devel image of the same CUDA version and OS as the runtime image */
    char devel[256];
    size_t at = (size_t)(strstr(cuda, "-runtime-") - cuda);
    snprintf(devel, sizeof devel, "%.*s-devel-%s", (int)at, cuda, cuda + at + 9);
    cr_assert_str_eq(df.st[cuda_builder].base, devel,
                     "the CUDA builder's image does not match the runtime's");
    dockerfile_free(&df);
}

Test(dockerfile, builders_run_the_commands_ci_runs)
{
    /* CI is .ci/run -> scripts/test.sh -> scripts/install-deps.sh */
    cr_assert(source_file_is(".ci/run", true));
    cr_assert(source_file_is("scripts/install-deps.sh", true));
    cr_assert(source_file_is("scripts/test.sh", true));
    char *ci = read_text(".ci/run"), *test_sh = read_text("scripts/test.sh");
    cr_assert(has_name(ci, "scripts/test.sh"), ".ci/run does not run scripts/test.sh");
    cr_assert(has_name(test_sh, "scripts/install-deps.sh"));
    free(ci);
    free(test_sh);
    /* this test's own library comes from the install script like the rest */
    char *deps = read_text("scripts/install-deps.sh");
    cr_assert(has_name(deps, "libyaml-dev"), "install-deps.sh does not install libyaml-dev");
    free(deps);

    dockerfile df;
    dockerfile_load(&df);
    int rt[2];
    runtime_stages(&df, rt);
    for (int r = 0; r < 2; r++) {
        int b = builder_of(&df, rt[r]);
        cr_assert(b >= 0);
        int install_line = 0, test_line = 0;
        for (size_t i = 0; i < df.n; i++) {
            const instr *in = &df.in[i];
            if (in->stage != b || strcmp(in->cmd, "RUN") != 0)
                continue;
            /* the package list lives in the script, not here */
            cr_assert(!strstr(in->args, "apt-get install"),
                      "Dockerfile:%d: the builder installs packages itself; "
                      "scripts/install-deps.sh does that",
                      in->line);
            if (strcmp(in->args, "scripts/install-deps.sh") == 0)
                install_line = in->line;
            if (has_name(in->args, "scripts/test.sh")) {
                /* only the stage switches before it: the same script CI runs */
                char *copy = strdup(in->args), *save = NULL;
                for (char *w = strtok_r(copy, " ", &save); w; w = strtok_r(NULL, " ", &save)) {
                    if (strcmp(w, "scripts/test.sh") == 0)
                        break;
                    cr_assert(strcmp(w, "QL_SKIP_SANITIZE=1") == 0 ||
                                  strcmp(w, "QL_SKIP_FUZZ=1") == 0,
                              "Dockerfile:%d: %s changes what scripts/test.sh runs", in->line, w);
                }
                free(copy);
                test_line = in->line;
            }
        }
        cr_assert(install_line, "stage %s does not run scripts/install-deps.sh", df.st[b].name);
        cr_assert(test_line > install_line,
                  "stage %s does not run scripts/test.sh after installing", df.st[b].name);
    }
    dockerfile_free(&df);
}

Test(dockerfile, images_expose_the_default_port_and_check_health)
{
    served d = server_defaults();
    dockerfile df;
    dockerfile_load(&df);
    int rt[2];
    runtime_stages(&df, rt);
    for (int r = 0; r < 2; r++) {
        const char *name = df.st[rt[r]].name;
        const instr *expose = last_in_stage(&df, rt[r], "EXPOSE");
        cr_assert(expose, "stage %s exposes no port", name);
        cr_assert_eq(atoi(expose->args), d.port, "stage %s exposes %s; the server serves on %d",
                     name, expose->args, d.port);

        const instr *hc = last_in_stage(&df, rt[r], "HEALTHCHECK");
        cr_assert(hc, "stage %s has no HEALTHCHECK", name);
        cr_assert(strstr(hc->args, "--start-period="),
                  "stage %s: the HEALTHCHECK gives the model no time to load", name);
        char command[2048], path[256], where[128];
        healthcheck_command(hc, command, sizeof command);
        snprintf(where, sizeof where, "Dockerfile:%d", hc->line);
        cr_assert(has_number(command, d.port), "%s: the health check does not ask port %d: %s",
                  where, d.port, command);
        health_path(command, path, sizeof path, where);
        assert_health_route(path, where);
    }
    dockerfile_free(&df);
}

Test(dockerfile, images_run_as_an_unprivileged_user)
{
    dockerfile df;
    dockerfile_load(&df);
    int rt[2];
    runtime_stages(&df, rt);
    for (int r = 0; r < 2; r++) {
        const instr *user = last_in_stage(&df, rt[r], "USER");
        cr_assert(user, "stage %s runs as root (no USER)", df.st[rt[r]].name);
        char who[64];
        snprintf(who, sizeof who, "%.*s", (int)strcspn(user->args, ":"), user->args);
        cr_assert(strcmp(who, "root") != 0 && strcmp(who, "0") != 0,
                  "Dockerfile:%d: USER %s is root", user->line, user->args);
        /* numeric, so that Kubernetes' runAsNonRoot can check it */
        cr_assert(strspn(who, "0123456789") == strlen(who), "Dockerfile:%d: USER %s is not numeric",
                  user->line, user->args);
    }
    dockerfile_free(&df);
}

Test(dockerfile, no_admin_token_is_baked_in)
{
    dockerfile df;
    dockerfile_load(&df);
    for (size_t i = 0; i < df.n; i++) {
        const instr *in = &df.in[i];
        bool sets = strcmp(in->cmd, "ENV") == 0 || strcmp(in->cmd, "ARG") == 0 ||
                    strcmp(in->cmd, "LABEL") == 0;
        if (sets || strcmp(in->cmd, "RUN") == 0)
            cr_assert(!strcasestr(in->args, "admin_token") && !strcasestr(in->args, "admin-token"),
                      "Dockerfile:%d: %s mentions the admin token", in->line, in->cmd);
        if (strcmp(in->cmd, "COPY") == 0 || strcmp(in->cmd, "ADD") == 0)
            cr_assert(!strcasestr(in->args, "token") && !strcasestr(in->args, "secret") &&
                          !strstr(in->args, ".env"),
                      "Dockerfile:%d: %s copies a secret into the image", in->line, in->cmd);
    }
    dockerfile_free(&df);
    /* the baked config names no token file either: the image has none */
    image_command ic;
    image_command_load(&ic);
    cJSON *config = cJSON_Parse(ic.baked_config);
    cr_assert(cJSON_IsObject(config));
    const cJSON *item;
    cJSON_ArrayForEach (item, config)
        cr_assert(!strcasestr(item->string, "token"), "the image's config holds \"%s\"",
                  item->string);
    cJSON_Delete(config);
    image_command_free(&ic);
}

Test(dockerfile, images_read_a_config_serve_accepts_and_carry_only_the_binary)
{
    served d = server_defaults();
    dockerfile df;
    dockerfile_load(&df);
    int rt[2];
    runtime_stages(&df, rt);
    for (int r = 0; r < 2; r++) {
        const char *name = df.st[rt[r]].name;
        const instr *entry = last_in_stage(&df, rt[r], "ENTRYPOINT"),
                    *cmd = last_in_stage(&df, rt[r], "CMD");
        cr_assert(entry && cmd, "stage %s lacks ENTRYPOINT or CMD", name);
        cJSON *e = exec_form(entry), *c = exec_form(cmd);
        cr_assert_eq(cJSON_GetArraySize(e), 1);
        cr_assert_str_eq(cJSON_GetArrayItem(e, 0)->valuestring, "qlserve");
        const char *config_path = NULL;
        for (int i = 1; i < cJSON_GetArraySize(c); i++)
            if (strcmp(cJSON_GetArrayItem(c, i - 1)->valuestring, "--config") == 0)
                config_path = cJSON_GetArrayItem(c, i)->valuestring;
        cr_assert(config_path, "stage %s: CMD names no --config", name);
        char src[512], where[600];
        cr_assert(copied_to(&df, rt[r], config_path, src, sizeof src),
                  "stage %s copies nothing to %s", name, config_path);
        char *text = read_text(src);
        snprintf(where, sizeof where, "stage %s, %s", name, src);
        served s = serve_with(text, c, where);
        free(text);
        cr_assert(!loopback_host(s.host),
                  "%s: listens on %s, which no one outside the "
                  "container reaches",
                  where, s.host);
        cr_assert_eq(s.port, d.port);
        cr_assert(s.adapter_dir[0], "%s: no adapter-dir", where);
        /* the model and adapters are mount points the image makes */
        bool made_model = false, made_adapters = false;
        char model_top[256], adapters_top[256];
        snprintf(model_top, sizeof model_top, "/%.*s", (int)strcspn(s.model + 1, "/"), s.model + 1);
        snprintf(adapters_top, sizeof adapters_top, "/%.*s", (int)strcspn(s.adapter_dir + 1, "/"),
                 s.adapter_dir + 1);
        for (size_t i = 0; i < df.n; i++) {
            const instr *in = &df.in[i];
            if (in->stage != rt[r])
                continue;
            if (strcmp(in->cmd, "RUN") == 0 && strstr(in->args, "mkdir")) {
                made_model |= has_name(in->args, model_top);
                made_adapters |= has_name(in->args, adapters_top);
            }
            /* only the binary comes from the builder */
            if (strcmp(in->cmd, "COPY") == 0 && starts_with(in->args, "--from="))
                cr_assert(strstr(in->args, "/qlserve "),
                          "Dockerfile:%d: copies more than the "
                          "binary from the builder",
                          in->line);
            /* and only shared libraries from the package manager */
            const char *install =
                strcmp(in->cmd, "RUN") == 0 ? strstr(in->args, "apt-get install") : NULL;
            if (install) {
                install += strlen("apt-get install");
                char *copy = strndup(install, strcspn(install, "&;|"));
                char *save = NULL;
                for (char *w = strtok_r(copy, " ", &save); w; w = strtok_r(NULL, " ", &save))
                    cr_assert(*w == '-' || starts_with(w, "lib"),
                              "Dockerfile:%d: the runtime image installs %s, not a library",
                              in->line, w);
                free(copy);
            }
        }
        cr_assert(made_model && made_adapters, "stage %s makes no %s or %s to mount", name,
                  model_top, adapters_top);
        cJSON_Delete(e);
        cJSON_Delete(c);
    }
    dockerfile_free(&df);
}

/* ---- .dockerignore -------------------------------------------------------------- */

/* Docker's rule, as far as these patterns go: a pattern matches the path or
 * any folder above it; "**" / matches any depth. */
static bool ignored(char **patterns, size_t n, const char *path)
{
    for (size_t i = 0; i < n; i++) {
        const char *p = patterns[i];
        while (*p == '/')
            p++;
        char pat[256];
        snprintf(pat, sizeof pat, "%s", p);
        size_t len = strlen(pat);
        while (len && pat[len - 1] == '/')
            pat[--len] = 0;
        bool any_depth = starts_with(pat, "**/");
        char prefix[512];
        for (const char *end = path;; end++) {
            if (*end == '/' || *end == 0) {
                snprintf(prefix, sizeof prefix, "%.*s", (int)(end - path), path);
                if (fnmatch(pat, prefix, FNM_PATHNAME) == 0)
                    return true;
                /* "**" / x: x at any depth */
                for (const char *q = prefix; any_depth && q && *q; q = strchr(q + 1, '/'))
                    if (fnmatch(pat + 3, *q == '/' ? q + 1 : q, FNM_PATHNAME) == 0)
                        return true;
            }
            if (*end == 0)
                break;
        }
    }
    return false;
}

Test(dockerfile, dockerignore_keeps_host_builds_out_and_sources_in)
{
    char *text = read_text(".dockerignore");
    char *patterns[64];
    size_t n = 0;
    char *save = NULL;
    for (char *l = strtok_r(text, "\n", &save); l; l = strtok_r(NULL, "\n", &save)) {
        l = trim(l);
        cr_assert(*l != '!', ".dockerignore: exceptions (!) are beyond this check: %s", l);
        if (*l && *l != '#' && n < 64)
            patterns[n++] = l;
    }
    /* a host build folder's CMakeCache.txt would break the builder's cmake */
    static const char *const out[] = {"build/CMakeCache.txt", "build-asan/CMakeCache.txt",
                                      ".git/HEAD", "deploy/qlserve.env"};
    for (size_t i = 0; i < sizeof out / sizeof *out; i++)
        cr_assert(ignored(patterns, n, out[i]), ".dockerignore lets %s in", out[i]);
    /* what the builders and runtime stages read */
    static const char *const in[] = {"Dockerfile",
                                     "CMakeLists.txt",
                                     "scripts/install-deps.sh",
                                     "scripts/test.sh",
                                     ".ci/run",
                                     "deploy/config.json",
                                     "deploy/compose.yaml",
                                     "deploy/k8s/deployment.yaml",
                                     "docs/operations.md",
                                     "tests/test_deploy.c",
                                     "tests/fixtures/tiny_ref.gguf",
                                     "server/metrics.c",
                                     "deploy/.gitignore",
                                     "deploy/qlserve.env.example",
                                     "deploy/k8s/admin-fanout.sh",
                                     ".clang-format"};
    for (size_t i = 0; i < sizeof in / sizeof *in; i++)
        cr_assert(!ignored(patterns, n, in[i]), ".dockerignore keeps out %s", in[i]);
    free(text);
}

/* ---- deploy/compose.yaml ------------------------------------------------------- */

/* compose's interpolation with nothing set: ${X:-default} -> default, $$ -> $ */
static void compose_expand(const char *in, char *out, size_t len)
{
    size_t o = 0;
    while (*in && o + 1 < len) {
        if (in[0] == '$' && in[1] == '$') {
            out[o++] = '$';
            in += 2;
        } else if (in[0] == '$' && in[1] == '{') {
            const char *close = strchr(in, '}');
            cr_assert(close, "unclosed ${ in %s", in);
            const char *dflt = strstr(in, ":-");
            if (!dflt || dflt > close)
                dflt = strchr(in, '-');
            if (dflt && dflt < close) {
                dflt += *dflt == ':' ? 2 : 1;
                o += (size_t)snprintf(out + o, len - o, "%.*s", (int)(close - dflt), dflt);
            }
            in = close + 1;
        } else {
            out[o++] = *in++;
        }
    }
    out[o < len ? o : len - 1] = 0;
}

/* "40s", "1m30s", "500ms", "45" (seconds) in milliseconds */
static long duration_ms(const char *s)
{
    long total = 0;
    while (*s) {
        char *end;
        double v = strtod(s, &end);
        cr_assert(end != s, "not a duration: %s", s);
        long unit = 1000;
        if (starts_with(end, "ms"))
            unit = 1, end += 2;
        else if (*end == 's')
            unit = 1000, end++;
        else if (*end == 'm')
            unit = 60000, end++;
        else if (*end == 'h')
            unit = 3600000, end++;
        total += (long)(v * (double)unit);
        s = end;
    }
    return total;
}

/* The container side of a compose ports entry: "127.0.0.1:8080:8080/tcp" */
static int container_side(yref entry)
{
    const char *s = ystr(entry);
    if (!s)
        return (int)yint(yget(entry, "target"), -1);
    const char *colon = strrchr(s, ':');
    return atoi(colon ? colon + 1 : s);
}

typedef struct compose {
    yfile file;
    yref service;
} compose;

static void compose_load(compose *c)
{
    yaml_load("deploy/compose.yaml", &c->file);
    cr_assert(c->file.n == 1);
    yref services = yget(yroot(&c->file.docs[0]), "services");
    cr_assert_eq(ypairs(services), 1, "compose.yaml: one service, qlserve");
    c->service = yvalue_at(services, 0);
}

/* Sets the service's environment (QLSERVE_ ones must be documented) and
 * returns what the server makes of it with the mounted config file. */
static served compose_served(const compose *c, const image_command *ic)
{
    clear_qlserve_env();
    yref env = yget(c->service, "environment");
    for (size_t i = 0; i < ypairs(env); i++) {
        const char *name = ykey_at(env, i), *value = ystr(yvalue_at(env, i));
        char expanded[1024];
        cr_assert(value, "compose.yaml: environment %s has no value", name);
        cr_assert(strcmp(name, "QLSERVE_ADMIN_TOKEN") != 0,
                  "compose.yaml sets the admin token in the file; it belongs in the env_file");
        if (starts_with(name, "QLSERVE_"))
            cr_assert(documented_variable(name),
                      "compose.yaml: %s is no variable of qlserve "
                      "serve --help",
                      name);
        compose_expand(value, expanded, sizeof expanded);
        setenv(name, expanded, 1);
    }
    cr_assert(ylen(env) == 0, "compose.yaml: environment as a mapping, please");

    /* the config file bind-mounted where the image's command reads it */
    char *text = NULL;
    yref volumes = yget(c->service, "volumes");
    for (size_t i = 0; i < ylen(volumes); i++) {
        char v[1024], src[512], dst[512];
        const char *entry = ystr(yat(volumes, i));
        cr_assert(entry, "compose.yaml: volumes in the short syntax (SRC:DST[:ro]), please");
        compose_expand(entry, v, sizeof v);
        if (sscanf(v, "%511[^:]:%511[^:]", src, dst) == 2 && strcmp(dst, ic->config_path) == 0) {
            char rel[600];
            snprintf(rel, sizeof rel, "deploy/%s", starts_with(src, "./") ? src + 2 : src);
            text = read_text(rel);
        }
    }
    cr_assert(text, "compose.yaml mounts no config file at %s", ic->config_path);
    yref command = yget(c->service, "command");
    cJSON *args = command.node ? ystrings(command) : cJSON_Duplicate(ic->cmd, true);
    served s = serve_with(text, args, "compose.yaml");
    cJSON_Delete(args);
    free(text);
    return s;
}

/* mount is the folder of path, or above it */
static bool under(const char *path, const char *mount)
{
    size_t n = strlen(mount);
    return n && strncmp(path, mount, n) == 0 && (path[n] == '/' || path[n] == 0);
}

TestSuite(compose, .init = clear_qlserve_env);

Test(compose, serves_the_cuda_image_on_a_gpu_with_models_and_adapters_mounted)
{
    served d = server_defaults();
    image_command ic;
    image_command_load(&ic);
    compose c;
    compose_load(&c);
    served s = compose_served(&c, &ic);
    cr_assert(!loopback_host(s.host), "compose.yaml: the server listens on %s", s.host);
    cr_assert_eq(s.port, d.port, "compose.yaml: the server serves on %d, not %d", s.port, d.port);

    /* built from the repository, the default (CUDA) target */
    dockerfile df;
    dockerfile_load(&df);
    cr_assert_str_eq(ystr(ypath(c.service, "build.context")), "..");
    cr_assert_str_eq(ystr(ypath(c.service, "build.target")), df.st[df.n_st - 1].name);
    dockerfile_free(&df);

    bool gpu = false;
    yref devices = ypath(c.service, "deploy.resources.reservations.devices");
    for (size_t i = 0; i < ylen(devices); i++) {
        yref dev = yat(devices, i), caps = yget(dev, "capabilities");
        const char *driver = ystr(yget(dev, "driver"));
        for (size_t k = 0; k < ylen(caps); k++)
            gpu |= same(ystr(yat(caps, k)), "gpu") && driver && strcmp(driver, "nvidia") == 0;
    }
    cr_assert(gpu, "compose.yaml reserves no NVIDIA GPU");

    bool published = false;
    yref ports = yget(c.service, "ports");
    for (size_t i = 0; i < ylen(ports); i++)
        published |= container_side(yat(ports, i)) == s.port;
    cr_assert(published, "compose.yaml does not publish the container's port %d", s.port);

    bool model = false, adapters = false;
    yref volumes = yget(c.service, "volumes");
    for (size_t i = 0; i < ylen(volumes); i++) {
        char v[1024], dst[512];
        const char *entry = ystr(yat(volumes, i));
        cr_assert(entry, "compose.yaml: volumes in the short syntax (SRC:DST[:ro]), please");
        compose_expand(entry, v, sizeof v);
        if (sscanf(v, "%*[^:]:%511[^:]", dst) == 1) {
            model |= under(s.model, dst) && strcmp(s.model, dst) != 0;
            adapters |= under(s.adapter_dir, dst);
        }
    }
    cr_assert(model, "compose.yaml mounts nothing holding the model %s", s.model);
    cr_assert(adapters, "compose.yaml mounts nothing at the adapter directory %s", s.adapter_dir);
    yaml_free(&c.file);
    image_command_free(&ic);
}

Test(compose, health_check_and_stop_timeout_match_the_server)
{
    image_command ic;
    image_command_load(&ic);
    compose c;
    compose_load(&c);
    served s = compose_served(&c, &ic);

    yref hc = yget(c.service, "healthcheck");
    yref test = yget(hc, "test");
    cr_assert(ylen(test) > 1, "compose.yaml: no healthcheck test");
    char command[2048] = "", path[256];
    size_t o = 0;
    for (size_t i = 1; i < ylen(test); i++)
        o += (size_t)snprintf(command + o, sizeof command - o, "%s ", ystr(yat(test, i)));
    char expanded[2048];
    compose_expand(command, expanded, sizeof expanded);
    cr_assert(has_number(expanded, s.port),
              "compose.yaml: the healthcheck does not ask port "
              "%d: %s",
              s.port, expanded);
    health_path(expanded, path, sizeof path, "compose.yaml healthcheck");
    assert_health_route(path, "compose.yaml healthcheck");
    cr_assert(ystr(yget(hc, "start_period")), "compose.yaml: the healthcheck gives the model "
                                              "no time to load (start_period)");

    /* docker stop waits stop_grace_period, then SIGKILL: it must outlast the drain */
    const char *stop = ystr(yget(c.service, "stop_grace_period"));
    cr_assert(stop, "compose.yaml: no stop_grace_period; Docker's 10 s cuts the %d ms drain",
              s.grace_ms);
    cr_assert_gt(duration_ms(stop), s.grace_ms,
                 "compose.yaml: stop_grace_period %s does not outlast grace-ms %d", stop,
                 s.grace_ms);
    yaml_free(&c.file);
    image_command_free(&ic);
}

Test(compose, admin_token_comes_from_an_env_file_kept_out_of_git_and_images)
{
    compose c;
    compose_load(&c);
    yref env_file = yget(c.service, "env_file");
    const char *name = ystr(env_file) ? ystr(env_file) : ystr(yat(env_file, 0));
    cr_assert(name, "compose.yaml: no env_file for the admin token");
    char rel[512];
    snprintf(rel, sizeof rel, "deploy/%s.example", name);
    char *example = read_text(rel);
    bool token_line = false;
    char *save = NULL;
    for (char *l = strtok_r(example, "\n", &save); l; l = strtok_r(NULL, "\n", &save)) {
        l = trim(l);
        if (!*l || *l == '#')
            continue;
        char var[128];
        snprintf(var, sizeof var, "%.*s", (int)strcspn(l, "="), l);
        cr_assert(documented_variable(var), "%s: %s is no variable of qlserve serve", rel, var);
        /* left empty, the server refuses to start rather than run with a
         * token everyone has read */
        if (strcmp(var, "QLSERVE_ADMIN_TOKEN") == 0) {
            token_line = true;
            cr_assert_str_eq(l, "QLSERVE_ADMIN_TOKEN=", "%s ships a token", rel);
        }
    }
    cr_assert(token_line, "%s does not show where the admin token goes", rel);
    free(example);

    char *gitignore = read_text("deploy/.gitignore");
    bool kept_out = false;
    for (char *l = strtok_r(gitignore, "\n", &save); l; l = strtok_r(NULL, "\n", &save)) {
        l = trim(l);
        kept_out |= strcmp(l, name) == 0 || (*l == '/' && strcmp(l + 1, name) == 0);
    }
    cr_assert(kept_out, "deploy/.gitignore does not keep %s out of git", name);
    free(gitignore);
    yaml_free(&c.file);
}

/* ---- deploy/k8s ------------------------------------------------------------------ */

typedef struct cluster {
    yfile files[MAX_FILES];
    size_t n_files;
    yref deployment, pod, container, config_map, pvc, service, pdb;
    yref kustomization;
} cluster;

static int by_name(const void *a, const void *b)
{
    return strcmp(*(char *const *)a, *(char *const *)b);
}

/* The one object of kind (NULL name: any name), or an absent yref. */
static yref find_object(cluster *k, const char *kind, const char *name)
{
    yref found = {NULL, NULL};
    for (size_t f = 0; f < k->n_files; f++)
        for (size_t d = 0; d < k->files[f].n; d++) {
            yref root = yroot(&k->files[f].docs[d]);
            const char *kd = ystr(yget(root, "kind")), *nm = ystr(ypath(root, "metadata.name"));
            if (kd && strcmp(kd, kind) == 0 && (!name || (nm && strcmp(nm, name) == 0))) {
                cr_assert(!found.node, "deploy/k8s: more than one %s", kind);
                found = root;
            }
        }
    return found;
}

static void cluster_load(cluster *k)
{
    memset(k, 0, sizeof *k);
    char dir[1024];
    snprintf(dir, sizeof dir, "%s/deploy/k8s", QL_SOURCE_DIR);
    DIR *dp = opendir(dir);
    cr_assert(dp, "no deploy/k8s");
    char *names[MAX_FILES];
    size_t n = 0;
    for (struct dirent *e; (e = readdir(dp));) {
        size_t len = strlen(e->d_name);
        if (len > 5 && strcmp(e->d_name + len - 5, ".yaml") == 0) {
            cr_assert(n < MAX_FILES);
            names[n++] = strdup(e->d_name);
        }
    }
    closedir(dp);
    qsort(names, n, sizeof *names, by_name);
    for (size_t i = 0; i < n; i++) {
        char rel[512];
        snprintf(rel, sizeof rel, "deploy/k8s/%s", names[i]);
        yaml_load(rel, &k->files[k->n_files++]);
        free(names[i]);
    }
    k->kustomization = find_object(k, "Kustomization", NULL);
    k->deployment = find_object(k, "Deployment", NULL);
    cr_assert(k->deployment.node, "deploy/k8s: no Deployment");
    k->pod = ypath(k->deployment, "spec.template");
    yref containers = ypath(k->pod, "spec.containers");
    cr_assert(ylen(containers) >= 1, "the Deployment has no container");
    k->container = yat(containers, 0);
    k->service = find_object(k, "Service", NULL);
    k->pdb = find_object(k, "PodDisruptionBudget", NULL);
}

static void cluster_free(cluster *k)
{
    for (size_t f = 0; f < k->n_files; f++)
        yaml_free(&k->files[f]);
}

/* the pod's volume named name */
static yref pod_volume(const cluster *k, const char *name)
{
    yref volumes = ypath(k->pod, "spec.volumes");
    for (size_t i = 0; i < ylen(volumes); i++)
        if (same(ystr(yget(yat(volumes, i), "name")), name))
            return yat(volumes, i);
    return (yref){NULL, NULL};
}

/* A probe's or Service's port (a number, or the name of a container port). */
static int container_port(const cluster *k, yref port)
{
    const char *p = ystr(port);
    cr_assert(p, "a port that is not a scalar");
    if (isdigit((unsigned char)*p))
        return atoi(p);
    yref ports = yget(k->container, "ports");
    for (size_t i = 0; i < ylen(ports); i++)
        if (same(ystr(yget(yat(ports, i), "name")), p))
            return (int)yint(yget(yat(ports, i), "containerPort"), -1);
    cr_assert_fail("no container port named %s", p);
    return -1;
}

/* The container's command line, its environment set (the secret's value
 * replaced by a stand-in), and the ConfigMap's file: what the server makes
 * of them. */
static served cluster_served(cluster *k, const image_command *ic)
{
    cr_assert(!yget(k->container, "command").node,
              "the container replaces the image's ENTRYPOINT (qlserve)");
    yref args_node = yget(k->container, "args");
    cJSON *args = args_node.node ? ystrings(args_node) : cJSON_Duplicate(ic->cmd, true);
    const char *config_path = NULL;
    for (int i = 1; i < cJSON_GetArraySize(args); i++)
        if (strcmp(cJSON_GetArrayItem(args, i - 1)->valuestring, "--config") == 0)
            config_path = cJSON_GetArrayItem(args, i)->valuestring;
    cr_assert(config_path, "the container's args name no --config");

    /* the ConfigMap mounted at the config file's folder */
    const char *slash = strrchr(config_path, '/');
    cr_assert(slash);
    char folder[512];
    snprintf(folder, sizeof folder, "%.*s", (int)(slash - config_path), config_path);
    const char *volume = NULL;
    yref mounts = yget(k->container, "volumeMounts");
    for (size_t i = 0; i < ylen(mounts); i++)
        if (same(ystr(yget(yat(mounts, i), "mountPath")), folder))
            volume = ystr(yget(yat(mounts, i), "name"));
    cr_assert(volume, "nothing is mounted at %s, where --config %s lies", folder, config_path);
    const char *map = ystr(ypath(pod_volume(k, volume), "configMap.name"));
    cr_assert(map, "the volume at %s is no ConfigMap", folder);
    k->config_map = find_object(k, "ConfigMap", map);
    cr_assert(k->config_map.node, "deploy/k8s: no ConfigMap %s", map);
    const char *text = ystr(yget(yget(k->config_map, "data"), slash + 1));
    cr_assert(text, "ConfigMap %s has no %s", map, slash + 1);

    clear_qlserve_env();
    yref env = yget(k->container, "env");
    for (size_t i = 0; i < ylen(env); i++) {
        yref e = yat(env, i);
        const char *name = ystr(yget(e, "name")), *value = ystr(yget(e, "value"));
        cr_assert(name, "an env entry of the container has no name");
        if (!starts_with(name, "QLSERVE_"))
            continue;
        cr_assert(documented_variable(name),
                  "the Deployment sets %s, no variable of qlserve "
                  "serve --help",
                  name);
        if (yget(e, "valueFrom").node)
            value = "stand-in-for-the-secret";
        cr_assert(value, "env %s has no value", name);
        setenv(name, value, 1);
    }
    served s = serve_with(text, args, "deploy/k8s Deployment");
    cJSON_Delete(args);
    return s;
}

TestSuite(k8s, .init = clear_qlserve_env);

Test(k8s, manifests_parse_and_the_kustomization_lists_them)
{
    cluster k;
    cluster_load(&k);
    cr_assert(k.kustomization.node, "deploy/k8s: no kustomization.yaml");
    yref resources = yget(k.kustomization, "resources");
    for (size_t f = 0; f < k.n_files; f++) {
        const char *base = strrchr(k.files[f].name, '/') + 1;
        if (strcmp(base, "kustomization.yaml") == 0)
            continue;
        bool listed = false;
        for (size_t i = 0; i < ylen(resources); i++)
            listed |= same(ystr(yat(resources, i)), base);
        cr_assert(listed, "kustomization.yaml does not list %s", base);
        for (size_t d = 0; d < k.files[f].n; d++) {
            yref root = yroot(&k.files[f].docs[d]);
            cr_assert(ystr(yget(root, "apiVersion")) && ystr(yget(root, "kind")) &&
                          ystr(ypath(root, "metadata.name")),
                      "%s: an object without apiVersion, kind or metadata.name", k.files[f].name);
        }
    }
    for (size_t i = 0; i < ylen(resources); i++) {
        char rel[512];
        snprintf(rel, sizeof rel, "deploy/k8s/%s", ystr(yat(resources, i)));
        cr_assert(source_file_is(rel, false), "kustomization.yaml lists %s, which is missing", rel);
    }
    cluster_free(&k);
}

Test(k8s, deployment_serves_the_config_map_on_the_default_port)
{
    served d = server_defaults();
    image_command ic;
    image_command_load(&ic);
    cluster k;
    cluster_load(&k);
    served s = cluster_served(&k, &ic);
    cr_assert(!loopback_host(s.host),
              "the ConfigMap's server listens on %s: kubelet and the "
              "Service cannot reach it",
              s.host);
    cr_assert_eq(s.port, d.port, "the cluster's server serves on %d, not %d", s.port, d.port);
    bool declared = false;
    yref ports = yget(k.container, "ports");
    for (size_t i = 0; i < ylen(ports); i++)
        declared |= yint(yget(yat(ports, i), "containerPort"), -1) == s.port;
    cr_assert(declared, "the container declares no port %d", s.port);
    /* Kubernetes would set QLSERVE_PORT=tcp://... for a Service named
     * qlserve, and the server reads QLSERVE_PORT as its port */
    cr_assert_str_eq(ystr(ypath(k.pod, "spec.enableServiceLinks")), "false",
                     "enableServiceLinks must be false: service links set QLSERVE_PORT");
    cluster_free(&k);
    image_command_free(&ic);
}

Test(k8s, probes_ask_health_on_the_served_port_and_startup_allows_a_load)
{
    image_command ic;
    image_command_load(&ic);
    cluster k;
    cluster_load(&k);
    served s = cluster_served(&k, &ic);
    static const char *const probes[] = {"startupProbe", "readinessProbe", "livenessProbe"};
    for (size_t i = 0; i < 3; i++) {
        yref probe = yget(k.container, probes[i]);
        cr_assert(probe.node, "the container has no %s", probes[i]);
        const char *path = ystr(ypath(probe, "httpGet.path"));
        cr_assert(path, "%s is no httpGet", probes[i]);
        assert_health_route(path, probes[i]);
        cr_assert_eq(container_port(&k, ypath(probe, "httpGet.port")), s.port,
                     "%s asks another port than %d", probes[i], s.port);
    }
    /* Kubernetes' defaults: period 10 s, failure threshold 3 */
    yref startup = yget(k.container, "startupProbe");
    long budget =
        yint(yget(startup, "periodSeconds"), 10) * yint(yget(startup, "failureThreshold"), 3);
    cr_assert_geq(budget, 600, "the startup probe gives a model load %ld s; allow 10 minutes",
                  budget);
    cluster_free(&k);
    image_command_free(&ic);
}

Test(k8s, termination_grace_covers_the_drain)
{
    image_command ic;
    image_command_load(&ic);
    cluster k;
    cluster_load(&k);
    served s = cluster_served(&k, &ic);
    long grace = yint(ypath(k.pod, "spec.terminationGracePeriodSeconds"), 30);
    /* a preStop sleep runs before SIGTERM, inside the same grace period */
    long pre_stop = 0;
    yref pre = ypath(k.container, "lifecycle.preStop");
    yref command = ypath(pre, "exec.command");
    if (ylen(command) == 2 && strstr(ystr(yat(command, 0)), "sleep"))
        pre_stop = strtol(ystr(yat(command, 1)), NULL, 10);
    pre_stop += yint(ypath(pre, "sleep.seconds"), 0);
    cr_assert_gt(grace * 1000, s.grace_ms + pre_stop * 1000,
                 "terminationGracePeriodSeconds %ld does not cover a %ld s preStop plus the "
                 "%d ms drain: running requests would be killed",
                 grace, pre_stop, s.grace_ms);
    cluster_free(&k);
    image_command_free(&ic);
}

Test(k8s, deployment_asks_for_a_gpu_and_sized_resources_and_runs_unprivileged)
{
    cluster k;
    cluster_load(&k);
    yref resources = yget(k.container, "resources");
    cr_assert_geq(yint(yget(yget(resources, "limits"), "nvidia.com/gpu"), 0), 1,
                  "the container has no nvidia.com/gpu limit");
    cr_assert(ystr(yget(yget(resources, "requests"), "cpu")), "no cpu request");
    cr_assert(ystr(yget(yget(resources, "requests"), "memory")), "no memory request");
    cr_assert(ystr(yget(yget(resources, "limits"), "memory")), "no memory limit");
    const char *non_root = ystr(ypath(k.pod, "spec.securityContext.runAsNonRoot"));
    cr_assert(non_root && strcmp(non_root, "true") == 0, "the pod may run as root");
    cr_assert_neq(yint(ypath(k.pod, "spec.securityContext.runAsUser"), 1), 0);
    cluster_free(&k);
}

Test(k8s, admin_token_comes_from_a_secret_that_is_not_in_the_manifests)
{
    cluster k;
    cluster_load(&k);
    bool from_secret = false;
    yref env = yget(k.container, "env");
    for (size_t i = 0; i < ylen(env); i++) {
        yref e = yat(env, i);
        if (!same(ystr(yget(e, "name")), "QLSERVE_ADMIN_TOKEN"))
            continue;
        cr_assert(!yget(e, "value").node, "the admin token is written in the Deployment");
        from_secret = ystr(ypath(e, "valueFrom.secretKeyRef.name")) &&
                      ystr(ypath(e, "valueFrom.secretKeyRef.key"));
    }
    cr_assert(from_secret, "QLSERVE_ADMIN_TOKEN does not come from a Secret");
    for (size_t f = 0; f < k.n_files; f++)
        for (size_t d = 0; d < k.files[f].n; d++) {
            yref root = yroot(&k.files[f].docs[d]);
            const char *kind = ystr(yget(root, "kind"));
            if (kind && strcmp(kind, "Secret") == 0)
                cr_assert(!yget(root, "data").node && !yget(root, "stringData").node,
                          "%s carries a secret's value", k.files[f].name);
        }
    cr_assert(!yget(k.kustomization, "secretGenerator").node,
              "kustomization.yaml generates a secret from files in the repository");
    cluster_free(&k);
}

Test(k8s, models_and_adapters_come_from_a_shared_claim)
{
    image_command ic;
    image_command_load(&ic);
    cluster k;
    cluster_load(&k);
    served s = cluster_served(&k, &ic);
    bool model = false, adapters = false;
    yref mounts = yget(k.container, "volumeMounts");
    for (size_t i = 0; i < ylen(mounts); i++) {
        yref m = yat(mounts, i);
        const char *claim =
            ystr(ypath(pod_volume(&k, ystr(yget(m, "name"))), "persistentVolumeClaim.claimName"));
        if (!claim)
            continue;
        yref pvc = find_object(&k, "PersistentVolumeClaim", claim);
        cr_assert(pvc.node, "deploy/k8s: no PersistentVolumeClaim %s", claim);
        cr_assert(ystr(ypath(pvc, "spec.resources.requests.storage")), "%s asks no size", claim);
        /* replicas on different nodes read the same files */
        if (yint(ypath(k.deployment, "spec.replicas"), 1) > 1) {
            bool shared = false;
            yref modes = ypath(pvc, "spec.accessModes");
            for (size_t a = 0; a < ylen(modes); a++)
                shared |= same(ystr(yat(modes, a)), "ReadWriteMany") ||
                          same(ystr(yat(modes, a)), "ReadOnlyMany");
            cr_assert(shared, "%s is not ReadWriteMany/ReadOnlyMany, yet replicas share it", claim);
        }
        const char *path = ystr(yget(m, "mountPath"));
        model |= under(s.model, path) && strcmp(s.model, path) != 0;
        adapters |= under(s.adapter_dir, path);
    }
    cr_assert(model, "the model %s is on no claim the pod mounts", s.model);
    cr_assert(adapters, "the adapter directory %s is on no claim the pod mounts", s.adapter_dir);
    cluster_free(&k);
    image_command_free(&ic);
}

Test(k8s, service_and_disruption_budget_select_the_pods)
{
    image_command ic;
    image_command_load(&ic);
    cluster k;
    cluster_load(&k);
    served s = cluster_served(&k, &ic);
    yref labels = ypath(k.pod, "metadata.labels");
    cr_assert(selects(ypath(k.deployment, "spec.selector.matchLabels"), labels));
    cr_assert(k.service.node, "deploy/k8s: no Service");
    cr_assert(selects(ypath(k.service, "spec.selector"), labels),
              "the Service does not select the Deployment's pods");
    yref ports = ypath(k.service, "spec.ports");
    cr_assert(ylen(ports) >= 1);
    cr_assert_eq(container_port(&k, yget(yat(ports, 0), "targetPort")), s.port,
                 "the Service sends traffic to another port than %d", s.port);

    cr_assert(k.pdb.node, "deploy/k8s: no PodDisruptionBudget");
    cr_assert(selects(ypath(k.pdb, "spec.selector.matchLabels"), labels),
              "the PodDisruptionBudget does not select the Deployment's pods");
    yref min = ypath(k.pdb, "spec.minAvailable"), max = ypath(k.pdb, "spec.maxUnavailable");
    cr_assert(min.node || max.node, "the PodDisruptionBudget allows nothing");
    if (min.node && isdigit((unsigned char)*ystr(min)))
        cr_assert_lt(yint(min, 0), yint(ypath(k.deployment, "spec.replicas"), 1),
                     "minAvailable leaves no replica to drain: node drains would hang");
    cluster_free(&k);
    image_command_free(&ic);
}

Test(k8s, admin_fanout_script_reaches_the_deployments_pods)
{
    image_command ic;
    image_command_load(&ic);
    cluster k;
    cluster_load(&k);
    served s = cluster_served(&k, &ic);
    const char *rel = "deploy/k8s/admin-fanout.sh";
    cr_assert(source_file_is(rel, true), "%s is missing or not executable", rel);
    char *script = read_text(rel);
    cr_assert(strstr(script, "kubectl") && strstr(script, "get pods") && strstr(script, "exec"),
              "%s does not visit pods with kubectl", rel);
    /* its defaults are the Deployment's: labels, container, port */
    yref match = ypath(k.deployment, "spec.selector.matchLabels");
    char want[512];
    size_t o = (size_t)snprintf(want, sizeof want, "${SELECTOR:-");
    for (size_t i = 0; i < ypairs(match); i++)
        o += (size_t)snprintf(want + o, sizeof want - o, "%s%s=%s", i ? "," : "", ykey_at(match, i),
                              ystr(yvalue_at(match, i)));
    snprintf(want + o, sizeof want - o, "}");
    cr_assert(strstr(script, want), "%s: its default selector is not %s", rel, want);
    snprintf(want, sizeof want, "${CONTAINER:-%s}", ystr(yget(k.container, "name")));
    cr_assert(strstr(script, want), "%s: its default container is not %s", rel, want);
    snprintf(want, sizeof want, "${PORT:-%d}", s.port);
    cr_assert(strstr(script, want), "%s: its default port is not %d", rel, s.port);
    free(script);
    char command[1200];
    snprintf(command, sizeof command, "bash -n '%s/%s'", QL_SOURCE_DIR, rel);
    cr_assert_eq(system(command), 0, "%s: bash finds a syntax error", rel);
    cluster_free(&k);
    image_command_free(&ic);
}

/* ---- CRD schemas: the objects of deploy/gateway as the API server checks them -- */

/*
 * A structural OpenAPI v3 schema validator, enough for the openAPIV3Schema
 * of the CRDs in deploy/crds (its README names their sources and commits).
 * It checks what the API server checks before admission, with the paths
 * kubectl prints ("spec.targetPorts[0].number"):
 *   - type (object, array, string, integer, number, boolean), and
 *     x-kubernetes-int-or-string; YAML scalars typed as sigs.k8s.io/yaml
 *     (YAML 1.1) types them for kubectl: a quoted scalar is a string, a
 *     plain one may be a null, bool (yes/no/on/off too), integer or number;
 *   - properties, required, additionalProperties (false or a schema),
 *     minProperties/maxProperties, and unknown fields: where a schema has
 *     properties and neither additionalProperties nor
 *     x-kubernetes-preserve-unknown-fields, a field it does not name is one
 *     structural pruning would drop, which `kubectl apply` (strict field
 *     validation) refuses as `unknown field`;
 *   - items, minItems/maxItems, x-kubernetes-list-type set and map (unique
 *     items / unique x-kubernetes-list-map-keys);
 *   - enum, pattern (through lora_pattern_compile's POSIX translation; a
 *     pattern it cannot express is an error naming the field, so a value is
 *     never passed unchecked), minLength/maxLength in characters,
 *     minimum/maximum, format int32, int64 and date-time;
 *   - metadata: ObjectMeta's own fields only, a name, string labels.
 * default is not applied (the server fills it in after these checks; a
 * required field with a default must still be written). The CEL rules
 * (x-kubernetes-validations) cannot run offline: every rule on a field the
 * manifests use is recorded, and the test cel_rules_on_used_fields_hold
 * checks each by hand or fails naming it. A keyword this validator does not
 * know fails the run, so a schema that grows one cannot pass unread.
 */

#define SCHEMA_MAX_ERRORS 16
#define SCHEMA_MAX_RULES  64

typedef struct cel_use {
    char path[256];    /* where the rule sits, as the value's path */
    char message[256]; /* the rule's message: what the test knows it by */
    yref self;         /* the value the rule would see as `self` */
} cel_use;

typedef struct schema_run {
    char errors[SCHEMA_MAX_ERRORS][512];
    size_t n_errors;
    cel_use rules[SCHEMA_MAX_RULES];
    size_t n_rules;
} schema_run;

static void schema_error(schema_run *v, const char *path, const char *fmt, ...)
    __attribute__((format(printf, 3, 4)));
static void schema_error(schema_run *v, const char *path, const char *fmt, ...)
{
    if (v->n_errors == SCHEMA_MAX_ERRORS)
        return;
    char *e = v->errors[v->n_errors++];
    int o = snprintf(e, sizeof v->errors[0], "%s: ", *path ? path : "(the object)");
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(e + o, sizeof v->errors[0] - (size_t)o, fmt, ap);
    va_end(ap);
}

/* The errors joined, one a line, for an assertion's message. */
static void schema_errors_text(const schema_run *v, char *out, size_t len)
{
    size_t o = 0;
    out[0] = 0;
    for (size_t i = 0; i < v->n_errors && o < len; i++)
        o += (size_t)snprintf(out + o, len - o, "\n  %s", v->errors[i]);
}

/* What a YAML node is to kubectl. */
typedef enum yaml_kind {
    YK_NULL,
    YK_BOOL,
    YK_INT,
    YK_NUMBER,
    YK_STRING,
    YK_MAP,
    YK_LIST
} yaml_kind;

static const char *const yaml_kind_names[] = {"null",   "boolean", "integer", "number",
                                              "string", "object",  "array"};

static bool matches_ere(const char *text, const char *ere)
{
    regex_t re;
    cr_assert_eq(regcomp(&re, ere, REG_EXTENDED | REG_NOSUB), 0, "bad ERE %s", ere);
    bool m = regexec(&re, text, 0, NULL, 0) == 0;
    regfree(&re);
    return m;
}

static yaml_kind ykind(yref r)
{
    if (r.node->type == YAML_MAPPING_NODE)
        return YK_MAP;
    if (r.node->type == YAML_SEQUENCE_NODE)
        return YK_LIST;
    const char *s = ystr(r);
    yaml_scalar_style_t style = r.node->data.scalar.style;
    if (style != YAML_PLAIN_SCALAR_STYLE && style != YAML_ANY_SCALAR_STYLE)
        return YK_STRING;
    if (!*s || matches_ere(s, "^(~|null|Null|NULL)$"))
        return YK_NULL;
    if (matches_ere(s, "^(true|True|TRUE|false|False|FALSE|yes|Yes|YES|no|No|NO|on|On|ON|off|Off|"
                       "OFF|y|Y|n|N)$"))
        return YK_BOOL;
    if (matches_ere(s, "^[-+]?(0|[1-9][0-9_]*|0[0-7_]+|0x[0-9a-fA-F_]+|0b[01_]+)$"))
        return YK_INT;
    /* YAML 1.1 floats: "1.5", ".5", "1e3", "1.5e-3", ".inf", ".nan"; not "0.1.0" */
    if (matches_ere(s, "^[-+]?([0-9][0-9_]*)?(\\.[0-9_]*)?([eE][-+]?[0-9]+)?$") &&
        strpbrk(s, "0123456789"))
        return YK_NUMBER;
    if (matches_ere(s, "^[-+]?\\.(inf|Inf|INF)$|^\\.(nan|NaN|NAN)$"))
        return YK_NUMBER;
    return YK_STRING;
}

static bool ybool(yref r, const char *key)
{
    const char *s = ystr(yget(r, key));
    return s && strcmp(s, "true") == 0;
}

/* Characters, as Kubernetes counts maxLength (runes of UTF-8). */
static size_t utf8_chars(const char *s)
{
    size_t n = 0, len = strlen(s);
    for (size_t at = 0; at < len; n++) {
        uint32_t cp;
        size_t step = ql_utf8_next((const uint8_t *)s + at, len - at, &cp);
        at += step ? step : 1;
    }
    return n;
}

/* The schema keywords the validator reads, and those it knows to skip. */
static const char *const schema_keywords[] = {
    "type", "properties", "required", "additionalProperties", "items", "enum", "pattern", "minimum",
    "maximum", "minLength", "maxLength", "minItems", "maxItems", "minProperties", "maxProperties",
    "format", "x-kubernetes-int-or-string", "x-kubernetes-preserve-unknown-fields",
    "x-kubernetes-list-type", "x-kubernetes-list-map-keys", "x-kubernetes-validations",
    /* not checks: the server applies a default after validation; the rest
     * are documentation or merge strategy */
    "default", "description", "x-kubernetes-map-type", "example"};

static void schema_keywords_known(yref schema, const char *path)
{
    for (size_t i = 0; i < ypairs(schema); i++) {
        const char *k = ykey_at(schema, i);
        bool known = false;
        for (size_t j = 0; j < sizeof schema_keywords / sizeof *schema_keywords; j++)
            known |= strcmp(k, schema_keywords[j]) == 0;
        cr_assert(known, "the schema at %s uses %s, which this validator does not check", path, k);
    }
}

static void metadata_validate(schema_run *v, yref meta, const char *path);

static void schema_validate(schema_run *v, yref schema, yref value, const char *path);

static void object_validate(schema_run *v, yref schema, yref value, const char *path)
{
    yref props = yget(schema, "properties"), extra = yget(schema, "additionalProperties");
    bool preserve = ybool(schema, "x-kubernetes-preserve-unknown-fields");
    long n = (long)ypairs(value);
    if (yget(schema, "minProperties").node && n < yint(yget(schema, "minProperties"), 0))
        schema_error(v, path, "has %ld fields, fewer than %ld", n,
                     yint(yget(schema, "minProperties"), 0));
    if (yget(schema, "maxProperties").node && n > yint(yget(schema, "maxProperties"), 0))
        schema_error(v, path, "has %ld fields, more than %ld", n,
                     yint(yget(schema, "maxProperties"), 0));
    yref required = yget(schema, "required");
    for (size_t i = 0; i < ylen(required); i++)
        if (!yget(value, ystr(yat(required, i))).node)
            schema_error(v, path, "Required value: %s", ystr(yat(required, i)));
    for (size_t i = 0; i < ypairs(value); i++) {
        const char *key = ykey_at(value, i);
        char sub[512];
        snprintf(sub, sizeof sub, "%s%s%s", path, *path ? "." : "", key ? key : "?");
        if (!key) {
            schema_error(v, path, "a key that is not a string");
            continue;
        }
        yref field = yget(props, key);
        if (field.node)
            schema_validate(v, field, yvalue_at(value, i), sub);
        else if (extra.node && extra.node->type == YAML_MAPPING_NODE)
            schema_validate(v, extra, yvalue_at(value, i), sub);
        else if (same(ystr(extra), "false"))
            schema_error(v, sub, "Forbidden: no additional fields are allowed here");
        else if (!preserve && !same(ystr(extra), "true"))
            schema_error(v, sub, "unknown field \"%s\"", key);
    }
}

/* The value of item's list-map keys, joined: two items with the same one
 * are the same map entry to the server. */
static void list_map_key(yref keys, yref item, char *out, size_t len)
{
    size_t o = 0;
    out[0] = 0;
    for (size_t k = 0; k < ylen(keys) && o < len; k++) {
        const char *value = ystr(yget(item, ystr(yat(keys, k))));
        o += (size_t)snprintf(out + o, len - o, "%s=%s;", ystr(yat(keys, k)),
                              value ? value : "(unset)");
    }
}

static void array_validate(schema_run *v, yref schema, yref value, const char *path)
{
    long n = (long)ylen(value);
    if (yget(schema, "minItems").node && n < yint(yget(schema, "minItems"), 0))
        schema_error(v, path, "Invalid value: %ld items, fewer than %ld", n,
                     yint(yget(schema, "minItems"), 0));
    if (yget(schema, "maxItems").node && n > yint(yget(schema, "maxItems"), 0))
        schema_error(v, path, "Too many: %ld items, more than %ld", n,
                     yint(yget(schema, "maxItems"), 0));
    yref items = yget(schema, "items");
    const char *list_type = ystr(yget(schema, "x-kubernetes-list-type"));
    yref keys = yget(schema, "x-kubernetes-list-map-keys");
    for (size_t i = 0; i < ylen(value); i++) {
        char sub[512];
        snprintf(sub, sizeof sub, "%s[%zu]", path, i);
        if (items.node)
            schema_validate(v, items, yat(value, i), sub);
        for (size_t j = 0; j < i; j++) {
            char a[512], b[512];
            if (same(list_type, "set")) {
                snprintf(a, sizeof a, "%s", ystr(yat(value, i)) ? ystr(yat(value, i)) : "");
                snprintf(b, sizeof b, "%s", ystr(yat(value, j)) ? ystr(yat(value, j)) : "");
            } else if (same(list_type, "map")) {
                list_map_key(keys, yat(value, i), a, sizeof a);
                list_map_key(keys, yat(value, j), b, sizeof b);
            } else {
                break;
            }
            if (strcmp(a, b) == 0)
                schema_error(v, sub, "Duplicate value: the same %s as item %zu",
                             same(list_type, "set") ? "value" : "keys", j);
        }
    }
}

static void string_validate(schema_run *v, yref schema, const char *s, const char *path)
{
    size_t chars = utf8_chars(s);
    if (yget(schema, "minLength").node && (long)chars < yint(yget(schema, "minLength"), 0))
        schema_error(v, path, "Invalid value: \"%s\": shorter than %ld characters", s,
                     yint(yget(schema, "minLength"), 0));
    if (yget(schema, "maxLength").node && (long)chars > yint(yget(schema, "maxLength"), 0))
        schema_error(v, path, "Too long: \"%.40s...\": longer than %ld characters", s,
                     yint(yget(schema, "maxLength"), 0));
    const char *pattern = ystr(yget(schema, "pattern"));
    if (pattern) {
        regex_t re;
        char why[256] = "";
        if (lora_pattern_compile(&re, "", pattern, "", why, sizeof why) != 0) {
            schema_error(v, path, "its pattern %s cannot be checked offline: %s", pattern, why);
        } else {
            if (regexec(&re, s, 0, NULL, 0) != 0)
                schema_error(v, path, "Invalid value: \"%s\": should match '%s'", s, pattern);
            regfree(&re);
        }
    }
    if (same(ystr(yget(schema, "format")), "date-time") &&
        !matches_ere(s, "^[0-9]{4}-[0-9]{2}-[0-9]{2}[Tt][0-9]{2}:[0-9]{2}:[0-9]{2}(\\.[0-9]+)?"
                        "([Zz]|[-+][0-9]{2}:[0-9]{2})$"))
        schema_error(v, path, "Invalid value: \"%s\": not an RFC 3339 date-time", s);
}

static void integer_validate(schema_run *v, yref schema, const char *s, const char *path)
{
    errno = 0;
    long long n = strtoll(s, NULL, 0);
    const char *format = ystr(yget(schema, "format"));
    if (errno == ERANGE || (same(format, "int32") && (n < INT32_MIN || n > INT32_MAX)))
        schema_error(v, path, "Invalid value: %s: out of the %s range", s,
                     format ? format : "int64");
    const char *min = ystr(yget(schema, "minimum")), *max = ystr(yget(schema, "maximum"));
    if (min && n < strtoll(min, NULL, 10))
        schema_error(v, path, "Invalid value: %s: should be greater than or equal to %s", s, min);
    if (max && n > strtoll(max, NULL, 10))
        schema_error(v, path, "Invalid value: %s: should be less than or equal to %s", s, max);
}

static void schema_validate(schema_run *v, yref schema, yref value, const char *path)
{
    schema_keywords_known(schema, path);
    yref rules = yget(schema, "x-kubernetes-validations");
    for (size_t i = 0; i < ylen(rules); i++) {
        cr_assert(v->n_rules < SCHEMA_MAX_RULES, "more CEL rules than %d", SCHEMA_MAX_RULES);
        cel_use *u = &v->rules[v->n_rules++];
        snprintf(u->path, sizeof u->path, "%s", path);
        const char *m = ystr(yget(yat(rules, i), "message"));
        snprintf(u->message, sizeof u->message, "%s", m ? m : ystr(yget(yat(rules, i), "rule")));
        u->self = value;
    }

    const char *type = ystr(yget(schema, "type"));
    yaml_kind k = ykind(value);
    if (k == YK_NULL) {
        schema_error(v, path, "Invalid value: null: a %s is expected", type ? type : "value");
        return;
    }
    if (ybool(schema, "x-kubernetes-int-or-string")) {
        if (k != YK_INT && k != YK_STRING)
            schema_error(v, path, "Invalid value: a %s: an integer or a string is expected",
                         yaml_kind_names[k]);
        return;
    }
    cr_assert(type, "the schema at %s has no type: not a structural schema", path);
    bool fits = (strcmp(type, "object") == 0 && k == YK_MAP) ||
                (strcmp(type, "array") == 0 && k == YK_LIST) ||
                (strcmp(type, "string") == 0 && k == YK_STRING) ||
                (strcmp(type, "integer") == 0 && k == YK_INT) ||
                (strcmp(type, "number") == 0 && (k == YK_INT || k == YK_NUMBER)) ||
                (strcmp(type, "boolean") == 0 && k == YK_BOOL);
    if (!fits) {
        schema_error(v, path, "Invalid value: \"%s\": must be of type %s, not %s",
                     ystr(value) ? ystr(value) : "...", type, yaml_kind_names[k]);
        return;
    }

    yref choices = yget(schema, "enum");
    if (choices.node) {
        bool listed = false;
        for (size_t i = 0; i < ylen(choices); i++)
            listed |= same(ystr(yat(choices, i)), ystr(value));
        if (!listed) {
            char allowed[512];
            size_t o = 0;
            allowed[0] = 0;
            for (size_t i = 0; i < ylen(choices) && o < sizeof allowed; i++)
                o += (size_t)snprintf(allowed + o, sizeof allowed - o, "%s\"%s\"", i ? ", " : "",
                                      ystr(yat(choices, i)));
            schema_error(v, path, "Unsupported value: \"%s\": supported values: %s",
                         ystr(value) ? ystr(value) : "...", allowed);
        }
    }
    if (k == YK_MAP && strcmp(path, "metadata") == 0)
        metadata_validate(v, value, path);
    else if (k == YK_MAP)
        object_validate(v, schema, value, path);
    else if (k == YK_LIST)
        array_validate(v, schema, value, path);
    else if (k == YK_STRING)
        string_validate(v, schema, ystr(value), path);
    else if (k == YK_INT)
        integer_validate(v, schema, ystr(value), path);
}

/* ObjectMeta, which a CRD's schema leaves as "type: object": the fields a
 * manifest may write, a DNS-1123 subdomain name, string labels and
 * annotations (label values as the API server restricts them). */
static void metadata_validate(schema_run *v, yref meta, const char *path)
{
    static const char *const fields[] = {"name",           "namespace",    "labels",
                                         "annotations",    "generateName", "finalizers",
                                         "ownerReferences"};
    for (size_t i = 0; i < ypairs(meta); i++) {
        bool known = false;
        for (size_t j = 0; j < sizeof fields / sizeof *fields; j++)
            known |= same(ykey_at(meta, i), fields[j]);
        if (!known)
            schema_error(v, path, "unknown field \"%s\"", ykey_at(meta, i));
    }
    const char *name = ystr(yget(meta, "name"));
    if (!name)
        schema_error(v, path, "Required value: name");
    else if (strlen(name) > 253 ||
             !matches_ere(name,
                          "^[a-z0-9]([-a-z0-9]*[a-z0-9])?(\\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*$"))
        schema_error(v, "metadata.name", "Invalid value: \"%s\": not a DNS-1123 subdomain", name);
    static const char *const maps[] = {"labels", "annotations"};
    for (size_t m = 0; m < 2; m++) {
        yref map = yget(meta, maps[m]);
        for (size_t i = 0; i < ypairs(map); i++) {
            char sub[300];
            snprintf(sub, sizeof sub, "metadata.%s.%s", maps[m], ykey_at(map, i));
            yref value = yvalue_at(map, i);
            if (ykind(value) != YK_STRING)
                schema_error(v, sub, "must be of type string, not %s",
                             yaml_kind_names[ykind(value)]);
            else if (m == 0 && (strlen(ystr(value)) > 63 ||
                                !matches_ere(ystr(value), "^(([A-Za-z0-9][-A-Za-z0-9_.]*)?"
                                                          "[A-Za-z0-9])?$")))
                schema_error(v, sub, "Invalid value: \"%s\": not a label value", ystr(value));
        }
    }
}

/* The CRDs of deploy/crds, loaded once a test. */
typedef struct crd_set {
    yfile files[4];
    size_t n;
} crd_set;

static void crds_load(crd_set *c)
{
    memset(c, 0, sizeof *c);
    static const char *const files[] = {
        "deploy/crds/inference.networking.k8s.io_inferencepools.yaml",
        "deploy/crds/llm-d.ai_inferenceobjectives.yaml",
        "deploy/crds/gateway.networking.k8s.io_httproutes.yaml"};
    for (size_t i = 0; i < sizeof files / sizeof *files; i++) {
        yaml_load(files[i], &c->files[c->n]);
        cr_assert_eq(c->files[c->n].n, 1, "%s: not one document", files[i]);
        cr_assert_str_eq(ystr(yget(yroot(&c->files[c->n].docs[0]), "kind")),
                         "CustomResourceDefinition", "%s is no CRD", files[i]);
        c->n++;
    }
}

static void crds_free(crd_set *c)
{
    for (size_t i = 0; i < c->n; i++)
        yaml_free(&c->files[i]);
}

/* The openAPIV3Schema for apiVersion and kind, or a message saying which
 * part found nothing. */
static yref crd_schema(crd_set *c, const char *api_version, const char *kind, char *why, size_t len)
{
    yref none = {NULL, NULL};
    const char *slash = api_version ? strchr(api_version, '/') : NULL;
    if (!slash || !kind) {
        snprintf(why, len, "apiVersion %s, kind %s: not a custom resource",
                 api_version ? api_version : "(none)", kind ? kind : "(none)");
        return none;
    }
    for (size_t i = 0; i < c->n; i++) {
        yref spec = yget(yroot(&c->files[i].docs[0]), "spec");
        const char *group = ystr(yget(spec, "group"));
        if (!group || strlen(group) != (size_t)(slash - api_version) ||
            strncmp(group, api_version, strlen(group)) != 0 ||
            !same(ystr(ypath(spec, "names.kind")), kind))
            continue;
        yref versions = yget(spec, "versions");
        for (size_t k = 0; k < ylen(versions); k++) {
            yref ver = yat(versions, k);
            if (same(ystr(yget(ver, "name")), slash + 1)) {
                if (!ybool(ver, "served")) {
                    snprintf(why, len, "%s %s: the CRD does not serve %s", kind, api_version,
                             slash + 1);
                    return none;
                }
                return ypath(ver, "schema.openAPIV3Schema");
            }
        }
        snprintf(why, len, "%s: the CRD (%s) has no version %s", kind, c->files[i].name, slash + 1);
        return none;
    }
    snprintf(why, len, "no CRD in deploy/crds defines %s in %s", kind, api_version);
    return none;
}

/* Validate object (one manifest document) against its CRD; false with the
 * errors in v. */
static bool object_conforms(crd_set *c, yref object, schema_run *v)
{
    memset(v, 0, sizeof *v);
    char why[512] = "";
    yref schema = crd_schema(c, ystr(yget(object, "apiVersion")), ystr(yget(object, "kind")), why,
                             sizeof why);
    if (!schema.node) {
        schema_error(v, "", "%s", why);
        return false;
    }
    schema_validate(v, schema, object, "");
    return v->n_errors == 0;
}

/* The manifests of deploy/gateway that are API objects (not the
 * kustomization), from their files. */
#define GATEWAY_FILES 3
static const char *const gateway_files[GATEWAY_FILES] = {"deploy/gateway/inferencepool.yaml",
                                                         "deploy/gateway/inferenceobjectives.yaml",
                                                         "deploy/gateway/httproute.yaml"};

typedef struct gateway {
    yfile files[GATEWAY_FILES];
    yref pool, route;
} gateway;

static void gateway_load(gateway *g)
{
    memset(g, 0, sizeof *g);
    for (size_t i = 0; i < GATEWAY_FILES; i++) {
        yaml_load(gateway_files[i], &g->files[i]);
        for (size_t d = 0; d < g->files[i].n; d++) {
            yref root = yroot(&g->files[i].docs[d]);
            if (same(ystr(yget(root, "kind")), "InferencePool"))
                g->pool = root;
            if (same(ystr(yget(root, "kind")), "HTTPRoute"))
                g->route = root;
        }
    }
    cr_assert(g->pool.node, "deploy/gateway: no InferencePool");
    cr_assert(g->route.node, "deploy/gateway: no HTTPRoute");
}

static void gateway_free(gateway *g)
{
    for (size_t i = 0; i < GATEWAY_FILES; i++)
        yaml_free(&g->files[i]);
}

/* file's text with the first `from` replaced by `to`, validated document by
 * document: the number of errors, all of them in text. */
static size_t broken_copy_errors(crd_set *c, const char *file, const char *from, const char *to,
                                 char *text, size_t len)
{
    char *original = read_text(file);
    char *at = strstr(original, from);
    cr_assert(at, "%s no longer holds \"%s\": the negative test needs a new edit", file, from);
    size_t n = strlen(original) - strlen(from) + strlen(to) + 1;
    char *edited = malloc(n);
    cr_assert(edited);
    snprintf(edited, n, "%.*s%s%s", (int)(at - original), original, to, at + strlen(from));
    yfile yf;
    memset(&yf, 0, sizeof yf);
    yaml_parser_t p;
    cr_assert(yaml_parser_initialize(&p));
    yaml_parser_set_input_string(&p, (const unsigned char *)edited, strlen(edited));
    size_t errors = 0, o = 0;
    text[0] = 0;
    for (;;) {
        yaml_document_t *d = &yf.docs[yf.n];
        cr_assert(yaml_parser_load(&p, d), "%s (edited): not YAML", file);
        if (!yaml_document_get_root_node(d)) {
            yaml_document_delete(d);
            break;
        }
        yf.n++;
        schema_run v;
        if (!object_conforms(c, yroot(d), &v)) {
            errors += v.n_errors;
            schema_errors_text(&v, text + o, len - o);
            o = strlen(text);
        }
    }
    yaml_parser_delete(&p);
    yaml_free(&yf);
    free(edited);
    free(original);
    return errors;
}

/* ---- the CEL rules, by hand ------------------------------------------------------
 * x-kubernetes-validations are CEL programs the API server runs; there is no
 * CEL here. Each rule the validator meets on a field the manifests use is
 * matched by its message to one of these checks, written from the rule's
 * text in the CRD; a rule with no check fails cel_rules_on_used_fields_hold,
 * so a new rule (or a manifest reaching a field with rules) is read before
 * it is trusted. */

/* kind defaults to Service in both CRDs; group to "" (the core group) */
static const char *kind_or_service(yref ref)
{
    const char *kind = ystr(yget(ref, "kind"));
    return kind ? kind : "Service";
}

/* InferencePool: self.kind != 'Service' || has(self.port) */
static bool cel_picker_port(yref self)
{
    return strcmp(kind_or_service(self), "Service") != 0 || yget(self, "port").node;
}

/* InferencePool: self.all(p1, self.exists_one(p2, p1.number==p2.number)) */
static bool cel_unique_port_numbers(yref self)
{
    for (size_t i = 0; i < ylen(self); i++)
        for (size_t j = 0; j < i; j++)
            if (same(ystr(yget(yat(self, i), "number")), ystr(yget(yat(self, j), "number"))))
                return false;
    return true;
}

/* HTTPRoute parentRefs: two references to one parent (group, kind, name,
 * namespace) must both name a sectionName, and different ones. */
static bool cel_parent_sections(yref self)
{
    static const char *const keys[] = {"group", "kind", "name", "namespace"};
    for (size_t i = 0; i < ylen(self); i++)
        for (size_t j = 0; j < i; j++) {
            bool same_parent = true;
            for (size_t k = 0; k < 4; k++) {
                const char *a = ystr(yget(yat(self, i), keys[k]));
                const char *b = ystr(yget(yat(self, j), keys[k]));
                same_parent &= (!a && !b) || same(a, b);
            }
            const char *sa = ystr(yget(yat(self, i), "sectionName"));
            const char *sb = ystr(yget(yat(self, j), "sectionName"));
            if (same_parent && (!sa || !sb || strcmp(sa, sb) == 0))
                return false;
        }
    return true;
}

/* HTTPRoute rules: the matches of the (first 16) rules sum to at most 128 */
static bool cel_total_matches(yref self)
{
    size_t total = 0;
    for (size_t i = 0; i < ylen(self) && i < 16; i++)
        total += ylen(yget(yat(self, i), "matches"));
    return total <= 128;
}

/* HTTPRoute rule: the five RequestRedirect/URLRewrite rules constrain
 * filters; a rule whose route and backends carry none meets them all.
 * With filters this check refuses to vouch (it does not evaluate them). */
static bool cel_no_filters(yref self)
{
    yref backends = yget(self, "backendRefs");
    for (size_t i = 0; i < ylen(backends); i++)
        if (yget(yat(backends, i), "filters").node)
            return false;
    return !yget(self, "filters").node;
}

/* HTTPRoute backendRef: (size(self.group) == 0 && self.kind == 'Service')
 * ? has(self.port) : true */
static bool cel_service_backend_port(yref self)
{
    const char *group = ystr(yget(self, "group"));
    bool core = !group || !*group;
    return !(core && strcmp(kind_or_service(self), "Service") == 0) || yget(self, "port").node;
}

/* HTTPRoute match path: all ten rules at once, for Exact and PathPrefix:
 * absolute, none of //, /./, /../, %2f, %2F, #, no trailing /. or /..,
 * only the characters of ^(?:[-A-Za-z0-9/._~!$&'()*+,;=:@]|[%][0-9a-fA-F]{2})+$ */
static bool cel_clean_path(yref self)
{
    const char *type = ystr(yget(self, "type")), *value = ystr(yget(self, "value"));
    type = type ? type : "PathPrefix"; /* the CRD's default */
    if (strcmp(type, "RegularExpression") == 0)
        return true;
    if (strcmp(type, "Exact") != 0 && strcmp(type, "PathPrefix") != 0)
        return false;
    value = value ? value : "/";
    static const char *const banned[] = {"//", "/./", "/../", "%2f", "%2F", "#"};
    for (size_t i = 0; i < sizeof banned / sizeof *banned; i++)
        if (strstr(value, banned[i]))
            return false;
    size_t n = strlen(value);
    if (value[0] != '/' || (n >= 2 && strcmp(value + n - 2, "/.") == 0) ||
        (n >= 3 && strcmp(value + n - 3, "/..") == 0))
        return false;
    return matches_ere(value, "^([-A-Za-z0-9/._~!$&'()*+,;=:@]|[%][0-9a-fA-F]{2})+$");
}

/* HTTPRoute timeouts: backendRequest no longer than request (0s: none).
 * Both passed the Duration pattern first, which duration_ms reads. */
static bool cel_backend_timeout_within_request(yref self)
{
    const char *request = ystr(yget(self, "request"));
    const char *backend = ystr(yget(self, "backendRequest"));
    if (!request || !backend || duration_ms(request) == 0)
        return true;
    return duration_ms(backend) <= duration_ms(request);
}

typedef struct cel_check {
    const char *message; /* the rule's message, or how it begins */
    bool (*holds)(yref self);
} cel_check;

static const cel_check cel_checks[] = {
    {"port is required when kind is 'Service'", cel_picker_port},
    {"port number must be unique", cel_unique_port_numbers},
    {"sectionName must be specified when parentRefs", cel_parent_sections},
    {"sectionName must be unique when parentRefs", cel_parent_sections},
    {"While 16 rules and 64 matches per rule are allowed", cel_total_matches},
    {"RequestRedirect filter must not be used together with backendRefs", cel_no_filters},
    {"When using RequestRedirect filter with path.replacePrefixMatch", cel_no_filters},
    {"When using URLRewrite filter with path.replacePrefixMatch", cel_no_filters},
    {"Within backendRefs, when using RequestRedirect filter", cel_no_filters},
    {"Within backendRefs, When using URLRewrite filter", cel_no_filters},
    {"Must have port for Service reference", cel_service_backend_port},
    {"value must be an absolute path", cel_clean_path},
    {"must not contain", cel_clean_path},
    {"must not end with", cel_clean_path},
    {"type must be one of ['Exact', 'PathPrefix', 'RegularExpression']", cel_clean_path},
    {"must only contain valid characters", cel_clean_path},
    {"backendRequest timeout cannot be longer than request timeout",
     cel_backend_timeout_within_request},
};

/* ---- deploy/gateway ------------------------------------------------------------ */

TestSuite(gateway, .init = clear_qlserve_env);

Test(gateway, crd_copies_name_their_source_repository_path_and_commit)
{
    char *readme = read_text("deploy/crds/README.md");
    crd_set c;
    crds_load(&c);
    for (size_t i = 0; i < c.n; i++) {
        const char *file = strrchr(c.files[i].name, '/') + 1;
        const char *row = strstr(readme, file);
        cr_assert(row, "deploy/crds/README.md does not name %s", file);
        size_t len = strcspn(row, "\n");
        char line[1024];
        snprintf(line, sizeof line, "%.*s", (int)len, row);
        cr_assert(strstr(line, "github.com/") && strstr(line, "config/crd/"),
                  "deploy/crds/README.md: the row of %s names no repository and path", file);
        cr_assert(matches_ere(line, "commit [0-9a-f]{40}"),
                  "deploy/crds/README.md: the row of %s names no 40-digit commit", file);
    }
    crds_free(&c);
    free(readme);
}

Test(gateway, manifests_conform_to_the_crd_schemas)
{
    crd_set c;
    crds_load(&c);
    gateway g;
    gateway_load(&g);
    size_t objects = 0;
    for (size_t f = 0; f < GATEWAY_FILES; f++)
        for (size_t d = 0; d < g.files[f].n; d++) {
            schema_run v;
            yref root = yroot(&g.files[f].docs[d]);
            char errors[8192];
            bool ok = object_conforms(&c, root, &v);
            schema_errors_text(&v, errors, sizeof errors);
            cr_assert(ok, "%s: %s %s does not conform to its CRD:%s", gateway_files[f],
                      ystr(yget(root, "kind")), ystr(ypath(root, "metadata.name")), errors);
            objects++;
        }
    cr_assert_geq(objects, 4,
                  "deploy/gateway holds %zu objects: a pool, two objectives and a "
                  "route are expected",
                  objects);

    /* every file of deploy/gateway is one of those validated, and the
     * kustomization applies them with deploy/k8s */
    yfile kust;
    yaml_load("deploy/gateway/kustomization.yaml", &kust);
    yref resources = yget(yroot(&kust.docs[0]), "resources");
    bool base = false;
    for (size_t i = 0; i < ylen(resources); i++)
        base |= same(ystr(yat(resources, i)), "../k8s");
    cr_assert(base, "deploy/gateway/kustomization.yaml does not build on ../k8s");
    for (size_t f = 0; f < GATEWAY_FILES; f++) {
        bool listed = false;
        for (size_t i = 0; i < ylen(resources); i++)
            listed |= same(ystr(yat(resources, i)), strrchr(gateway_files[f], '/') + 1);
        cr_assert(listed, "deploy/gateway/kustomization.yaml does not list %s", gateway_files[f]);
    }
    char dir[1024];
    snprintf(dir, sizeof dir, "%s/deploy/gateway", QL_SOURCE_DIR);
    DIR *dp = opendir(dir);
    cr_assert(dp);
    for (struct dirent *e; (e = readdir(dp));) {
        if (e->d_name[0] == '.' || strcmp(e->d_name, "kustomization.yaml") == 0)
            continue;
        bool validated = false;
        for (size_t f = 0; f < GATEWAY_FILES; f++)
            validated |= strcmp(strrchr(gateway_files[f], '/') + 1, e->d_name) == 0;
        cr_assert(validated, "deploy/gateway/%s is not validated by this test", e->d_name);
    }
    closedir(dp);
    yaml_free(&kust);
    gateway_free(&g);
    crds_free(&c);
}

Test(gateway, broken_manifests_are_refused_naming_the_field)
{
    static const struct {
        const char *file, *from, *to, *expect;
    } cases[] = {
        /* a misspelt field: unknown, and the required one it replaced is missing */
        {"deploy/gateway/inferencepool.yaml",
         "  selector:", "  selektor:", "spec.selektor: unknown field"},
        {"deploy/gateway/inferencepool.yaml",
         "  selector:", "  selektor:", "spec: Required value: selector"},
        /* out of range, and of the wrong type */
        {"deploy/gateway/inferencepool.yaml", "number: 8080", "number: 70000",
         "spec.targetPorts[0].number: Invalid value: 70000: should be less than or equal to 65535"},
        {"deploy/gateway/inferencepool.yaml", "number: 8080", "number: \"8080\"",
         "spec.targetPorts[0].number: Invalid value: \"8080\": must be of type integer"},
        /* a bad enum */
        {"deploy/gateway/inferencepool.yaml", "failureMode: FailOpen", "failureMode: FailSoft",
         "spec.endpointPickerRef.failureMode: Unsupported value: \"FailSoft\""},
        /* a pattern: a label value may not begin with '-' */
        {"deploy/gateway/inferencepool.yaml", "      app: qlserve", "      app: -qlserve",
         "spec.selector.matchLabels.app: Invalid value: \"-qlserve\": should match"},
        /* a plain "on" is a boolean to kubectl (YAML 1.1), not the string */
        {"deploy/gateway/inferencepool.yaml", "      app: qlserve", "      app: on",
         "spec.selector.matchLabels.app: Invalid value: \"on\": must be of type string, not "
         "boolean"},
        /* an empty list where minItems is 1 */
        {"deploy/gateway/inferencepool.yaml", "  targetPorts:\n    - number: 8080",
         "  targetPorts: []", "spec.targetPorts: Invalid value: 0 items, fewer than 1"},
        {"deploy/gateway/inferenceobjectives.yaml", "priority: 10", "priority: high",
         "spec.priority: Invalid value: \"high\": must be of type integer"},
        {"deploy/gateway/inferenceobjectives.yaml", "    name: qlserve\n", "    nme: qlserve\n",
         "spec.poolRef: Required value: name"},
        {"deploy/gateway/httproute.yaml", "type: PathPrefix", "type: Prefix",
         "spec.rules[0].matches[0].path.type: Unsupported value: \"Prefix\""},
        {"deploy/gateway/httproute.yaml", "request: 300s", "request: 5min",
         "spec.rules[0].timeouts.request: Invalid value: \"5min\""},
        {"deploy/gateway/httproute.yaml",
         "      backendRefs:", "      backends:", "spec.rules[0].backends: unknown field"},
        /* the version must be one the CRD serves */
        {"deploy/gateway/httproute.yaml", "gateway.networking.k8s.io/v1\n",
         "gateway.networking.k8s.io/v2\n", "has no version v2"},
        {"deploy/gateway/httproute.yaml", "  name: qlserve\n  labels:",
         "  name: Qlserve\n  labels:", "metadata.name: Invalid value: \"Qlserve\""},
        /* a header name outside HTTP's token characters (the pattern has
         * \x60, which the POSIX translation must take) */
        {"deploy/gateway/httproute.yaml", "            value: /v1\n",
         "            value: /v1\n          headers:\n            - name: X Tenant\n"
         "              value: a\n",
         "spec.rules[0].matches[0].headers[0].name: Invalid value: \"X Tenant\""},
    };
    crd_set c;
    crds_load(&c);
    for (size_t i = 0; i < sizeof cases / sizeof *cases; i++) {
        char errors[8192];
        size_t n = broken_copy_errors(&c, cases[i].file, cases[i].from, cases[i].to, errors,
                                      sizeof errors);
        cr_assert_gt(n, 0, "%s with \"%s\" made \"%s\" is accepted", cases[i].file, cases[i].from,
                     cases[i].to);
        cr_assert(strstr(errors, cases[i].expect),
                  "%s with \"%s\" made \"%s\": no error says \"%s\"; the errors:%s", cases[i].file,
                  cases[i].from, cases[i].to, cases[i].expect, errors);
    }
    /* and an edit the schema allows passes: the same header, well named */
    char errors[8192];
    cr_assert_eq(broken_copy_errors(&c, "deploy/gateway/httproute.yaml", "            value: /v1\n",
                                    "            value: /v1\n          headers:\n"
                                    "            - name: X-Tenant`1\n              value: a\n",
                                    errors, sizeof errors),
                 0, "a header match named X-Tenant`1 is refused:%s", errors);
    crds_free(&c);
}

Test(gateway, cel_rules_on_used_fields_hold)
{
    crd_set c;
    crds_load(&c);
    gateway g;
    gateway_load(&g);
    size_t checked = 0;
    for (size_t f = 0; f < GATEWAY_FILES; f++)
        for (size_t d = 0; d < g.files[f].n; d++) {
            schema_run v;
            cr_assert(object_conforms(&c, yroot(&g.files[f].docs[d]), &v));
            for (size_t r = 0; r < v.n_rules; r++) {
                const cel_use *u = &v.rules[r];
                const cel_check *check = NULL;
                for (size_t k = 0; k < sizeof cel_checks / sizeof *cel_checks; k++)
                    if (starts_with(u->message, cel_checks[k].message))
                        check = &cel_checks[k];
                cr_assert(check,
                          "%s: the CEL rule at %s (\"%s\") has no check by hand in "
                          "test_deploy.c: read it in the CRD and add one",
                          gateway_files[f], u->path, u->message);
                cr_assert(check->holds(u->self), "%s: %s: the CEL rule \"%s\" fails",
                          gateway_files[f], u->path, u->message);
                checked++;
            }
        }
    /* the pool's picker port and unique target ports, the route's parents,
     * rules, backend, path and timeouts */
    cr_assert_geq(checked, 15, "only %zu CEL rules met: the walk no longer reaches them", checked);

    /* and the checks themselves refuse what their rules refuse */
    yaml_document_t doc;
    yaml_parser_t p;
    static const char bad[] =
        "{endpointPickerRef: {name: epp}, paths: [{type: PathPrefix, value: v1}, "
        "{type: Exact, value: /v1//x}, {type: PathPrefix, value: /v1/..}], "
        "ports: [{number: 1}, {number: 1}], timeouts: {request: 10s, backendRequest: 1m}, "
        "backend: {kind: Service, name: x}, parents: [{name: g}, {name: g}]}";
    cr_assert(yaml_parser_initialize(&p));
    yaml_parser_set_input_string(&p, (const unsigned char *)bad, strlen(bad));
    cr_assert(yaml_parser_load(&p, &doc));
    yref root = yroot(&doc);
    cr_assert(!cel_picker_port(yget(root, "endpointPickerRef")));
    for (size_t i = 0; i < 3; i++)
        cr_assert(!cel_clean_path(yat(yget(root, "paths"), i)), "path %zu passes", i);
    cr_assert(!cel_unique_port_numbers(yget(root, "ports")));
    cr_assert(!cel_backend_timeout_within_request(yget(root, "timeouts")));
    cr_assert(!cel_service_backend_port(yget(root, "backend")));
    cr_assert(!cel_parent_sections(yget(root, "parents")));
    yaml_document_delete(&doc);
    yaml_parser_delete(&p);
    gateway_free(&g);
    crds_free(&c);
}

Test(gateway, pool_selects_the_qlserve_pods_on_the_served_port)
{
    image_command ic;
    image_command_load(&ic);
    cluster k;
    cluster_load(&k);
    served s = cluster_served(&k, &ic);
    gateway g;
    gateway_load(&g);
    cr_assert(selects(ypath(g.pool, "spec.selector.matchLabels"), ypath(k.pod, "metadata.labels")),
              "the InferencePool's selector does not match the qlserve Deployment's pod labels");
    yref ports = ypath(g.pool, "spec.targetPorts");
    cr_assert_eq(ylen(ports), 1, "the pool has %zu target ports; qlserve serves one", ylen(ports));
    long port = yint(yget(yat(ports, 0), "number"), -1);
    cr_assert_eq(port, s.port, "the pool targets port %ld; qlserve serves on %d", port, s.port);
    bool declared = false;
    yref container_ports = yget(k.container, "ports");
    for (size_t i = 0; i < ylen(container_ports); i++)
        declared |= yint(yget(yat(container_ports, i), "containerPort"), -1) == port;
    cr_assert(declared, "the container declares no port %ld", port);
    /* the llm-d-router chart names its EPP Service <release>-epp and
     * watches the pool named after its release (routerlib/_helpers.tpl) */
    char epp[300];
    snprintf(epp, sizeof epp, "%s-epp", ystr(ypath(g.pool, "metadata.name")));
    cr_assert_str_eq(ystr(ypath(g.pool, "spec.endpointPickerRef.name")), epp,
                     "the pool's endpoint picker is not the chart's Service for release %s",
                     ystr(ypath(g.pool, "metadata.name")));
    gateway_free(&g);
    cluster_free(&k);
    image_command_free(&ic);
}

Test(gateway, objectives_and_route_point_at_the_pool)
{
    gateway g;
    gateway_load(&g);
    const char *pool = ystr(ypath(g.pool, "metadata.name"));
    size_t objectives = 0;
    for (size_t f = 0; f < GATEWAY_FILES; f++)
        for (size_t d = 0; d < g.files[f].n; d++) {
            yref root = yroot(&g.files[f].docs[d]);
            if (!same(ystr(yget(root, "kind")), "InferenceObjective"))
                continue;
            yref ref = ypath(root, "spec.poolRef");
            cr_assert(same(ystr(yget(ref, "name")), pool) &&
                          same(ystr(yget(ref, "group")), "inference.networking.k8s.io"),
                      "InferenceObjective %s is not in the pool %s",
                      ystr(ypath(root, "metadata.name")), pool);
            objectives++;
        }
    cr_assert_geq(objectives, 2, "one objective for the base model and one for an adapter");

    yref rules = ypath(g.route, "spec.rules");
    bool v1 = false;
    for (size_t r = 0; r < ylen(rules); r++) {
        yref rule = yat(rules, r), backends = yget(rule, "backendRefs"),
             matches = yget(rule, "matches");
        bool to_pool = false;
        for (size_t b = 0; b < ylen(backends); b++)
            to_pool |= same(ystr(yget(yat(backends, b), "kind")), "InferencePool") &&
                       same(ystr(yget(yat(backends, b), "group")), "inference.networking.k8s.io") &&
                       same(ystr(yget(yat(backends, b), "name")), pool);
        for (size_t m = 0; m < ylen(matches) && to_pool; m++)
            v1 |= same(ystr(ypath(yat(matches, m), "path.type")), "PathPrefix") &&
                  same(ystr(ypath(yat(matches, m), "path.value")), "/v1");
    }
    cr_assert(v1, "the HTTPRoute sends no PathPrefix /v1 to the InferencePool %s", pool);
    gateway_free(&g);
}

Test(gateway, adapter_folder_is_a_read_only_claim_every_replica_shares)
{
    image_command ic;
    image_command_load(&ic);
    cluster k;
    cluster_load(&k);
    served s = cluster_served(&k, &ic);
    cr_assert(s.adapter_dir[0], "the Deployment's server has no --adapter-dir");
    yref mounts = yget(k.container, "volumeMounts"), mount = {NULL, NULL};
    size_t longest = 0;
    for (size_t i = 0; i < ylen(mounts); i++) { /* the deepest mount holding the folder */
        const char *path = ystr(yget(yat(mounts, i), "mountPath"));
        if (path && under(s.adapter_dir, path) && strlen(path) > longest) {
            longest = strlen(path);
            mount = yat(mounts, i);
        }
    }
    cr_assert(mount.node, "nothing is mounted at --adapter-dir %s", s.adapter_dir);
    cr_assert(same(ystr(yget(mount, "readOnly")), "true"),
              "the adapter folder %s is mounted writable: replicas only read it", s.adapter_dir);
    yref volume = pod_volume(&k, ystr(yget(mount, "name")));
    const char *claim = ystr(ypath(volume, "persistentVolumeClaim.claimName"));
    cr_assert(claim, "the adapter folder is on no PersistentVolumeClaim");
    yref pvc = find_object(&k, "PersistentVolumeClaim", claim);
    cr_assert(pvc.node, "deploy/k8s: no PersistentVolumeClaim %s", claim);
    bool shared = false;
    yref modes = ypath(pvc, "spec.accessModes");
    for (size_t a = 0; a < ylen(modes); a++)
        shared |=
            same(ystr(yat(modes, a)), "ReadWriteMany") || same(ystr(yat(modes, a)), "ReadOnlyMany");
    cr_assert(shared,
              "claim %s is not ReadWriteMany or ReadOnlyMany: pods on other nodes cannot "
              "mount it",
              claim);
    cr_assert_gt(yint(ypath(k.deployment, "spec.replicas"), 1), 1,
                 "one replica: nothing to scale out behind the gateway");
    cluster_free(&k);
    image_command_free(&ic);
}

Test(guide, explains_the_scale_out_path_behind_the_inference_gateway)
{
    char *guide = read_text("docs/operations.md");
    static const char *const topics[] = {"kubectl apply -k deploy/gateway",
                                         "InferencePool",
                                         "InferenceObjective",
                                         "HTTPRoute",
                                         "llm-d-router-gateway",
                                         "router.inferencePool.create=false",
                                         "--adapter-dir",
                                         "--no-lazy-adapters",
                                         "vllm:num_requests_waiting",
                                         "vllm:num_requests_running",
                                         "vllm:kv_cache_usage_perc",
                                         "vllm:lora_requests_info",
                                         "max_lora",
                                         "running_lora_adapters",
                                         "waiting_lora_adapters",
                                         "deploy/crds"};
    for (size_t i = 0; i < sizeof topics / sizeof *topics; i++)
        cr_assert(strstr(guide, topics[i]), "docs/operations.md says nothing of %s", topics[i]);
    free(guide);
}

/* ---- the operator's guide ---------------------------------------------------------- */

Test(guide, names_every_metric_the_server_exports)
{
    char *source = read_text("server/metrics.c"), *guide = read_text("docs/operations.md");
    size_t names = 0;
    for (const char *p = strstr(source, "\"qlserve_"); p; p = strstr(p + 1, "\"qlserve_")) {
        char name[128];
        snprintf(name, sizeof name, "%.*s", (int)strspn(p + 1, "abcdefghijklmnopqrstuvwxyz_"),
                 p + 1);
        cr_assert(has_name(guide, name), "docs/operations.md does not explain %s", name);
        names++;
    }
    cr_assert_geq(names, 20, "found only %zu metric names in server/metrics.c", names);
    static const char *const topics[] = {
        "QLSERVE_ADMIN_TOKEN", "--admin-token-file", "/health",
        "enableServiceLinks",  "admin-fanout.sh",    "terminationGracePeriodSeconds",
        "--target cpu"};
    for (size_t i = 0; i < sizeof topics / sizeof *topics; i++)
        cr_assert(strstr(guide, topics[i]), "docs/operations.md says nothing of %s", topics[i]);
    free(source);
    free(guide);
}

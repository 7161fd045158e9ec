/*
 * serve.c - `qlserve serve`: the setup, one libuv loop, the model loaded
 * off the loop (GET /health answers 503 until it serves), and the
 * graceful drain. The top of server/: it wires the hooks table the lower
 * files call up through (a complete request to routes.c's srv_route, a
 * connection's end to bridge.c's srv_gen_conn_gone, the drain check to
 * itself), as libuv hands a handle its callbacks.
 *
 * SIGTERM or SIGINT: stop accepting, close idle connections, let running
 * generations finish for the grace period, then cancel what is left (each
 * gets its final event, finish reason "cancelled"), wait for their ends,
 * stop the engine and exit 0.
 *
 * The adapter registry's state file (--state-file, by default under the
 * server's own state directory, --state-dir) is decided before the server
 * listens, so a bad explicit one stops it at once, and replayed on the
 * load thread once the registry exists, before the server serves. A
 * --host that is not loopback without an admin token gets one generated
 * into the state directory (mode 0600), and the log says where.
 *
 * Offers srv_serve, srv_conn_init_detached (server.h: the seam's
 * connection gets the same hooks) and --activations' setting
 * (srv_activations_set and _settle, which `qlserve generate` shares). Owns the server struct, the
 * hooks, the model, the engine's, the adapter registry's and the grammar cache's (compiled grammars
 * by text, shared by every request) lifetimes, the signals and the grace timer. Touches the engine
 * (load, start, cancel when the grace ends, stop), http.c's listener and connections, bridge.c's
 * wake callback, and metrics.c's init.
 */
#include "internal/admin.h"
#include "internal/api_chat.h"
#include "internal/gen.h"
#include "internal/http.h"
#include "internal/metrics.h"
#include "internal/responses_store.h"
#include "internal/routes.h"

#include <errno.h>
#include <fcntl.h>
#include <limits.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/random.h>
#include <sys/stat.h>
#include <time.h>
#include <unistd.h>

/* --- shutdown ----------------------------------------------------------------------- */

static void close_walk(uv_handle_t *h, void *arg)
{
    (void)arg;
    if (!uv_is_closing(h))
        uv_close(h, NULL);
}

/* After an event that may end a drain (the hooks' check_drained): close
 * everything, so the loop exits, when nothing is left. */
static void check_drained(srv_server *s)
{
    if (!s->draining || s->n_live > 0 || s->n_work > 0 || s->handles_closed || s->in_check)
        return;
    /* nothing runs: close the connections (each flushes what it has
     * written), then the server's own handles; the loop then ends */
    s->in_check = true;
    for (srv_conn *c = s->conns, *next; c; c = next) {
        next = c->next;
        srv_http_close(c);
    }
    s->in_check = false;
    s->handles_closed = true;
    if (s->listening) {
        s->listening = false;
        uv_close((uv_handle_t *)&s->listener, NULL);
    }
    uv_handle_t *own[] = {(uv_handle_t *)&s->wake,    (uv_handle_t *)&s->grace,
                          (uv_handle_t *)&s->sigterm, (uv_handle_t *)&s->sigint,
                          (uv_handle_t *)&s->resume,  (uv_handle_t *)&s->turn_check};
    for (size_t i = 0; i < sizeof own / sizeof *own; i++)
        if (!uv_is_closing(own[i]))
            uv_close(own[i], NULL);
}

/* The loop thread's CPU clock, in seconds. */
static double thread_cpu_s(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_THREAD_CPUTIME_ID, &ts);
    return (double)ts.tv_sec + 1e-9 * (double)ts.tv_nsec;
}

/* After each turn's polling and its I/O callbacks: what the turn cost the
 * loop thread since the last one (a wait in epoll costs no CPU). */
static void on_turn(uv_check_t *h)
{
    srv_server *s = h->data;
    double now = thread_cpu_s(), took = now - s->turn_cpu_s;
    s->turn_cpu_s = now;
    srv_metrics_observe(&s->metrics.loop_turn, took);
    if (took > s->metrics.loop_turn_max)
        s->metrics.loop_turn_max = took;
}

static void on_grace(uv_timer_t *t)
{
    srv_server *s = t->data;
    for (srv_gen *g = s->live; g; g = g->next_live)
        srv_gen_cancel(g);
}

static void on_signal(uv_signal_t *sig, int signum)
{
    srv_server *s = sig->data;
    if (s->draining) {
        on_grace(&s->grace); /* a second signal: cancel now */
        return;
    }
    fprintf(stderr, "qlserve: %s: draining (grace %d ms)\n",
            signum == SIGTERM ? "SIGTERM" : "SIGINT", s->cfg->grace_ms);
    s->draining = true;
    s->serving = false;
    if (s->engine) /* a pause (/admin/engine/pause) would hold the drain to its grace */
        eng_engine_gate(s->engine, -1);
    srv_http_stop_accepting(s);
    uv_timer_start(&s->grace, on_grace, (uint64_t)s->cfg->grace_ms, 0);
    uv_unref((uv_handle_t *)&s->grace);
    check_drained(s);
}

/* --- loading the model ---------------------------------------------------------- */

typedef struct load_job {
    uv_work_t req;
    srv_server *s;
    char state_file[PATH_MAX]; /* the registry's journal; empty: none */
    int rc;
    char msg[1024];
} load_job;

/* --- the server's own files: the state directory ------------------------------------ */

/* The state directory into out: --state-dir, else $XDG_STATE_HOME/qlserve
 * (an absolute one: the XDG Base Directory spec ignores a relative one),
 * else $HOME/.local/state/qlserve; false when none can be named. */
static bool state_dir_path(const cfg_serve *c, char *out, size_t cap)
{
    const char *xdg = getenv("XDG_STATE_HOME"), *home = getenv("HOME");
    int n = c->state_dir             ? snprintf(out, cap, "%s", c->state_dir)
            : xdg && xdg[0] == '/'   ? snprintf(out, cap, "%s/qlserve", xdg)
            : home && home[0] == '/' ? snprintf(out, cap, "%s/.local/state/qlserve", home)
                                     : -1;
    return n > 0 && (size_t)n < cap;
}

/* dir, made with its missing parents (mode 0700: the journal and the
 * token are nobody else's business); 0 or the errno of what failed. */
static int make_dirs(const char *dir)
{
    char path[PATH_MAX];
    snprintf(path, sizeof path, "%s", dir);
    for (char *p = path + 1;; p++) {
        if (*p != '/' && *p)
            continue;
        char was = *p;
        *p = 0;
        struct stat sb;
        if (mkdir(path, 0700) != 0 && errno != EEXIST)
            return errno;
        if (stat(path, &sb) != 0 || !S_ISDIR(sb.st_mode))
            return ENOTDIR;
        if (!(*p = was))
            return 0;
    }
}

/*
 * Where the registry journals its state, into out (empty: no journal):
 * --state-file FILE, whose folder must exist and be writable (QL_EIO
 * naming both, so the server stops before it serves what it could not
 * keep); "none"; or, unset and with --adapter-dir, CFG_STATE_FILE_NAME
 * under the state directory dir ("": none could be named), never in the
 * adapter folder, which uploaders may write and whose journal the server
 * would then replay as its own. An unusable default is a warning on
 * stderr and no journal, not a refusal to start.
 */
static int state_file_path(const cfg_serve *c, const char *dir, char *out, size_t out_len,
                           char *msg, size_t msg_len)
{
    out[0] = 0;
    const char *file = c->state_file;
    if (file && strcmp(file, CFG_STATE_FILE_NONE) == 0)
        return QL_OK;
    if (!file && !c->adapter_dir)
        return QL_OK;
    char path[PATH_MAX], folder[PATH_MAX];
    if (file)
        snprintf(path, sizeof path, "%s", file);
    else
        snprintf(path, sizeof path, "%s/%s", dir[0] ? dir : "(no HOME)", CFG_STATE_FILE_NAME);
    const char *slash = strrchr(path, '/');
    if (!slash)
        snprintf(folder, sizeof folder, ".");
    else
        snprintf(folder, sizeof folder, "%.*s", slash == path ? 1 : (int)(slash - path), path);
    struct stat sb;
    const char *problem = NULL;
    int err = file ? 0 : dir[0] ? make_dirs(dir) : ENOENT;
    if (err)
        problem = "its folder cannot be made";
    else if (stat(folder, &sb) != 0)
        problem = "its folder cannot be used", err = errno;
    else if (!S_ISDIR(sb.st_mode))
        problem = "its folder is not a folder", err = ENOTDIR;
    else if (access(folder, W_OK | X_OK) != 0)
        problem = "its folder cannot be written", err = errno;
    else if (stat(path, &sb) == 0 && !S_ISREG(sb.st_mode))
        problem = "it is not a regular file", err = EISDIR;
    if (problem && (file || c->state_dir))
        return ql_fail(msg, msg_len, QL_EIO, "%s %s: %s (%s): %s",
                       file ? "--state-file" : "--state-dir", file ? path : c->state_dir, problem,
                       folder, strerror(err));
    if (problem) {
        fprintf(stderr,
                "qlserve: warning: state file %s: %s (%s): %s; running without one, so loaded "
                "adapters and merges will not survive a restart (--state-dir DIR or --state-file "
                "FILE puts it elsewhere, --state-file none silences this)\n",
                path, problem, folder, strerror(err));
        return QL_OK;
    }
    if (strlen(path) >= out_len)
        return ql_fail(msg, msg_len, QL_EINVAL, "--state-file %.100s...: path too long", path);
    snprintf(out, out_len, "%s", path);
    return QL_OK;
}

/* How many random bytes a generated admin token holds (as hex, twice as
 * many characters): 256 bits, what `openssl rand -hex 32` gives. */
#define GENERATED_TOKEN_BYTES 32

/* The admin token kept in path by an earlier start into token: a regular
 * file of this user's that nobody else may read, whose first line is a
 * token config would take. */
static int read_kept_token(int fd, const char *path, char *token, size_t cap, char *msg,
                           size_t msg_len)
{
    struct stat sb;
    if (fstat(fd, &sb) != 0 || !S_ISREG(sb.st_mode) || sb.st_uid != geteuid())
        return ql_fail(msg, msg_len, QL_EIO,
                       "admin token file %s: not a regular file of this user's; remove it", path);
    if (sb.st_mode & 077)
        return ql_fail(msg, msg_len, QL_EIO,
                       "admin token file %s: mode %03o lets others read the admin token; "
                       "chmod 600 it, or remove it for a new one",
                       path, (unsigned)(sb.st_mode & 0777));
    char text[CFG_SECRET_MAX + 2];
    ssize_t n = read(fd, text, sizeof text - 1);
    text[n > 0 ? n : 0] = 0;
    size_t len = strcspn(text, "\r\n");
    bool ok = len > 0 && len <= CFG_SECRET_MAX && len < cap;
    for (size_t i = 0; ok && i < len; i++)
        ok = text[i] > ' ' && text[i] < 0x7f;
    if (!ok)
        return ql_fail(msg, msg_len, QL_EIO,
                       "admin token file %s: its first line is no token (1 to %d printable "
                       "bytes); remove it for a new one",
                       path, CFG_SECRET_MAX);
    memcpy(token, text, len);
    token[len] = 0;
    return QL_OK;
}

/* A new admin token into path (created, mode 0600, never over a file) and
 * token. */
static int write_new_token(const char *path, char *token, size_t cap, char *msg, size_t msg_len)
{
    unsigned char raw[GENERATED_TOKEN_BYTES];
    if (getrandom(raw, sizeof raw, 0) != (ssize_t)sizeof raw || cap < 2 * sizeof raw + 1)
        return ql_fail(msg, msg_len, QL_EIO, "admin token: no random bytes: %s", strerror(errno));
    for (size_t i = 0; i < sizeof raw; i++)
        snprintf(token + 2 * i, 3, "%02x", raw[i]);
    int fd = open(path, O_WRONLY | O_CREAT | O_EXCL | O_NOFOLLOW | O_CLOEXEC, 0600);
    bool ok = fd >= 0 && write(fd, token, 2 * sizeof raw) == (ssize_t)(2 * sizeof raw) &&
              write(fd, "\n", 1) == 1 && fsync(fd) == 0;
    int err = errno;
    if (fd >= 0 && close(fd) != 0)
        ok = false;
    if (!ok) {
        if (fd >= 0)
            unlink(path);
        token[0] = 0;
        return ql_fail(msg, msg_len, QL_EIO, "admin token file %s: cannot write it: %s", path,
                       strerror(err));
    }
    return QL_OK;
}

/*
 * With a --host that is not loopback and no admin token configured, the
 * admin routes must not be open to the network: the token kept under the
 * state directory dir by an earlier start, else a new one written there,
 * into s->generated_token, and the log says where (never the token).
 * QL_EIO, and the server does not start, when it can be neither.
 */
static int admin_token_for_network(srv_server *s, const char *dir, char *msg, size_t msg_len)
{
    const cfg_serve *c = s->cfg;
    if (c->admin_token || srv_admin_is_loopback_address(c->host))
        return QL_OK;
    char path[PATH_MAX];
    int err = dir[0] ? make_dirs(dir) : ENOENT;
    if (err || snprintf(path, sizeof path, "%s/%s", dir, CFG_ADMIN_TOKEN_NAME) >= (int)sizeof path)
        return ql_fail(msg, msg_len, QL_EIO,
                       "--host %s is not loopback, so the admin routes need a token, and none "
                       "is configured; the state directory %s to generate one into cannot be "
                       "made: %s (give --admin-token-file FILE, or --state-dir DIR)",
                       c->host, dir[0] ? dir : "(no HOME)", strerror(err ? err : ENAMETOOLONG));
    int fd = open(path, O_RDONLY | O_NOFOLLOW | O_CLOEXEC);
    bool kept = fd >= 0;
    int rc =
        kept
            ? read_kept_token(fd, path, s->generated_token, sizeof s->generated_token, msg, msg_len)
        : errno == ENOENT
            ? write_new_token(path, s->generated_token, sizeof s->generated_token, msg, msg_len)
            : ql_fail(msg, msg_len, QL_EIO, "admin token file %s: %s", path, strerror(errno));
    if (fd >= 0)
        close(fd);
    if (rc != QL_OK)
        return rc;
    fprintf(stderr,
            "qlserve: --host %s is not loopback and no admin token is configured: the admin "
            "routes want the token %s %s (mode 0600); send \"Authorization: Bearer $(cat %s)\"\n",
            c->host, kept ? "kept in" : "generated into", path, path);
    return QL_OK;
}

/* The journal's name in the adapter folder before it moved out: one left
 * there is no longer read (anyone who can upload an adapter can write it),
 * which the log says, so that an upgrade does not lose it unseen. */
#define OLD_STATE_FILE_NAME ".qlserve-state.json"

/* The state directory's files, before the server listens: the journal's
 * path into j, the admin token a network listener needs into s. */
static int prepare_state(srv_server *s, load_job *j, char *msg, size_t msg_len)
{
    char dir[PATH_MAX] = "", old[PATH_MAX];
    if (!state_dir_path(s->cfg, dir, sizeof dir))
        dir[0] = 0;
    int rc = state_file_path(s->cfg, dir, j->state_file, sizeof j->state_file, msg, msg_len);
    struct stat sb;
    if (rc == QL_OK && s->cfg->adapter_dir && !s->cfg->state_file &&
        snprintf(old, sizeof old, "%s/%s", s->cfg->adapter_dir, OLD_STATE_FILE_NAME) <
            (int)sizeof old &&
        stat(old, &sb) == 0)
        fprintf(stderr,
                "qlserve: warning: %s is not read: the journal lives in the state directory "
                "now (%s), out of the adapter folder uploaders can write; check it and move it "
                "there to keep what it holds\n",
                old, j->state_file[0] ? j->state_file : "none usable");
    return rc == QL_OK ? admin_token_for_network(s, dir, msg, msg_len) : rc;
}

/* Replay the registry's journal and say in the log what came back and
 * what did not (each adapter by name, with the reason; /admin/state shows
 * the same). */
static void restore_state(srv_server *s, const char *state_file)
{
    size_t n_errors = lora_registry_restore(s->registry, s->cfg->adapter_dir);
    lora_state st;
    lora_registry_state(s->registry, &st);
    fprintf(stderr, "qlserve: state file %s: %zu adapters loaded, %zu merged%s\n", state_file,
            st.n_loaded, st.n_merged, n_errors ? "; not restored:" : "");
    lora_restore_error *errs = NULL;
    size_t n = 0;
    lora_registry_restore_errors(s->registry, &errs, &n);
    for (size_t i = 0; i < n; i++) {
        if (errs[i].name[0])
            fprintf(stderr, "qlserve:   adapter %s (%s): %s\n", errs[i].name, errs[i].path,
                    errs[i].error);
        else
            fprintf(stderr, "qlserve:   %s\n", errs[i].error);
    }
    free(errs);
}

/* --- speculative decoding (--speculative) ------------------------------------------- */

int srv_spec_opts(const cfg_spec *c, eng_spec_opts *out, char *msg, size_t msg_len)
{
    *out = (eng_spec_opts){.drafter = ENG_SPEC_OFF,
                           .draft_max = c->draft_max,
                           .draft_fixed = c->draft_fixed,
                           .ngram_min = c->ngram_min,
                           .ngram_max = c->ngram_max,
                           .memory_tokens = c->ngram_memory,
                           .max_batch = c->max_batch,
                           .draft_kv_bytes = (size_t)c->draft_kv_mib << 20};
    int rc =
        c->speculative ? eng_speculative_parse(c->speculative, &out->drafter, msg, msg_len) : QL_OK;
    if (rc == QL_OK && c->draft_model && out->drafter != ENG_SPEC_DRAFT)
        rc = ql_fail(msg, msg_len, QL_EINVAL,
                     "--draft-model %s is read only with --speculative draft (not %s)",
                     c->draft_model, c->speculative ? c->speculative : "off");
    return rc;
}

int srv_draft_load(const cfg_spec *c, const eng_load_opts *lo, eng_model *dm, eng_spec_opts *o,
                   char *msg, size_t msg_len)
{
    memset(dm, 0, sizeof *dm);
    if (!c->draft_model)
        return QL_OK;
    eng_load_opts dl = *lo;
    dl.path = c->draft_model;
    dl.chat_template = NULL; /* the draft never renders a chat */
    char why[768];
    int rc = eng_model_load(dm, &dl, why, sizeof why);
    if (rc != QL_OK)
        return ql_fail(msg, msg_len, rc, "--draft-model %s: %s", c->draft_model, why);
    o->draft_model = dm;
    return QL_OK;
}

/* --- activations (--activations) ------------------------------------------------ */

void srv_activations_set(const char *word)
{
    /* config checked the word (ql_activations_names); NULL: f32 */
    qt_set_activations(ql_name_parse(&ql_activations_names, word) == QL_ACTIVATIONS_Q8
                           ? QL_ACTIVATIONS_Q8
                           : QL_ACTIVATIONS_F32);
}

void srv_activations_settle(const eng_engine *e, FILE *log, const char *who)
{
    /* eng_backend_describe's text begins with the device's name */
    const char *cuda = eng_device_name(ENG_DEVICE_CUDA);
    if (qt_get_activations() == QL_ACTIVATIONS_F32 ||
        strncmp(eng_engine_backend(e), cuda, strlen(cuda)))
        return;
    qt_set_activations(QL_ACTIVATIONS_F32);
    fprintf(log,
            "%s: --activations q8 is the CPU kernels' path; the CUDA backend keeps f32 "
            "activations, so this run computes in f32\n",
            who);
}

static void load_run(uv_work_t *req)
{
    load_job *j = req->data;
    srv_server *s = j->s;
    const cfg_serve *c = s->cfg;
    eng_load_opts lo = {.path = c->model.path,
                        .quant = c->model.quant,
                        .blocksize = c->model.blocksize,
                        .group_size = c->model.group_size,
                        .quantize_lm_head = c->model.quantize_lm_head,
                        .dtype = c->model.dtype,
                        .chat_template = c->model.chat_template};
    srv_activations_set(c->activations); /* before the weights load: process-wide */
    j->rc = eng_model_load(&s->model, &lo, j->msg, sizeof j->msg);
    if (j->rc != QL_OK)
        return;
    eng_engine_opts eo = {
        .kv_bytes = (size_t)c->kv_mib << 20,
        .max_running = c->max_running,
        .step_budget_ms = (float)c->step_budget_ms,
        .max_prefill_per_step = c->max_prefill_per_step,
        .min_prefill_per_step = c->min_prefill_per_step,
        .max_queued = c->max_queued > 0 ? c->max_queued : 1,
        .max_new_tokens = c->max_new_tokens,
        /* the server refuses what would not fit, as TGI does,
         * rather than cut it short at the context's end */
        .max_context = c->max_context > 0 && c->max_context < s->model.cfg.max_position_embeddings
                           ? c->max_context
                           : s->model.cfg.max_position_embeddings,
        .threads = c->threads,
        .no_prefix_cache = c->no_prefix_cache};
    j->rc = eng_device_parse(c->device, &eo.device, j->msg, sizeof j->msg);
    if (j->rc == QL_OK)
        j->rc = srv_spec_opts(&c->spec, &eo.spec, j->msg, sizeof j->msg);
    if (j->rc == QL_OK)
        j->rc = srv_draft_load(&c->spec, &lo, &s->draft_model, &eo.spec, j->msg, sizeof j->msg);
    if (j->rc == QL_OK)
        j->rc = eng_kv_dtype_resolve(c->kv_dtype, eo.device, &eo.kv_dtype, j->msg, sizeof j->msg);
    if (j->rc == QL_OK)
        j->rc = eng_engine_start(&s->engine, &s->model, &eo, j->msg, sizeof j->msg);
    if (j->rc == QL_OK)
        srv_activations_settle(s->engine, stderr, "qlserve serve");
    if (j->rc == QL_OK) {
        lora_registry_opts ro = {
            .budget_bytes = (size_t)c->adapter_budget_mib << 20,
            .threads = c->merge_threads,
            .dtype = c->adapter_dtype && lora_dtype_from_name(c->adapter_dtype) == LORA_DTYPE_BF16
                         ? LORA_DTYPE_BF16
                         : LORA_DTYPE_F32,
            .state_file = j->state_file[0] ? j->state_file : NULL,
            .adapter_root = c->adapter_dir};
        j->rc = lora_registry_new(&s->registry, s->engine, &s->model, &ro, j->msg, sizeof j->msg);
    }
    if (j->rc == QL_OK && j->state_file[0])
        restore_state(s, j->state_file);
    if (j->rc == QL_OK)
        srv_chat_templates_load(s); /* a refused template refuses chat, not the model */
    if (j->rc != QL_OK) {
        eng_engine_stop(s->engine);
        s->engine = NULL;
        eng_model_free(&s->model);
        if (s->draft_model.layers)
            eng_model_free(&s->draft_model);
    }
}

static void load_after(uv_work_t *req, int status)
{
    (void)status;
    load_job *j = req->data;
    srv_server *s = j->s;
    s->n_work--;
    if (j->rc != QL_OK) {
        fprintf(stderr, "qlserve serve: %s\n", j->msg);
        s->exit_code = 1;
        s->draining = true;
        srv_http_stop_accepting(s);
        check_drained(s);
    } else {
        s->serving = !s->draining;
        fprintf(stderr, "qlserve: serving %s (%s, %s, %s kernels, %s activations) on %s\n",
                s->model_id, eng_arch_name(s->model.cfg.arch), s->model.quant,
                qt_get_activations() == QL_ACTIVATIONS_Q8 ? qt_q8_path() : qt_f32_path(),
                ql_name_of(&ql_activations_names, qt_get_activations()),
                eng_engine_backend(s->engine));
        fprintf(stderr,
                "qlserve: kernel sets: f32 products %s, q8 products %s, attention, KV rows and "
                "LoRA %s\n",
                qt_f32_path(), qt_q8_path(), qt_rows_path());
        eng_engine_stats es;
        eng_engine_stats_get(s->engine, &es);
        fprintf(stderr,
                "qlserve: KV cache %d MiB in %s: %zu bytes per position, %d blocks (%lld "
                "positions)\n",
                (int)s->cfg->kv_mib, qt_kind_name(es.kv_dtype),
                eng_kv_token_bytes(&s->model.cfg, es.kv_dtype), (int)es.kv_blocks_total,
                (long long)es.kv_blocks_total * es.kv_block_tokens);
        if (es.states_total > 0)
            fprintf(stderr, "qlserve: %d recurrent states (one per running sequence)\n",
                    (int)es.states_total);
        if (s->draft_model.layers)
            fprintf(stderr, "qlserve: draft model %s (%s, %s) drafts on the CPU\n",
                    s->cfg->spec.draft_model, eng_arch_name(s->draft_model.cfg.arch),
                    s->draft_model.quant);
        const char *off = eng_linear_prefix_off(&s->model.cfg.linear);
        if (off)
            fprintf(stderr, "qlserve: prefix cache off: %s\n", off);
        check_drained(s);
    }
    free(j);
}

/* --- the wiring ------------------------------------------------------------------- */

/* What the lower files call up through (internal/http.h): each
 * names nothing above it. */
static const srv_http_hooks hooks = {
    .on_request = srv_route,
    .on_conn_end = srv_gen_conn_gone,
    .check_drained = check_drained,
};

void srv_conn_init_detached(srv_server *s, srv_conn *c)
{
    s->hooks = &hooks;
    srv_http_init_sink(s, c);
}

/* --- the entry point ----------------------------------------------------------------- */

int srv_serve(const cfg_serve *cfg)
{
    signal(SIGPIPE, SIG_IGN); /* a vanished client is a write error, not a death */
    srv_server *s = calloc(1, sizeof *s);
    if (!s)
        return 1;
    s->loop = uv_default_loop();
    s->cfg = cfg;
    s->hooks = &hooks;
    s->started_at = (double)time(NULL);
    srv_metrics_init(&s->metrics);
    srv_http_settings(&s->http_settings);
    pthread_mutex_init(&s->events_mu, NULL);
    /* compiled grammars by text: 64 distinct schemas in use at once is
     * far more than an agent deployment sends, and an entry is small */
    s->grammars = gr_cache_new(64, 0);
    s->responses = srv_resp_store_new(SRV_RESP_STORE_MAX_ENTRIES, SRV_RESP_STORE_MAX_BYTES);
    if (!s->grammars) {
        free(s);
        return 1;
    }
    /* the model's id in /v1/models: --served-model-name, or the file's or
     * folder's base name without .gguf */
    if (cfg->served_model_name) {
        snprintf(s->model_id, sizeof s->model_id, "%.159s", cfg->served_model_name);
    } else {
        mf_path_base(cfg->model.path, s->model_id, sizeof s->model_id);
        size_t n = strlen(s->model_id);
        if (n > 5 && strcmp(s->model_id + n - 5, ".gguf") == 0)
            s->model_id[n - 5] = 0;
    }
    uv_async_init(s->loop, &s->wake, srv_gen_on_wake);
    s->wake.data = s;
    uv_timer_init(s->loop, &s->grace);
    s->grace.data = s;
    uv_idle_init(s->loop, &s->resume);
    s->resume.data = s;
    uv_check_init(s->loop, &s->turn_check);
    s->turn_check.data = s;
    s->turn_cpu_s = thread_cpu_s();
    uv_check_start(&s->turn_check, on_turn);
    uv_unref((uv_handle_t *)&s->turn_check); /* it alone keeps no loop alive */
    uv_signal_init(s->loop, &s->sigterm);
    uv_signal_init(s->loop, &s->sigint);
    s->sigterm.data = s->sigint.data = s;
    uv_signal_start(&s->sigterm, on_signal, SIGTERM);
    uv_signal_start(&s->sigint, on_signal, SIGINT);
    char msg[1024];
    int port = 0;
    load_job *j = calloc(1, sizeof *j);
    if (!j || prepare_state(s, j, msg, sizeof msg) != QL_OK ||
        srv_http_listen(s, cfg->host, cfg->port, &port, msg, sizeof msg) != QL_OK) {
        fprintf(stderr, "qlserve serve: %s\n", j ? msg : "out of memory");
        free(j);
        uv_walk(s->loop, close_walk, NULL);
        uv_run(s->loop, UV_RUN_DEFAULT);
        gr_cache_free(s->grammars);
        srv_resp_store_free(s->responses);
        free(s);
        return 1;
    }
    s->port = port; /* the Host rule's port */
    fprintf(stderr, "qlserve: listening on http://%s:%d (loading %s)\n", cfg->host, port,
            cfg->model.path);
    /* the model file rewritten in place under the server (mapped_file.c) */
    if (mf_guard_start(msg, sizeof msg) != QL_OK)
        fprintf(stderr, "qlserve: warning: %s\n", msg);
    j->s = s;
    j->req.data = j;
    s->n_work++;
    uv_queue_work(s->loop, &j->req, load_run, load_after);

    uv_run(s->loop, UV_RUN_DEFAULT);

    /* every connection and generation is gone; the engine is idle */
    int code = s->exit_code;
    if (s->engine)
        eng_engine_stop(s->engine);
    lora_registry_free(s->registry);
    srv_chat_templates_free(s);
    gr_cache_free(s->grammars);
    srv_resp_store_free(s->responses);
    if (s->model.layers)
        eng_model_free(&s->model);
    if (s->draft_model.layers)
        eng_model_free(&s->draft_model);
    mf_guard_stop();
    srv_gen_on_wake(&s->wake); /* events that raced the stop: free them */
    uv_loop_close(s->loop);
    pthread_mutex_destroy(&s->events_mu);
    free(s);
    fprintf(stderr, "qlserve: stopped\n");
    return code;
}

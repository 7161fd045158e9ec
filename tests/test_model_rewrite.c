/*
 * test_model_rewrite.c - a model file rewritten in place under a running
 * server (modelfile/mapped_file.c's guard): the weights stay as
 * loaded, nothing faults, and the writer gets through.
 *
 * Another process (a child of the test) truncates the file and writes
 * other bytes into it, as `cp new model` or a training job re-saving into
 * the same folder does. Its open blocks until the guard has copied the
 * file into memory under the mapping and released the lease; the test
 * logs how long. Without the guard the same sequence kills the server
 * with SIGBUS (reads past the new end) or changes its answers (the first
 * pages now hold other bytes).
 *
 * model_file_guard: the guard on a mapping in this process (st_open);
 * model_rewrite: the real binary serving a GGUF file and a Hugging Face
 * folder, and a file whose lease is refused (it is open for writing when
 * the server loads it), which the server serves with a warning.
 */
#include <criterion/criterion.h>
#include <errno.h>
#include <fcntl.h>
#include <pthread.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <unistd.h>

#include "server_process.h"
#include "test_util.h"
#include "tiny_model.h"

static char dir[512];

static void make_dir(void)
{
    test_tmpdir(dir, sizeof dir);
    cr_assert(dir[0]);
}

/* In a child process (another process, as a writer would be): truncate
 * path by opening it O_WRONLY | O_TRUNC, then write `len` bytes of `fill`.
 * The seconds its open took. */
static double rewrite_in_place(const char *path, size_t len, uint8_t fill)
{
    int pipefd[2];
    cr_assert_eq(pipe(pipefd), 0);
    fflush(NULL);
    pid_t pid = fork();
    cr_assert_geq(pid, 0);
    if (pid == 0) {
        close(pipefd[0]);
        double t0 = ql_now_s();
        int fd = open(path, O_WRONLY | O_TRUNC);
        double blocked = ql_now_s() - t0;
        if (fd < 0)
            _exit(1);
        uint8_t *bytes = malloc(len ? len : 1);
        memset(bytes, fill, len);
        bool ok = write(fd, bytes, len) == (ssize_t)len && close(fd) == 0;
        ok = ok && write(pipefd[1], &blocked, sizeof blocked) == sizeof blocked;
        _exit(ok ? 0 : 2);
    }
    close(pipefd[1]);
    double blocked = -1;
    cr_assert_eq(read(pipefd[0], &blocked, sizeof blocked), (ssize_t)sizeof blocked,
                 "the writer failed");
    close(pipefd[0]);
    int st;
    cr_assert_eq(waitpid(pid, &st, 0), pid);
    cr_assert(WIFEXITED(st) && WEXITSTATUS(st) == 0, "the writer failed: status %d", st);
    struct stat sb;
    cr_assert_eq(stat(path, &sb), 0);
    cr_assert_eq((size_t)sb.st_size, len, "the file was not rewritten");
    return blocked;
}

/* --- the guard in this process ---------------------------------------- */

static void guard_teardown(void)
{
    mf_guard_stop();
    test_rmtree(dir);
}

TestSuite(model_file_guard, .init = make_dir, .fini = guard_teardown, .timeout = 60);

/* A thread reading the mapping while the guard swaps it: every byte it
 * reads is checked against what the file held at load. */
typedef struct reader {
    const uint8_t *data, *want;
    size_t n;
    atomic_bool *stop;
    atomic_size_t passes; /* read by the test while the thread runs */
    size_t wrong;
    pthread_t thread;
} reader;

static void *read_on(void *arg)
{
    reader *r = arg;
    while (!atomic_load(r->stop)) {
        for (size_t i = 0; i < r->n; i += 64)
            r->wrong += r->data[i] != r->want[i];
        r->passes++;
    }
    return NULL;
}

Test(model_file_guard, a_rewritten_file_keeps_the_bytes_it_was_mapped_with)
{
    char path[700], msg[512];
    snprintf(path, sizeof path, "%s/w.safetensors", dir);
    /* 4 MiB of a pattern, written through the library's own writer */
    size_t n = 4u << 20;
    uint8_t *want = malloc(n);
    for (size_t i = 0; i < n; i++)
        want[i] = (uint8_t)(i * 31 + 7);
    st_writer *w = st_writer_new();
    int64_t shape[1] = {(int64_t)n};
    cr_assert_eq(st_writer_add(w, "w", ST_U8, 1, shape, want, n, false, msg, sizeof msg), 0, "%s",
                 msg);
    cr_assert_eq(st_writer_write(w, path, msg, sizeof msg), 0, "%s", msg);
    st_writer_free(w);

    cr_assert_eq(mf_guard_start(msg, sizeof msg), 0, "%s", msg);
    st_file f;
    cr_assert_eq(st_open(&f, path, msg, sizeof msg), 0, "%s", msg);
    const st_tensor *t = st_find(&f, "w");
    cr_assert(t);
    const uint8_t *data = t->data, *map = f.map;
    cr_assert_eq(memcmp(data, want, n), 0);

    /* a quarter of the length, other bytes: the rest of the mapping lies
     * past the new end; two threads read the mapping meanwhile */
    atomic_bool stop = false;
    reader readers[2];
    for (int i = 0; i < 2; i++) {
        readers[i] = (reader){.data = data, .want = want, .n = n, .stop = &stop};
        cr_assert_eq(pthread_create(&readers[i].thread, NULL, read_on, &readers[i]), 0);
    }
    double blocked = rewrite_in_place(path, n / 4, 0xAB);
    test_sleep_ms(20);
    /* each reader finishes a pass over the mapping before they stop, however
     * long a loaded machine keeps it off a core (a fixed wait alone failed
     * under ctest -j2) */
    for (int i = 0, waited = 0; i < 2 && waited < 10000; waited += 5)
        if (atomic_load(&readers[i].passes) > 0)
            i++;
        else
            test_sleep_ms(5);
    atomic_store(&stop, true);
    for (int i = 0; i < 2; i++) {
        pthread_join(readers[i].thread, NULL);
        cr_assert_gt(readers[i].passes, 0);
        cr_assert_eq(readers[i].wrong, 0, "a reader saw %zu changed bytes", readers[i].wrong);
    }
    cr_log_info("the writer waited %.3f s for 4 MiB to be copied", blocked);
    cr_assert_eq(f.map, map);
    cr_assert_eq(memcmp(data, want, n), 0, "the mapped bytes changed");
    /* the rewritten file is what a new open sees */
    st_file again;
    cr_assert_neq(st_open(&again, path, msg, sizeof msg), 0);
    st_close(&f);
    free(want);
}

Test(model_file_guard, a_file_replaced_by_rename_keeps_its_old_inode_guarded)
{
    /* mv over the path: the mapping keeps the old inode and its bytes, and
     * the lease stays on that inode, so writing it through another name
     * (a hard link made before) is still caught */
    char path[700], next[700], old[700], msg[512];
    snprintf(path, sizeof path, "%s/m.gguf", dir);
    snprintf(next, sizeof next, "%s/m.gguf.new", dir);
    snprintf(old, sizeof old, "%s/m.gguf.old", dir);
    tiny_spec spec = tiny_default();
    tiny_write_gguf(path, &spec, QT_Q8_0);
    cr_assert_eq(mf_guard_start(msg, sizeof msg), 0, "%s", msg);
    gguf_file f;
    cr_assert_eq(gguf_open(&f, path, msg, sizeof msg), 0, "%s", msg);
    uint8_t *before = malloc(f.map_len);
    memcpy(before, f.map, f.map_len);
    cr_assert_eq(link(path, old), 0);
    int fd = open(next, O_WRONLY | O_CREAT | O_TRUNC, 0600);
    cr_assert_geq(fd, 0);
    cr_assert_eq(write(fd, "GGUF", 4), 4);
    close(fd);
    cr_assert_eq(rename(next, path), 0);
    cr_assert_eq(memcmp(before, f.map, f.map_len), 0);
    /* a non-blocking open for writing of a leased file fails rather than
     * wait for the lease to go */
    errno = 0;
    fd = open(old, O_WRONLY | O_NONBLOCK);
    cr_assert_lt(fd, 0, "the old inode is no longer leased");
    cr_assert_eq(errno, EWOULDBLOCK);
    cr_assert_eq(memcmp(before, f.map, f.map_len), 0);
    free(before);
    gguf_close(&f);
}

/* --- the server --------------------------------------------------------- */

static char log_path[600];

static void server_teardown(void)
{
    if (sp.pid > 0)
        sp_stop_cleanly();
    test_rmtree(dir);
}

TestSuite(model_rewrite, .init = make_dir, .fini = server_teardown, .timeout = 120);

static void start(const char *model)
{
    snprintf(log_path, sizeof log_path, "%s/server.log", dir);
    const char *argv[] = {QL_BINARY,   "serve", "--model",  model, "--port", "0",
                          "--threads", "2",     "--kv-mib", "16",  NULL};
    sp_spawn(argv, log_path);
    sp_wait_ready();
}

/* The request both answers are asked for: greedy, a few dozen tokens. */
#define GREEDY_BODY                                                                                \
    "{\"inputs\": \"the cat sat on\", \"parameters\": {\"max_new_tokens\": 96, \"do_sample\": "    \
    "false}}"

/* The greedy answer's text (malloc'd). */
static char *greedy(void)
{
    int status;
    char *text = sp_answer("/generate", GREEDY_BODY, &status);
    cr_assert_eq(status, 200, "%s", text);
    cJSON *j = sp_json(text);
    char *answer = strdup(sp_str_at(j, "generated_text"));
    cJSON_Delete(j);
    free(text);
    return answer;
}

static bool log_holds(const char *needle)
{
    char *log = sp_read_log();
    bool found = strstr(log, needle) != NULL;
    free(log);
    return found;
}

/* Serve `model`, answer, rewrite `file` in place with half its length of
 * other bytes while a stream of the same request is held running, answer
 * again: the stream and the new answer the same as the first, the server
 * alive, its log naming the file. */
static void rewrite_under_the_server(const char *model, const char *file)
{
    start(model);
    char *first = greedy();
    /* the same request streamed, held at the engine's gate with its first
     * token out while the file is rewritten, and the rest after */
    sp_hold_after(0, NULL);
    double before = sp_engine_figure("tokens_generated", NULL);
    hc_conn c;
    hc_response r = {0};
    cr_assert(hc_open(&c, sp.port));
    cr_assert(hc_send_request(&c, "POST", "/generate_stream", NULL, GREEDY_BODY));
    sp_engine_reaches("running", 1, NULL);
    sp_step_until_generated(before + 1, NULL);
    cr_assert(hc_read_head(&c, &r));
    cr_assert_eq(r.status, 200);
    char *last = hc_next_event(&c, &r);
    cr_assert(last, "no first token");
    struct stat sb;
    cr_assert_eq(stat(file, &sb), 0);
    double blocked = rewrite_in_place(file, (size_t)sb.st_size / 2, 0x5A);
    cr_log_info("%s: the writer waited %.3f s", file, blocked);
    cr_assert_eq(sp_engine_figure("running", NULL), 1, "the stream ended before the rewrite");
    sp_hold_after(-1, NULL);
    for (char *ev; (ev = hc_next_event(&c, &r));) {
        free(last);
        last = ev;
    }
    cr_assert(r.body_done, "the stream did not end");
    cJSON *end = sp_json(last);
    cr_assert_str_eq(sp_str_at(end, "generated_text"), first,
                     "the stream running during the rewrite changed its answer");
    cJSON_Delete(end);
    free(last);
    hc_response_free(&r);
    hc_close(&c);
    char *second = greedy();
    cr_assert_str_eq(second, first, "the answer changed after the file was rewritten");
    cr_assert(hc_request(sp.port, "GET", "/health", NULL, NULL, &r));
    cr_assert_eq(r.status, 200);
    hc_response_free(&r);
    char needle[800];
    snprintf(needle, sizeof needle, "model file %s is being rewritten; the server keeps", file);
    cr_assert(log_holds(needle), "%s", sp_read_log());
    free(first);
    free(second);
}

Test(model_rewrite, a_gguf_rewritten_in_place_keeps_serving_the_loaded_weights)
{
    char path[700];
    snprintf(path, sizeof path, "%s/tiny.gguf", dir);
    tiny_spec spec = tiny_default();
    tiny_write_gguf(path, &spec, QT_Q4_0);
    rewrite_under_the_server(path, path);
}

Test(model_rewrite, a_safetensors_rewritten_in_place_keeps_serving_the_loaded_weights)
{
    char model[700], file[800];
    snprintf(model, sizeof model, "%s/tiny", dir);
    cr_assert_eq(mkdir(model, 0700), 0);
    tiny_spec spec = tiny_default();
    tiny_write_hf(model, &spec);
    snprintf(file, sizeof file, "%s/model.safetensors", model);
    rewrite_under_the_server(model, file);
}

Test(model_rewrite, a_file_without_a_lease_is_served_with_a_warning)
{
    /* a file open for writing elsewhere cannot be leased (EAGAIN) */
    char path[700];
    snprintf(path, sizeof path, "%s/tiny.gguf", dir);
    tiny_spec spec = tiny_default();
    tiny_write_gguf(path, &spec, QT_Q4_0);
    int fd = open(path, O_RDWR);
    cr_assert_geq(fd, 0);
    start(path);
    close(fd);
    char needle[800];
    snprintf(needle, sizeof needle, "warning: model file %s: no read lease (", path);
    cr_assert(log_holds(needle), "%s", sp_read_log());
    cr_assert(log_holds("errno 11: the file is open for writing"), "%s", sp_read_log());
    cr_assert(log_holds("replace the file by rename"), "%s", sp_read_log());
    char *answer = greedy();
    cr_assert_gt(strlen(answer), 0);
    free(answer);
}

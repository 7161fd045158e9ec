/*
 * test_server_tgi.c - TGI's compat route (POST /) and POST /tokenize, end
 * to end: the real binary (QL_BINARY) on a tiny random model, spoken to
 * over TCP with tests/http_client.h, started and stopped as test_server.c
 * does (--port 0, the environment's QLSERVE_* removed, SIGTERM at the end
 * with exit status 0 and no sanitizer report).
 *
 * Covered: POST / answers a list of one /generate answer, defaults
 * return_full_text to true as TGI does, and streams exactly
 * /generate_stream's events for the same seed; its errors are /generate's;
 * GET / is /health. /tokenize answers TGI's [{"id", "text", "start",
 * "stop"}] equal to tokenizers' own ids and byte offsets
 * (fixtures/tokenize_offsets.h, made by make_tokenize_offsets.py) under
 * byte-level and SentencePiece-style tokenizers, with multi-byte UTF-8
 * split over tokens and special tokens in the text; add_special_tokens
 * false drops the BOS; its errors are /generate's.
 */
#include <criterion/criterion.h>
#include <fcntl.h>
#include <signal.h>
#include <stdlib.h>
#include <string.h>
#include <sys/prctl.h>
#include <sys/stat.h>
#include <sys/wait.h>

#include "fixtures/tokenize_offsets.h"
#include "http_client.h"
#include "server_process.h"
#include "test_util.h"
#include "tiny_model.h"

static char dir[512];
static char model_dir[600];
static char log_path[600];

static void setup(void)
{
    test_tmpdir(dir, sizeof dir);
    cr_assert(dir[0]);
    snprintf(model_dir, sizeof model_dir, "%s/tiny-llama", dir);
    snprintf(log_path, sizeof log_path, "%s/server.log", dir);
    cr_assert_eq(mkdir(model_dir, 0700), 0);
}

static void teardown(void)
{
    sp_kill();
    test_rmtree(dir);
}

TestSuite(tgi, .init = setup, .fini = teardown, .timeout = 300);

/* --- the server process (as test_server.c runs it) ------------------------------- */

/* Start the binary on a tiny model; tokenizer names a fixture tokenizer
 * (tests/fixtures/tokenizers/<name>/) to serve with, NULL: the tiny
 * model's own byte-level one. Returns once GET /health says 200. */
static void start_server(const char *tokenizer)
{
    tiny_spec spec = tiny_default();
    spec.vocab = 1024; /* room for every fixture tokenizer's ids */
    tiny_write_hf(model_dir, &spec);
    if (tokenizer) {
        const char *files[] = {"tokenizer.json", "tokenizer_config.json"};
        for (size_t i = 0; i < 2; i++) {
            char from[1024], to[1024];
            snprintf(from, sizeof from, "%s/tokenizers/%s/%s", QL_FIXTURES, tokenizer, files[i]);
            snprintf(to, sizeof to, "%s/%s", model_dir, files[i]);
            copy_file(from, to);
        }
    }
    const char *argv[] = {QL_BINARY,   "serve", "--model",  model_dir, "--port", "0",
                          "--threads", "2",     "--kv-mib", "16",      NULL};
    sp_spawn(argv, log_path);
    sp_wait_ready();
}

/* --- requests --------------------------------------------------------------------- */

/* The same request to two routes gets the same answer: status and body. */
static void same_answer(const char *path_a, const char *path_b, const char *body)
{
    int sa, sb;
    char *a = sp_answer(path_a, body, &sa), *b = sp_answer(path_b, body, &sb);
    cr_assert_eq(sa, sb, "%s: %d %s; %s: %d %s", path_a, sa, a, path_b, sb, b);
    cr_assert_str_eq(a, b, "%s vs %s for %s", path_a, path_b, body);
    free(a);
    free(b);
}

/* --- POST / ------------------------------------------------------------------------ */

Test(tgi, compat_answers_a_list_of_one_generate_answer)
{
    start_server(NULL);
    const char *body = "{\"inputs\": \"Hello there\", \"parameters\": {\"max_new_tokens\": 8, "
                       "\"details\": true, \"return_full_text\": false}}";
    int status;
    char *whole = sp_answer("/generate", body, &status);
    cr_assert_eq(status, 200, "%s", whole);
    char *compat = sp_answer("/", body, &status);
    cr_assert_eq(status, 200, "%s", compat);
    cJSON *list = cJSON_Parse(compat), *one = cJSON_Parse(whole);
    cr_assert(cJSON_IsArray(list) && cJSON_GetArraySize(list) == 1, "%s", compat);
    cr_assert(cJSON_Compare(cJSON_GetArrayItem(list, 0), one, true), "%s vs %s", compat, whole);
    /* the generation itself is there: eight tokens in details */
    const cJSON *d = cJSON_GetObjectItemCaseSensitive(cJSON_GetArrayItem(list, 0), "details");
    cr_assert_eq(sp_num_at(d, "generated_tokens"), 8);
    cr_assert_str_eq(sp_str_at(d, "finish_reason"), "length");
    cJSON_Delete(list);
    cJSON_Delete(one);
    free(whole);
    free(compat);
    sp_stop_cleanly();
}

Test(tgi, compat_returns_the_full_text_unless_told_not_to)
{
    /* TGI's compat_generate: return_full_text defaults to true for a model
     * whose pipeline tag is text-generation or unknown; /generate's is
     * false */
    start_server(NULL);
    int status;
    char *gen =
        sp_answer("/generate",
                  "{\"inputs\": \"Once upon\", \"parameters\": {\"max_new_tokens\": 6}}", &status);
    cr_assert_eq(status, 200, "%s", gen);
    char *compat = sp_answer(
        "/", "{\"inputs\": \"Once upon\", \"parameters\": {\"max_new_tokens\": 6}}", &status);
    cr_assert_eq(status, 200, "%s", compat);
    cJSON *g = cJSON_Parse(gen), *c = cJSON_Parse(compat);
    char want[1024];
    snprintf(want, sizeof want, "Once upon%s", sp_str_at(g, "generated_text"));
    cr_assert_str_eq(sp_str_at(cJSON_GetArrayItem(c, 0), "generated_text"), want);
    cJSON_Delete(c);
    free(compat);
    /* without parameters at all, too */
    compat = sp_answer("/", "{\"inputs\": \"Once upon\", \"stream\": false}", &status);
    cr_assert_eq(status, 200, "%s", compat);
    c = cJSON_Parse(compat);
    cr_assert_eq(strncmp(sp_str_at(cJSON_GetArrayItem(c, 0), "generated_text"), "Once upon", 9), 0,
                 "%s", compat);
    cJSON_Delete(c);
    cJSON_Delete(g);
    free(gen);
    free(compat);
    sp_stop_cleanly();
}

Test(tgi, compat_stream_is_generate_streams_events_for_the_same_seed)
{
    start_server(NULL);
    const char *bodies[] = {
        /* sampled: the seed makes the tokens */
        "{\"inputs\": \"The sea\", \"stream\": true, \"parameters\": {\"max_new_tokens\": 12, "
        "\"do_sample\": true, \"temperature\": 0.9, \"top_p\": 0.95, \"seed\": 42, "
        "\"return_full_text\": false}}",
        /* greedy, return_full_text defaulted on / and given on /generate_stream */
        "{\"inputs\": \"The sea\", \"stream\": true, \"parameters\": {\"max_new_tokens\": 5, "
        "\"return_full_text\": true, \"stop\": [\"zz\"]}}",
    };
    for (size_t b = 0; b < 2; b++) {
        char *a[64], *s[64];
        int na = sp_stream_events("/", bodies[b], a, 64);
        int ns = sp_stream_events("/generate_stream", bodies[b], s, 64);
        cr_assert_eq(na, ns, "%d events vs %d", na, ns);
        cr_assert_gt(na, 1);
        for (int i = 0; i < na; i++) {
            cr_assert_str_eq(a[i], s[i], "event %d", i);
            free(a[i]);
            free(s[i]);
        }
    }
    /* and the seed matters: another seed, other tokens */
    char *x[64], *y[64];
    int nx = sp_stream_events("/", bodies[0], x, 64);
    char other[512];
    snprintf(other, sizeof other, "%s", bodies[0]);
    memcpy(strstr(other, "\"seed\": 42"), "\"seed\": 43", 10);
    int ny = sp_stream_events("/", other, y, 64);
    cr_assert_eq(nx, ny); /* max_new_tokens either way */
    bool differ = false;
    for (int i = 0; i < nx; i++) {
        differ |= strcmp(x[i], y[i]) != 0;
        free(x[i]);
        free(y[i]);
    }
    cr_assert(differ, "seeds 42 and 43 streamed the same events");
    sp_stop_cleanly();
}

Test(tgi, compat_errors_are_generates)
{
    start_server(NULL);
    const char *bad[] = {
        "{\"inputs\": ",                                                /* not JSON */
        "[1, 2]",                                                       /* not an object */
        "{\"parameters\": {\"max_new_tokens\": 4}}",                    /* no inputs */
        "{\"inputs\": 7}",                                              /* inputs not a string */
        "{\"inputs\": \"x\", \"bogus\": 1}",                            /* an unknown field */
        "{\"inputs\": \"x\", \"parameters\": {\"watermark\": true}}",   /* not implemented */
        "{\"inputs\": \"x\", \"parameters\": {\"max_new_tokens\": 0}}", /* out of range */
    };
    for (size_t i = 0; i < sizeof bad / sizeof *bad; i++) {
        int status;
        char *a = sp_answer("/", bad[i], &status);
        cr_assert_eq(status, 400, "%s: %d %s", bad[i], status, a);
        free(a);
        same_answer("/", "/generate", bad[i]);
    }
    /* "stream" must be a boolean, named as /generate names it */
    same_answer("/", "/generate", "{\"inputs\": \"x\", \"stream\": \"yes\"}");
    int status;
    char *a = sp_answer("/", "{\"inputs\": \"x\", \"stream\": \"yes\"}", &status);
    cr_assert_eq(status, 400);
    cr_assert(strstr(a, "stream"), "%s", a);
    free(a);
    /* GET / is TGI's health route; other methods are 405 */
    hc_response r;
    cr_assert(hc_request(sp.port, "GET", "/", NULL, NULL, &r));
    cr_assert_eq(r.status, 200, "%s", r.body);
    cr_assert(strstr(r.body, "\"ok\""), "%s", r.body);
    hc_response_free(&r);
    cr_assert(hc_request(sp.port, "DELETE", "/", NULL, NULL, &r));
    cr_assert_eq(r.status, 405, "%s", r.body);
    hc_response_free(&r);
    sp_stop_cleanly();
}

/* --- POST /tokenize ----------------------------------------------------------------- */

/* The body {"inputs": text} (JSON-escaped), with more members (NULL: none). */
static char *tokenize_body(const char *text, const char *more)
{
    cJSON *o = cJSON_CreateObject();
    cJSON_AddStringToObject(o, "inputs", text);
    char *s = cJSON_PrintUnformatted(o);
    cJSON_Delete(o);
    if (more) {
        char *t = malloc(strlen(s) + strlen(more) + 4);
        sprintf(t, "%.*s, %s}", (int)strlen(s) - 1, s, more);
        free(s);
        s = t;
    }
    return s;
}

/* /tokenize's answer for one fixture case equals tokenizers' own. */
static void check_case(const tokoff_case *tc)
{
    char *body = tokenize_body(tc->text, NULL);
    hc_response r = sp_post("/tokenize", body);
    cr_assert_eq(r.status, 200, "%s: %s", body, r.body);
    cJSON *list = sp_json(r.body);
    cr_assert(cJSON_IsArray(list), "%s", r.body);
    cr_assert_eq((size_t)cJSON_GetArraySize(list), tc->n_tokens, "%s %s: %s", tc->tokenizer, body,
                 r.body);
    for (size_t i = 0; i < tc->n_tokens; i++) {
        const cJSON *t = cJSON_GetArrayItem(list, (int)i);
        const tokoff_token *want = &tc->tokens[i];
        cr_assert_eq(sp_num_at(t, "id"), want->id, "%s %s token %zu: %s", tc->tokenizer, body, i,
                     r.body);
        cr_assert_eq(sp_num_at(t, "start"), want->start, "%s %s token %zu: %s", tc->tokenizer, body,
                     i, r.body);
        cr_assert_eq(sp_num_at(t, "stop"), want->stop, "%s %s token %zu: %s", tc->tokenizer, body,
                     i, r.body);
        /* the text is the input's bytes start..stop */
        char piece[256];
        snprintf(piece, sizeof piece, "%.*s", (int)(want->stop - want->start),
                 tc->text + want->start);
        cr_assert_str_eq(sp_str_at(t, "text"), piece, "%s %s token %zu", tc->tokenizer, body, i);
        cr_assert_eq(cJSON_GetArraySize(t), 4, "only id, text, start, stop: %s", r.body);
    }
    cJSON_Delete(list);
    hc_response_free(&r);
    free(body);
}

static void check_tokenizer(const char *name)
{
    start_server(name);
    size_t n = 0;
    for (size_t i = 0; i < sizeof tokoff_cases / sizeof *tokoff_cases; i++)
        if (strcmp(tokoff_cases[i].tokenizer, name) == 0) {
            check_case(&tokoff_cases[i]);
            n++;
        }
    cr_assert_geq(n, 8);
    sp_stop_cleanly();
}

Test(tgi, tokenize_is_tokenizers_ids_and_byte_offsets_byte_level_gpt2)
{
    check_tokenizer("gpt2");
}

Test(tgi, tokenize_is_tokenizers_ids_and_byte_offsets_byte_level_llama3)
{
    check_tokenizer("llama3");
}

Test(tgi, tokenize_is_tokenizers_ids_and_byte_offsets_sentencepiece_llama2)
{
    check_tokenizer("spm");
}

Test(tgi, tokenize_is_tokenizers_ids_and_byte_offsets_sentencepiece_metaspace)
{
    check_tokenizer("spm_metaspace");
}

Test(tgi, tokenize_without_special_tokens_drops_the_bos)
{
    start_server("spm");
    char *with = tokenize_body("Hello world", NULL);
    char *without = tokenize_body("Hello world", "\"add_special_tokens\": false");
    int status;
    char *a = sp_answer("/tokenize", with, &status);
    cr_assert_eq(status, 200, "%s", a);
    char *b = sp_answer("/tokenize", without, &status);
    cr_assert_eq(status, 200, "%s", b);
    cJSON *ja = cJSON_Parse(a), *jb = cJSON_Parse(b);
    cr_assert_eq(cJSON_GetArraySize(ja), 3, "%s", a);
    cr_assert_eq(sp_num_at(cJSON_GetArrayItem(ja, 0), "id"), 1, "<s> first: %s", a);
    cr_assert_eq(cJSON_GetArraySize(jb), 2, "%s", b);
    /* the rest is the same tokens at the same places */
    cJSON_DeleteItemFromArray(ja, 0);
    cr_assert(cJSON_Compare(ja, jb, true), "%s vs %s", a, b);
    cJSON_Delete(ja);
    cJSON_Delete(jb);
    free(a);
    free(b);
    free(with);
    free(without);
    sp_stop_cleanly();
}

Test(tgi, tokenize_errors_are_generates)
{
    start_server(NULL);
    const char *bad[] = {
        "{\"inputs\": ",                                          /* not JSON */
        "{\"parameters\": {}}",                                   /* no inputs */
        "{\"inputs\": [1]}",                                      /* not a string */
        "{\"inputs\": \"x\", \"bogus\": 1}",                      /* unknown */
        "{\"inputs\": \"x\", \"parameters\": {\"grammar\": {}}}", /* no grammar type */
        "{\"inputs\": \"x\", \"parameters\": \"no\"}",            /* not an object */
    };
    for (size_t i = 0; i < sizeof bad / sizeof *bad; i++)
        same_answer("/tokenize", "/generate", bad[i]);
    int status;
    char *a = sp_answer("/tokenize", "{\"inputs\": \"x\", \"add_special_tokens\": 1}", &status);
    cr_assert_eq(status, 400, "%s", a);
    cr_assert(strstr(a, "add_special_tokens"), "%s", a);
    free(a);
    /* a body /generate takes is one /tokenize takes */
    a = sp_answer(
        "/tokenize",
        "{\"inputs\": \"ab\", \"parameters\": {\"max_new_tokens\": 3, \"details\": true}}",
        &status);
    cr_assert_eq(status, 200, "%s", a);
    free(a);
    /* the method */
    hc_response r;
    cr_assert(hc_request(sp.port, "GET", "/tokenize", NULL, NULL, &r));
    cr_assert_eq(r.status, 405, "%s", r.body);
    hc_response_free(&r);
    sp_stop_cleanly();
}

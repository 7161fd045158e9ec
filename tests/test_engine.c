/*
 * test_engine.c - the engine end to end on a tiny model: requests batched
 * together give exactly what each gives alone (greedy, and sampled with a
 * seed), cancellation frees the KV cache, a full cache makes requests wait
 * instead of corrupting running ones, stop strings are never emitted, and
 * bad requests are refused with the reason. On the default SmolLM2 model
 * (when present) greedy decoding completes "The capital of France is" with
 * Paris.
 */
#include <criterion/criterion.h>
#include <math.h>
#include <pthread.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

#include "model.h"
#include "runtime.h"
#include "scheduler.h"
#include "test_util.h"
#include "tiny_model.h"
#include "tokenizer.h"

static char dir[512];
static eng_model model;

static void setup(void)
{
    tiny_load_default(dir, sizeof dir, &model);
}

static void teardown(void)
{
    tiny_unload_default(dir, &model);
}

TestSuite(engine, .init = setup, .fini = teardown, .timeout = 60);

/* What one request produced. */
typedef struct result {
    pthread_mutex_t mu;
    pthread_cond_t cv;
    bool done;
    eng_finish why;
    eng_usage usage;
    char text[4096];
    size_t len;
    int32_t tokens[512];
    int n_tokens;
} result;

static void on_token(void *user, const eng_token_event *ev)
{
    int32_t token = ev->token;
    const char *text = ev->text;
    size_t len = ev->len;
    result *r = user;
    if (r->len + len < sizeof r->text) {
        memcpy(r->text + r->len, text, len);
        r->len += len;
    }
    if (token >= 0 && r->n_tokens < 512)
        r->tokens[r->n_tokens++] = token;
}

static void on_done(void *user, eng_finish why, const eng_usage *u)
{
    result *r = user;
    pthread_mutex_lock(&r->mu);
    r->done = true;
    r->why = why;
    r->usage = *u;
    pthread_cond_signal(&r->cv);
    pthread_mutex_unlock(&r->mu);
}

static void result_init(result *r)
{
    memset(r, 0, sizeof *r);
    pthread_mutex_init(&r->mu, NULL);
    pthread_cond_init(&r->cv, NULL);
}

static void wait_done(result *r)
{
    pthread_mutex_lock(&r->mu);
    while (!r->done)
        pthread_cond_wait(&r->cv, &r->mu);
    pthread_mutex_unlock(&r->mu);
}

static eng_request request(const char *prompt, int max_new, result *r)
{
    return (eng_request){.prompt = prompt,
                         .prompt_len = strlen(prompt),
                         .max_new_tokens = max_new,
                         .on_token = on_token,
                         .on_done = on_done,
                         .user = r};
}

static eng_engine *start(size_t kv_bytes, int max_running)
{
    eng_engine_opts o = {.threads = 2,
                         .kv_bytes = kv_bytes,
                         .max_running = max_running,
                         .prefill_chunk = 4,
                         .step_tokens = 16};
    eng_engine *e;
    char msg[512];
    cr_assert_eq(eng_engine_start(&e, &model, &o, msg, sizeof msg), 0, "%s", msg);
    return e;
}

static void submit_ok(eng_engine *e, const eng_request *r, uint64_t *id)
{
    char msg[512];
    int rc = eng_engine_submit(e, r, id, msg, sizeof msg);
    cr_assert_eq(rc, 0, "submit: %s", msg);
}

/* Run prompt alone for n tokens into r, to its end. */
static void run_alone(eng_engine *e, const char *prompt, int32_t n, result *r)
{
    result_init(r);
    eng_request q = request(prompt, n, r);
    submit_ok(e, &q, NULL);
    wait_done(r);
}

static const char *prompts[] = {"the theme of the thesis", "hello", "a b c d e f g h i j k l",
                                "the"};
#define N_PROMPTS 4

/* A CPU engine merges on the host: it has nothing to prepare, and says so. */
Test(engine, a_cpu_engine_does_not_merge_on_a_device)
{
    eng_engine *e = start((size_t)1 << 20, 2);
    char msg[512] = "";
    eng_weights *w = eng_engine_weights(e);
    cr_assert_not(eng_engine_merges_on_device(e));
    cr_assert_eq(eng_engine_prepare(e, w, NULL, NULL, msg, sizeof msg), QL_EINVAL);
    cr_assert(strstr(msg, "cpu backend merges on the host"), "%s", msg);
    cr_assert(strstr(eng_engine_backend(e), "cpu (2 threads)"), "%s", eng_engine_backend(e));
    eng_weights_unref(w);
    eng_engine_stop(e);
}

Test(engine, batched_requests_match_each_alone)
{
    result alone[N_PROMPTS], together[N_PROMPTS];
    eng_engine *e = start(8 << 20, 8);
    for (int i = 0; i < N_PROMPTS; i++) {
        result_init(&alone[i]);
        eng_request r = request(prompts[i], 20, &alone[i]);
        submit_ok(e, &r, NULL);
        wait_done(&alone[i]);
    }
    /* all at once: prompts prefilled in chunks beside running decodes */
    engine_hold_after(e, 0); /* all four are in before the first step: one batch */
    for (int i = 0; i < N_PROMPTS; i++) {
        result_init(&together[i]);
        eng_request r = request(prompts[i], 20, &together[i]);
        submit_ok(e, &r, NULL);
    }
    engine_hold_after(e, 0);
    eng_engine_stats held;
    eng_engine_stats_get(e, &held);
    cr_assert_eq(held.running, N_PROMPTS, "all four run together");
    eng_engine_gate(e, -1);
    for (int i = 0; i < N_PROMPTS; i++) {
        wait_done(&together[i]);
        cr_assert_eq(together[i].n_tokens, alone[i].n_tokens, "prompt %d", i);
        cr_assert_eq(memcmp(together[i].tokens, alone[i].tokens,
                            (size_t)alone[i].n_tokens * sizeof(int32_t)),
                     0, "prompt %d: batched tokens differ", i);
        cr_assert_eq(together[i].why, alone[i].why);
    }
    eng_engine_stats st;
    eng_engine_stats_get(e, &st);
    cr_assert_eq(st.kv_blocks_used, 0, "finished sequences gave their blocks back");
    eng_engine_stop(e);
}

Test(engine, a_seed_gives_the_same_tokens_whatever_the_batch)
{
    eng_engine *e = start(8 << 20, 8);
    result a, b, c;
    eng_sampling s = {.temperature = 0.9f, .top_k = 50, .top_p = 0.95f, .seed = 1234};
    result_init(&a);
    eng_request ra = request("the theme", 24, &a);
    ra.sampling = s;
    submit_ok(e, &ra, NULL);
    wait_done(&a);
    /* the same request beside another sampled one */
    result_init(&b);
    result_init(&c);
    eng_request rb = request("the theme", 24, &b), rc_ = request("hello there", 24, &c);
    rb.sampling = s;
    rc_.sampling = s;
    rc_.sampling.seed = 99;
    engine_hold_after(e, 0); /* both are in before the first step: one batch */
    submit_ok(e, &rc_, NULL);
    submit_ok(e, &rb, NULL);
    engine_hold_after(e, 0);
    eng_engine_stats held;
    eng_engine_stats_get(e, &held);
    cr_assert_eq(held.running, 2);
    eng_engine_gate(e, -1);
    wait_done(&b);
    wait_done(&c);
    cr_assert_eq(a.n_tokens, b.n_tokens);
    cr_assert_eq(memcmp(a.tokens, b.tokens, (size_t)a.n_tokens * 4), 0, "seeded tokens differ");
    eng_engine_stop(e);
}

Test(engine, a_full_cache_makes_requests_wait_not_fail)
{
    /* room for about one request at a time */
    eng_kv_cache *probe;
    char msg[256];
    cr_assert_eq(eng_kv_new(&probe, &model.cfg, 1 << 20, 16, msg, sizeof msg), 0);
    size_t block = (size_t)(1 << 20) / (size_t)eng_kv_total_blocks(probe);
    eng_kv_free(probe);
    result alone[3], r[3];
    eng_engine *roomy = start(8 << 20, 8);
    for (int i = 0; i < 3; i++) {
        result_init(&alone[i]);
        eng_request q = request(prompts[i], 20, &alone[i]);
        submit_ok(roomy, &q, NULL);
        wait_done(&alone[i]);
    }
    eng_engine_stop(roomy);
    eng_engine *e = start(block * 3, 8); /* 3 blocks of 16 positions */
    engine_hold_after(e, 0);
    for (int i = 0; i < 3; i++) {
        result_init(&r[i]);
        eng_request q = request(prompts[i], 20, &r[i]);
        submit_ok(e, &q, NULL);
    }
    engine_hold_after(e, 0);
    eng_engine_stats held;
    eng_engine_stats_get(e, &held);
    cr_assert_eq(held.running, 1, "the cache holds one request at a time");
    cr_assert_eq(held.waiting, 2, "the others wait for its blocks");
    eng_engine_gate(e, -1);
    for (int i = 0; i < 3; i++) { /* and, once run, each is what it is alone */
        wait_done(&r[i]);
        cr_assert_eq(r[i].why, ENG_FINISH_LENGTH, "request %d", i);
        cr_assert_eq(r[i].n_tokens, 20);
        cr_assert_eq(memcmp(r[i].tokens, alone[i].tokens, 20 * sizeof(int32_t)), 0,
                     "request %d: its tokens differ from its own alone", i);
    }
    /* more than the whole cache: refused at once, with the reason */
    result big;
    result_init(&big);
    eng_request q = request("hello", 200, &big);
    cr_assert_eq(eng_engine_submit(e, &q, NULL, msg, sizeof msg), QL_EINVAL);
    cr_assert(strstr(msg, "KV blocks"), "%s", msg);
    eng_engine_stop(e);
}

Test(engine, cancel_ends_a_request_and_frees_its_blocks)
{
    eng_engine *e = start(8 << 20, 8);
    result r;
    result_init(&r);
    eng_request q = request("the theme of the thesis", 4000, &r);
    uint64_t id;
    engine_hold_after(e, 0);
    submit_ok(e, &q, &id);
    engine_step_until_generated(e, 3); /* it has begun, and is held there */
    eng_engine_stats st;
    eng_engine_stats_get(e, &st);
    cr_assert_gt(st.kv_blocks_used, 0);
    eng_engine_cancel(e, id);
    wait_done(&r);
    cr_assert_eq(r.why, ENG_FINISH_CANCELLED);
    cr_assert_eq(r.n_tokens, 3, "no step ran after the hold");
    engine_hold_after(e, 0);
    eng_engine_stats_get(e, &st);
    cr_assert_eq(st.kv_blocks_used, 0);
    cr_assert_eq(st.running, 0);
    eng_engine_stop(e);
}

/* The step gate: held, the engine takes a request in and admits it but
 * runs no step; given N steps it runs exactly N; opened, it runs to the
 * end, and the answer is the one an ungated engine gives. */
Test(engine, the_gate_holds_the_engine_between_steps_and_lets_n_through)
{
    eng_engine *e = start(8 << 20, 8);
    result free_run, gated;
    run_alone(e, "the theme of the thesis", 12, &free_run);
    /* on_done comes within the last step: its count is published after */
    cr_assert(eng_engine_settle(e, 60), "an idle engine settles");
    eng_engine_stats st;
    eng_engine_stats_get(e, &st);
    uint64_t steps0 = st.steps;
    cr_assert_eq(st.gate_steps, -1, "the gate starts open");
    engine_hold_after(e, 0);
    result_init(&gated);
    eng_request q = request("the theme of the thesis", 12, &gated);
    submit_ok(e, &q, NULL);
    engine_hold_after(e, 0);
    eng_engine_stats_get(e, &st);
    cr_assert(st.settled);
    cr_assert_eq(st.gate_steps, 0);
    cr_assert_eq(st.running, 1, "admitted while held");
    cr_assert_eq(st.steps, steps0, "no step ran while held");
    engine_hold_after(e, 3);
    eng_engine_stats_get(e, &st);
    cr_assert_eq(st.steps, steps0 + 3, "exactly the steps let through");
    cr_assert_eq(st.gate_steps, 0);
    cr_assert_not(gated.done);
    eng_engine_gate(e, -1);
    wait_done(&gated);
    cr_assert_eq(gated.n_tokens, free_run.n_tokens);
    cr_assert_eq(memcmp(gated.tokens, free_run.tokens, (size_t)gated.n_tokens * sizeof(int32_t)), 0,
                 "a held request's answer is the one it gets unheld");
    cr_assert(eng_engine_settle(e, 60), "an idle engine settles");
    eng_engine_stop(e);
}

Test(engine, stop_strings_are_not_emitted)
{
    eng_engine *e = start(8 << 20, 8);
    result plain, stopped;
    run_alone(e, "the theme", 30, &plain);
    cr_assert(plain.len > 6, "need some text to cut: '%.*s'", (int)plain.len, plain.text);
    /* stop at a string that spans what several tokens produced */
    char stop[8];
    memcpy(stop, plain.text + 2, 4);
    stop[4] = 0;
    const char *stops[1] = {stop};
    result_init(&stopped);
    eng_request q = request("the theme", 30, &stopped);
    q.stop = stops;
    q.n_stop = 1;
    submit_ok(e, &q, NULL);
    wait_done(&stopped);
    cr_assert_eq(stopped.why, ENG_FINISH_STOP);
    const char *at = strstr(plain.text, stop);
    cr_assert_eq(stopped.len, (size_t)(at - plain.text), "emitted '%.*s'", (int)stopped.len,
                 stopped.text);
    cr_assert_eq(memcmp(stopped.text, plain.text, stopped.len), 0);
    eng_engine_stop(e);
}

/* What eng_engine_build makes on a thread of its own (a server's pool). */
typedef struct build_job {
    eng_engine *e;
    eng_request r;
    eng_built *built;
    int rc;
    char msg[256];
} build_job;

static void *build_on_a_thread(void *arg)
{
    build_job *j = arg;
    j->rc = eng_engine_build(j->e, &j->r, &j->built, j->msg, sizeof j->msg);
    return NULL;
}

/* Submit in two halves: a request built on another thread (its samplers
 * and its choices' shared stop strings) and queued later runs as one
 * submitted whole; one built and never queued is only freed; build
 * refuses what submit refuses, with the reason. */
Test(engine, a_request_built_elsewhere_runs_as_submitted)
{
    eng_engine *e = start(8 << 20, 8);
    const char *stops[2] = {"zzz", "qq"};
    result plain, halves;
    result_init(&plain);
    eng_request q = request("the theme", 20, &plain);
    q.stop = stops;
    q.n_stop = 2;
    q.n_choices = 3;
    submit_ok(e, &q, NULL);
    wait_done(&plain);
    result_init(&halves);
    build_job jobs[2] = {{.e = e, .r = q}, {.e = e, .r = q}};
    jobs[0].r.user = &halves;
    for (int i = 0; i < 2; i++) {
        pthread_t t;
        cr_assert_eq(pthread_create(&t, NULL, build_on_a_thread, &jobs[i]), 0);
        pthread_join(t, NULL);
        cr_assert_eq(jobs[i].rc, QL_OK, "%s", jobs[i].msg);
    }
    eng_built_free(jobs[1].built); /* built, never queued */
    char msg[256];
    cr_assert_eq(eng_engine_queue(e, jobs[0].built, NULL, msg, sizeof msg), QL_OK, "%s", msg);
    wait_done(&halves);
    cr_assert_eq(halves.why, plain.why);
    cr_assert_eq(halves.len, plain.len);
    cr_assert_eq(memcmp(halves.text, plain.text, plain.len), 0, "'%.*s' vs '%.*s'", (int)halves.len,
                 halves.text, (int)plain.len, plain.text);
    q.max_new_tokens = -1;
    eng_built *none = (eng_built *)1;
    cr_assert_eq(eng_engine_build(e, &q, &none, msg, sizeof msg), QL_EINVAL);
    cr_assert(none == NULL && strstr(msg, "max_new_tokens"), "%s", msg);
    eng_engine_stop(e);
}

Test(engine, bad_requests_are_refused_with_the_reason)
{
    eng_engine *e = start(8 << 20, 8);
    result r;
    result_init(&r);
    char msg[512];
    struct {
        eng_request q;
        const char *expect;
    } cases[] = {
        {request("", 10, &r), "empty"},
        {request("ok \xff\xfe", 10, &r), "not valid UTF-8 at byte 3"},
        {request("ok", 0, &r), "max_new_tokens 0"},
        {request("ok", 1 << 30, &r), "max_new_tokens 1073741824"},
    };
    for (size_t i = 0; i < sizeof cases / sizeof *cases; i++) {
        msg[0] = 0;
        cr_assert_neq(eng_engine_submit(e, &cases[i].q, NULL, msg, sizeof msg), 0, "case %zu", i);
        cr_assert(strstr(msg, cases[i].expect), "case %zu: '%s' lacks '%s'", i, msg,
                  cases[i].expect);
    }
    eng_request q = request("ok", 10, &r);
    q.sampling.temperature = -1.0f;
    cr_assert_neq(eng_engine_submit(e, &q, NULL, msg, sizeof msg), 0);
    cr_assert(strstr(msg, "temperature"), "%s", msg);
    q.sampling.temperature = 0.5f;
    q.sampling.top_p = 1.5f;
    cr_assert_neq(eng_engine_submit(e, &q, NULL, msg, sizeof msg), 0);
    cr_assert(strstr(msg, "top_p"), "%s", msg);
    /* a prompt longer than the context of 512 */
    char *longp = malloc(4000);
    for (int i = 0; i < 3999; i++)
        longp[i] = (char)('a' + i % 26);
    longp[3999] = 0;
    q = request(longp, 10, &r);
    cr_assert_neq(eng_engine_submit(e, &q, NULL, msg, sizeof msg), 0);
    cr_assert(strstr(msg, "context"), "%s", msg);
    free(longp);
    eng_engine_stop(e);
}

Test(engine, stopping_cancels_what_runs)
{
    eng_engine *e = start(8 << 20, 8);
    result r[3];
    for (int i = 0; i < 3; i++) {
        result_init(&r[i]);
        eng_request q = request(prompts[i], 4000, &r[i]);
        submit_ok(e, &q, NULL);
    }
    eng_engine_stop(e);
    for (int i = 0; i < 3; i++) {
        cr_assert(r[i].done, "request %d never finished", i);
        cr_assert_eq(r[i].why, ENG_FINISH_CANCELLED);
    }
}

static void run_default(const char *quant, const char *prompt, int max_new, result *r)
{
    char path[1024], msg[512];
    if (!test_default_model_path(path, sizeof path))
        test_cannot_run("%s is absent: scripts/fetch-model.sh puts it there", path);
    eng_model m;
    eng_load_opts o = {.path = path, .quant = quant};
    cr_assert_eq(eng_model_load(&m, &o, msg, sizeof msg), 0, "%s", msg);
    eng_engine_opts eo = {.threads = 2, .kv_bytes = 32 << 20, .max_running = 4};
    eng_engine *e;
    cr_assert_eq(eng_engine_start(&e, &m, &eo, msg, sizeof msg), 0, "%s", msg);
    result_init(r);
    eng_request q = request(prompt, max_new, r);
    cr_assert_eq(eng_engine_submit(e, &q, NULL, msg, sizeof msg), 0, "%s", msg);
    wait_done(r);
    eng_engine_stop(e);
    eng_model_free(&m);
}

TestSuite(smollm2, .timeout = 400); /* the real model, under ASan on 2 busy cores too */

Test(smollm2, the_capital_of_france_is_paris)
{
    result r;
    run_default(NULL, "The capital of France is", 8, &r);
    cr_assert(strstr(r.text, "Paris"), "greedy completion: '%.*s'", (int)r.len, r.text);
    result chat;
    run_default(NULL,
                "<|im_start|>user\nWhat is the capital of France?<|im_end|>\n"
                "<|im_start|>assistant\n",
                24, &chat);
    cr_assert(strstr(chat.text, "Paris"), "chat completion: '%.*s'", (int)chat.len, chat.text);
    cr_assert_eq(chat.why, ENG_FINISH_EOS, "the answer ends with <|im_end|>");
}

Test(smollm2, requantized_to_nf4_still_knows_paris)
{
    result r;
    run_default("nf4", "The capital of France is", 8, &r);
    cr_assert(strstr(r.text, "Paris"), "greedy completion: '%.*s'", (int)r.len, r.text);
}

#include "fixtures/smollm2_reference.h"

/* Greedy decoding of llama.cpp's reference prompts on the same GGUF: the
 * same prompt ids, the same first-step top-1 with a close logit, and the
 * same tokens for as long as llama.cpp's own top-1/top-2 gap was
 * comfortable (0.5): llama.cpp quantizes activations to 8 bits for Q4_1
 * products and qlserve keeps them f32, so near-ties may break either way. */
Test(smollm2, greedy_tokens_agree_with_llama_cpp)
{
    char path[1024], msg[512];
    if (!test_default_model_path(path, sizeof path))
        test_cannot_run("%s is absent: scripts/fetch-model.sh puts it there", path);
    eng_model m;
    eng_load_opts o = {.path = path};
    cr_assert_eq(eng_model_load(&m, &o, msg, sizeof msg), 0, "%s", msg);
    eng_pool *pool;
    eng_kv_cache *kv;
    eng_forward_state *st;
    cr_assert_eq(eng_pool_new(&pool, 2, msg, sizeof msg), 0);
    cr_assert_eq(eng_kv_new(&kv, &m.cfg, 16 << 20, 16, msg, sizeof msg), 0);
    cr_assert_eq(eng_forward_state_new(&st, &m, 64, msg, sizeof msg), 0);
    int32_t vocab = m.cfg.vocab_size;
    float *logits = malloc((size_t)vocab * sizeof(float));
    for (size_t c = 0; c < sizeof smollm2_refs / sizeof *smollm2_refs; c++) {
        const smollm2_ref *ref = &smollm2_refs[c];
        int32_t *ids;
        size_t n;
        cr_assert_eq(tok_encode(m.tok, ref->prompt, strlen(ref->prompt), tok_adds_bos(m.tok), true,
                                &ids, &n, msg, sizeof msg),
                     0);
        cr_assert_eq(n, ref->n_prompt, "prompt %zu: %zu ids, llama.cpp %zu", c, n, ref->n_prompt);
        cr_assert_eq(memcmp(ids, ref->prompt_ids, n * sizeof(int32_t)), 0, "prompt %zu ids", c);
        eng_seq_kv s = {0};
        cr_assert_eq(eng_kv_reserve(kv, &s, (int32_t)n + SMOLLM2_REF_MAX_NEW), 0);
        eng_step_seq step = {.kv = &s, .tokens = ids, .n_tokens = (int32_t)n, .pos = 0};
        cr_assert_eq(eng_forward(st, &m, kv, pool, &step, 1, logits, msg, sizeof msg), 0, "%s",
                     msg);
        for (size_t k = 0; k < ref->n_greedy; k++) {
            int32_t best = 0;
            for (int32_t v = 1; v < vocab; v++)
                if (logits[v] > logits[best])
                    best = v;
            if (k == 0) {
                cr_assert_eq(best, ref->top5_ids[0], "prompt %zu: first token", c);
                cr_assert(fabsf(logits[best] - ref->top5_logits[0]) < 0.5f,
                          "prompt %zu: first logit %f, llama.cpp %f", c, (double)logits[best],
                          (double)ref->top5_logits[0]);
            }
            if (ref->greedy_gaps[k] < 0.5f)
                break; /* a near-tie in llama.cpp's own logits: stop comparing */
            cr_assert_eq(best, ref->greedy_ids[k], "prompt %zu step %zu: %d, llama.cpp %d", c, k,
                         best, ref->greedy_ids[k]);
            if (best == m.cfg.eos_token_id)
                break;
            eng_step_seq d = {.kv = &s, .tokens = &best, .n_tokens = 1, .pos = (int32_t)(n + k)};
            cr_assert_eq(eng_forward(st, &m, kv, pool, &d, 1, logits, msg, sizeof msg), 0);
        }
        eng_kv_release(kv, &s);
        free(ids);
    }
    free(logits);
    eng_forward_state_free(st);
    eng_kv_free(kv);
    eng_pool_free(pool);
    eng_model_free(&m);
}

/*
 * test_engine_choices.c - the engine's requests of several choices and
 * its log-probabilities, end to end on a tiny model: n greedy choices are
 * n copies of the one-choice answer, sampled choice i is the one-choice
 * answer seeded seed + i token for token (their KV shares the prompt's
 * blocks and copies the partly filled one on write, counted exactly), a
 * token's logprobs are the float64 log-softmax of the raw logits (checked
 * against eng_forward run here), a prompt's logprobs agree with the
 * generation's position by position, max_new_tokens 0 scores a prompt,
 * prompt token ids and truncate give what the text gives, special tokens
 * can add no text, cancels end every choice, and bad requests are refused
 * naming what was wrong.
 */
#include <criterion/criterion.h>
#include <math.h>
#include <pthread.h>
#include <stdlib.h>
#include <string.h>
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

TestSuite(choices, .init = setup, .fini = teardown, .timeout = 120);

#define MAX_CHOICES 8
#define MAX_TOKENS  128
#define MAX_PROMPT  256
#define TOP         5

/* What one choice produced. */
typedef struct choice_rec {
    char text[2048];
    size_t len;
    int32_t tokens[MAX_TOKENS];
    float lp[MAX_TOKENS];
    eng_logprob top[MAX_TOKENS][TOP];
    int32_t n_top[MAX_TOKENS];
    bool top_null[MAX_TOKENS];
    int n;
    int ends;
    eng_choice_end end;
} choice_rec;

/* What one request produced, through every callback. */
typedef struct outcome {
    pthread_mutex_t mu;
    pthread_cond_t cv;
    choice_rec c[MAX_CHOICES];
    int prompt_calls;
    int tokens_before_prompt; /* on_token before on_prompt (with on_prompt set) */
    int32_t prompt[MAX_PROMPT];
    int32_t n_prompt;
    bool prompt_has_lp, prompt_has_top;
    float prompt_lp[MAX_PROMPT];
    eng_logprob prompt_top[MAX_PROMPT][TOP];
    int32_t prompt_n_top;
    int dones;
    int ends_after_done;
    bool done;
    eng_finish why;
    eng_usage usage;
    eng_engine *stats_from; /* when set: a stats snapshot at the first token of the last choice */
    int32_t last_choice;
    bool have_snapshot;
    eng_engine_stats snapshot;
} outcome;

static void on_prompt(void *user, const eng_prompt_info *p)
{
    outcome *o = user;
    o->prompt_calls++;
    o->n_prompt = p->n;
    for (int32_t i = 0; i < p->n && i < MAX_PROMPT; i++) {
        o->prompt[i] = p->tokens[i];
        if (p->logprobs)
            o->prompt_lp[i] = p->logprobs[i];
        for (int32_t j = 0; p->top && j < p->n_top && j < TOP; j++)
            o->prompt_top[i][j] = p->top[(size_t)i * (size_t)p->n_top + (size_t)j];
    }
    o->prompt_has_lp = p->logprobs != NULL;
    o->prompt_has_top = p->top != NULL;
    o->prompt_n_top = p->n_top;
}

static void on_token(void *user, const eng_token_event *ev)
{
    outcome *o = user;
    cr_assert(ev->choice >= 0 && ev->choice < MAX_CHOICES);
    choice_rec *c = &o->c[ev->choice];
    if (o->prompt_calls == 0)
        o->tokens_before_prompt++;
    if (c->len + ev->len < sizeof c->text) {
        memcpy(c->text + c->len, ev->text, ev->len);
        c->len += ev->len;
    }
    if (ev->token < 0 || c->n >= MAX_TOKENS)
        return;
    if (o->stats_from && ev->choice == o->last_choice && !o->have_snapshot) {
        eng_engine_stats_get(o->stats_from, &o->snapshot);
        o->have_snapshot = true;
    }
    c->tokens[c->n] = ev->token;
    c->lp[c->n] = ev->logprob;
    c->n_top[c->n] = ev->n_top;
    c->top_null[c->n] = ev->top == NULL;
    for (int32_t j = 0; ev->top && j < ev->n_top && j < TOP; j++)
        c->top[c->n][j] = ev->top[j];
    c->n++;
}

static void on_choice_done(void *user, const eng_choice_end *end)
{
    outcome *o = user;
    cr_assert(end->choice >= 0 && end->choice < MAX_CHOICES);
    o->c[end->choice].ends++;
    o->c[end->choice].end = *end;
    if (o->dones)
        o->ends_after_done++;
}

static void on_done(void *user, eng_finish why, const eng_usage *u)
{
    outcome *o = user;
    pthread_mutex_lock(&o->mu);
    o->dones++;
    o->done = true;
    o->why = why;
    o->usage = *u;
    pthread_cond_signal(&o->cv);
    pthread_mutex_unlock(&o->mu);
}

static outcome *outcome_new(void)
{
    outcome *o = calloc(1, sizeof *o);
    cr_assert(o);
    pthread_mutex_init(&o->mu, NULL);
    pthread_cond_init(&o->cv, NULL);
    return o;
}

static void outcome_free(outcome *o)
{
    pthread_mutex_destroy(&o->mu);
    pthread_cond_destroy(&o->cv);
    free(o);
}

static void wait_done(outcome *o)
{
    pthread_mutex_lock(&o->mu);
    while (!o->done)
        pthread_cond_wait(&o->cv, &o->mu);
    pthread_mutex_unlock(&o->mu);
}

static eng_request request(const char *prompt, int max_new, outcome *o)
{
    return (eng_request){.prompt = prompt,
                         .prompt_len = strlen(prompt),
                         .max_new_tokens = max_new,
                         .on_prompt = on_prompt,
                         .on_token = on_token,
                         .on_choice_done = on_choice_done,
                         .on_done = on_done,
                         .user = o};
}

static eng_engine *start_opts(size_t kv_bytes, int max_running, int block_tokens)
{
    eng_engine_opts o = {.threads = 2,
                         .kv_bytes = kv_bytes,
                         .max_running = max_running,
                         .block_tokens = block_tokens,
                         .prefill_chunk = 4,
                         .step_tokens = 16};
    eng_engine *e;
    char msg[512];
    cr_assert_eq(eng_engine_start(&e, &model, &o, msg, sizeof msg), 0, "%s", msg);
    return e;
}

static eng_engine *start(void)
{
    return start_opts(8 << 20, 8, 16);
}

static void submit_ok(eng_engine *e, const eng_request *r, uint64_t *id)
{
    char msg[512];
    cr_assert_eq(eng_engine_submit(e, r, id, msg, sizeof msg), 0, "submit: %s", msg);
}

/* Run r alone to its end. */
static outcome *run(eng_engine *e, const eng_request *r)
{
    outcome *o = outcome_new();
    eng_request q = *r;
    q.user = o;
    submit_ok(e, &q, NULL);
    wait_done(o);
    return o;
}

static void same_tokens(const choice_rec *a, const choice_rec *b, const char *what)
{
    cr_assert_eq(a->n, b->n, "%s: %d tokens, %d", what, a->n, b->n);
    for (int i = 0; i < a->n; i++)
        cr_assert_eq(a->tokens[i], b->tokens[i], "%s: token %d: %d, %d", what, i, a->tokens[i],
                     b->tokens[i]);
}

/* The KV cache's block size in bytes for this model and block_tokens. */
static size_t block_bytes(int block_tokens)
{
    eng_kv_cache *probe;
    char msg[256];
    cr_assert_eq(eng_kv_new(&probe, &model.cfg, 1 << 20, block_tokens, msg, sizeof msg), 0);
    size_t b = eng_kv_block_floats(probe) * sizeof(float);
    eng_kv_free(probe);
    return b;
}

static eng_engine_stats stats_of(eng_engine *e)
{
    eng_engine_stats st;
    eng_engine_stats_get(e, &st);
    return st;
}

Test(choices, greedy_choices_are_the_one_choice_answer_n_times)
{
    eng_engine *e = start();
    eng_request r = request("the theme of the thesis", 20, NULL);
    outcome *one = run(e, &r);
    eng_engine_stats before = stats_of(e);
    r.n_choices = 4;
    outcome *four = run(e, &r);
    eng_engine_stats after = stats_of(e);
    int generated = 0;
    for (int i = 0; i < 4; i++) {
        same_tokens(&four->c[i], &one->c[0], "greedy choice");
        cr_assert_eq(four->c[i].len, one->c[0].len);
        cr_assert_eq(memcmp(four->c[i].text, one->c[0].text, one->c[0].len), 0);
        cr_assert_eq(four->c[i].ends, 1, "choice %d ended %d times", i, four->c[i].ends);
        cr_assert_eq(four->c[i].end.choice, i);
        cr_assert_eq(four->c[i].end.why, one->c[0].end.why);
        cr_assert_eq(four->c[i].end.generated_tokens, one->c[0].n);
        cr_assert_eq(four->c[i].end.logprob_sum, 0.0, "no logprobs asked: 0");
        generated += four->c[i].end.generated_tokens;
    }
    cr_assert_eq(four->dones, 1);
    cr_assert_eq(four->ends_after_done, 0, "every choice ends before the request");
    cr_assert_eq(four->why, one->why);
    cr_assert_eq(four->usage.prompt_tokens, one->usage.prompt_tokens, "the prompt counts once");
    cr_assert_eq(four->usage.generated_tokens, generated);
    cr_assert_eq(after.prompt_tokens - before.prompt_tokens, (uint64_t)one->usage.prompt_tokens,
                 "the prompt is prefilled once");
    cr_assert_eq(four->prompt_calls, 1);
    cr_assert_eq(four->tokens_before_prompt, 0);
    cr_assert_eq(after.kv_blocks_used, 0, "every block is back");
    outcome_free(one);
    outcome_free(four);
    eng_engine_stop(e);
}

Test(choices, sampled_choice_i_is_the_one_choice_answer_seeded_seed_plus_i)
{
    eng_engine *e = start();
    eng_request r = request("the theme", 24, NULL);
    r.sampling = (eng_sampling){.temperature = 1.2f, .top_k = 100, .seed = 777};
    r.logprobs = true;
    r.top_logprobs = 3;
    r.n_choices = 3;
    outcome *three = run(e, &r);
    bool differ = false;
    for (int i = 0; i < 3; i++) {
        eng_request q = r;
        q.n_choices = 1;
        q.sampling.seed = 777 + (uint64_t)i;
        outcome *one = run(e, &q);
        same_tokens(&three->c[i], &one->c[0], "sampled choice");
        for (int t = 0; t < one->c[0].n; t++) {
            cr_assert(same_bits(three->c[i].lp[t], one->c[0].lp[t]), "choice %d token %d", i, t);
            cr_assert_eq(three->c[i].n_top[t], 3);
            for (int j = 0; j < 3; j++)
                cr_assert_eq(three->c[i].top[t][j].token, one->c[0].top[t][j].token);
        }
        cr_assert_eq(three->c[i].end.logprob_sum, one->c[0].end.logprob_sum);
        cr_assert_eq(three->c[i].end.why, one->c[0].end.why);
        differ |=
            three->c[i].n != three->c[0].n || memcmp(three->c[i].tokens, three->c[0].tokens,
                                                     (size_t)three->c[0].n * sizeof(int32_t)) != 0;
        outcome_free(one);
    }
    cr_assert(differ, "three seeds drew three identical answers: the seeds are not per choice");
    cr_assert_eq(stats_of(e).kv_blocks_used, 0);
    outcome_free(three);
    eng_engine_stop(e);
}

/* A prompt of 40 ids (2.5 blocks of 16), 3 choices of 10 tokens: choice 0
 * reserves blocks_for(50) = 4 and holds, for each fork, its 4th block and
 * its copy of the partly filled 3rd (2 each), plus its own copy: 9 blocks.
 * The forks take the 3 prompt blocks by reference (2 x 3 = 6 shared), and
 * the first decode step copies the 3rd block for the first two writers
 * (the third then is its only owner: 2 copied). */
Test(choices, forks_share_the_prompt_and_copy_its_last_block_on_write)
{
    int32_t ids[40];
    for (int i = 0; i < 40; i++)
        ids[i] = 32 + (i * 7) % 90;
    size_t block = block_bytes(16);
    eng_engine *e = start_opts(block * 9, 8, 16);
    eng_request r = {.prompt_tokens = ids,
                     .n_prompt_tokens = 40,
                     .max_new_tokens = 10,
                     .n_choices = 3,
                     .sampling = {.temperature = 0.8f, .seed = 5, .ignore_eos = true},
                     .on_prompt = on_prompt,
                     .on_token = on_token,
                     .on_choice_done = on_choice_done,
                     .on_done = on_done};
    outcome *o = outcome_new();
    o->stats_from = e;
    o->last_choice = 2;
    r.user = o;
    submit_ok(e, &r, NULL);
    wait_done(o);
    cr_assert(o->have_snapshot);
    cr_assert_eq(o->snapshot.kv_blocks_used, 9, "%d blocks while running",
                 o->snapshot.kv_blocks_used);
    eng_engine_stats st = stats_of(e);
    cr_assert_eq(st.kv_blocks_shared, 6);
    cr_assert_eq(st.kv_blocks_copied, 2);
    cr_assert_eq(st.kv_blocks_used, 0, "all blocks back");
    cr_assert_eq(st.prompt_tokens, 40);
    cr_assert_eq(st.tokens_generated, 30);
    cr_assert_eq(o->usage.generated_tokens, 30);
    for (int i = 0; i < 3; i++) {
        cr_assert_eq(o->c[i].n, 10);
        eng_request q = r;
        q.n_choices = 1;
        q.sampling.seed = 5 + (uint64_t)i;
        outcome *one = run(e, &q);
        same_tokens(&o->c[i], &one->c[0], "a fork's answer");
        outcome_free(one);
    }
    /* fill_context lowers max_new to what all three choices fit in the
     * cache: 24 (64 positions: 4 blocks, and 2 x 2 + 1 held is 9) */
    eng_request fill = r;
    fill.max_new_tokens = 400;
    fill.fill_context = true;
    outcome *filled = run(e, &fill);
    for (int i = 0; i < 3; i++) {
        cr_assert_eq(filled->c[i].n, 24, "choice %d: %d tokens", i, filled->c[i].n);
        cr_assert_eq(filled->c[i].end.why, ENG_FINISH_LENGTH);
    }
    outcome_free(filled);
    /* one block fewer and the request can never fit: refused, with the count */
    eng_engine_stop(e);
    e = start_opts(block * 8, 8, 16);
    char msg[512];
    cr_assert_eq(eng_engine_submit(e, &r, NULL, msg, sizeof msg), QL_EINVAL);
    cr_assert(strstr(msg, "(3 choices) need 9 KV blocks; the cache has 8"), "%s", msg);
    outcome_free(o);
    eng_engine_stop(e);
}

/* A prompt that fills whole blocks: nothing to copy on write. */
Test(choices, a_prompt_of_whole_blocks_needs_no_copy)
{
    int32_t ids[32];
    for (int i = 0; i < 32; i++)
        ids[i] = 40 + i;
    eng_engine *e = start();
    eng_request r = {.prompt_tokens = ids,
                     .n_prompt_tokens = 32,
                     .max_new_tokens = 6,
                     .n_choices = 2,
                     .sampling = {.ignore_eos = true},
                     .on_token = on_token,
                     .on_done = on_done};
    outcome *o = run(e, &r);
    eng_engine_stats st = stats_of(e);
    cr_assert_eq(st.kv_blocks_shared, 2);
    cr_assert_eq(st.kv_blocks_copied, 0);
    same_tokens(&o->c[0], &o->c[1], "greedy choices");
    outcome_free(o);
    eng_engine_stop(e);
}

/* log-softmax of row in float64, as the API promises */
static void log_softmax(const float *row, int32_t vocab, double *out)
{
    float max = row[0];
    for (int32_t v = 1; v < vocab; v++)
        max = row[v] > max ? row[v] : max;
    double sum = 0;
    for (int32_t v = 0; v < vocab; v++)
        sum += exp((double)row[v] - (double)max);
    for (int32_t v = 0; v < vocab; v++)
        out[v] = (double)row[v] - ((double)max + log(sum));
}

Test(choices, logprobs_are_the_log_softmax_of_the_raw_logits)
{
    const char *prompt = "hello there";
    char msg[512];
    int32_t *ids;
    size_t n;
    cr_assert_eq(tok_encode(model.tok, prompt, strlen(prompt), tok_adds_bos(model.tok), true, &ids,
                            &n, msg, sizeof msg),
                 0);
    /* the model's own logits at the prompt's end, computed here */
    eng_pool *pool;
    eng_kv_cache *kv;
    eng_forward_state *st;
    cr_assert_eq(eng_pool_new(&pool, 2, msg, sizeof msg), 0);
    cr_assert_eq(eng_kv_new(&kv, &model.cfg, 1 << 20, 16, msg, sizeof msg), 0);
    cr_assert_eq(eng_forward_state_new(&st, &model, 64, msg, sizeof msg), 0);
    int32_t vocab = model.cfg.vocab_size;
    float *logits = malloc((size_t)vocab * sizeof(float));
    double *want = malloc((size_t)vocab * sizeof(double));
    eng_seq_kv s = {0};
    cr_assert_eq(eng_kv_reserve(kv, &s, (int32_t)n + 1), 0);
    eng_step_seq step = {.kv = &s, .tokens = ids, .n_tokens = (int32_t)n, .pos = 0};
    cr_assert_eq(eng_forward(st, &model, kv, pool, &step, 1, logits, msg, sizeof msg), 0, "%s",
                 msg);
    log_softmax(logits, vocab, want);

    /* sampled with a bias, a penalty and a temperature: the logprobs are
     * still the raw distribution's */
    eng_engine *e = start();
    eng_logit_bias bias[1] = {{.token = 7, .bias = 30}};
    eng_request r = request(prompt, 1, NULL);
    r.logprobs = true;
    r.top_logprobs = TOP;
    r.sampling = (eng_sampling){.temperature = 0.7f,
                                .repetition_penalty = 1.3f,
                                .logit_bias = bias,
                                .n_logit_bias = 1,
                                .seed = 3};
    outcome *o = run(e, &r);
    cr_assert_eq(o->c[0].n, 1);
    int32_t t = o->c[0].tokens[0];
    cr_assert_eq(t, 7, "the bias chose token 7");
    cr_assert(fabs((double)o->c[0].lp[0] - want[t]) < 1e-6, "logprob %g, log-softmax %g",
              (double)o->c[0].lp[0], want[t]);
    cr_assert_eq(o->c[0].n_top[0], TOP);
    for (int j = 0; j < TOP; j++) { /* the j-th best of the raw row, ties the lower id */
        int32_t best = -1;
        for (int32_t v = 0; v < vocab; v++) {
            bool taken = false;
            for (int i = 0; i < j; i++)
                taken |= o->c[0].top[0][i].token == v;
            if (!taken && (best < 0 || logits[v] > logits[best]))
                best = v;
        }
        cr_assert_eq(o->c[0].top[0][j].token, best, "top %d: %d, want %d", j,
                     o->c[0].top[0][j].token, best);
        cr_assert(fabs((double)o->c[0].top[0][j].logprob - want[best]) < 1e-6);
    }
    cr_assert(o->c[0].top[0][0].logprob >= o->c[0].top[0][1].logprob);
    cr_assert_eq(o->c[0].end.logprob_sum, (double)o->c[0].lp[0]);
    /* logprobs without alternatives: top is NULL */
    r.top_logprobs = 0;
    outcome *bare = run(e, &r);
    cr_assert(bare->c[0].top_null[0]);
    cr_assert_eq(bare->c[0].n_top[0], 0);
    cr_assert(same_bits(bare->c[0].lp[0], o->c[0].lp[0]));
    /* and none asked: the event carries no logprob */
    r.logprobs = false;
    outcome *none = run(e, &r);
    cr_assert(none->c[0].top_null[0]);
    cr_assert_eq(none->c[0].lp[0], 0.0f);
    outcome_free(o);
    outcome_free(bare);
    outcome_free(none);
    eng_engine_stop(e);
    eng_kv_release(kv, &s);
    free(ids);
    free(logits);
    free(want);
    eng_forward_state_free(st);
    eng_kv_free(kv);
    eng_pool_free(pool);
}

/* Greedy generation with logprobs, then the prompt and those tokens scored
 * as one prompt: the last k prompt logprobs are the generation's. */
Test(choices, prompt_logprobs_agree_with_the_generation_position_by_position)
{
    eng_engine *e = start();
    const char *prompt = "a b c d e f";
    eng_request r = request(prompt, 12, NULL);
    r.logprobs = true;
    r.top_logprobs = TOP;
    r.sampling.ignore_eos = true;
    outcome *gen = run(e, &r);
    int k = gen->c[0].n;
    cr_assert_eq(k, 12);
    double sum = 0;
    for (int i = 0; i < k; i++)
        sum += (double)gen->c[0].lp[i];
    cr_assert_eq(gen->c[0].end.logprob_sum, sum, "the sum of the reported logprobs");
    cr_assert_not(gen->prompt_has_lp, "no prompt_logprobs asked: none given");
    cr_assert_eq(gen->prompt_calls, 1);

    int32_t all[MAX_PROMPT];
    int32_t n_prompt = gen->n_prompt;
    memcpy(all, gen->prompt, (size_t)n_prompt * sizeof *all);
    memcpy(all + n_prompt, gen->c[0].tokens, (size_t)k * sizeof *all);
    eng_request s = {.prompt_tokens = all,
                     .n_prompt_tokens = (size_t)(n_prompt + k),
                     .max_new_tokens = 0,
                     .prompt_logprobs = true,
                     .top_logprobs = TOP,
                     .n_choices = 2,
                     .on_prompt = on_prompt,
                     .on_token = on_token,
                     .on_choice_done = on_choice_done,
                     .on_done = on_done};
    outcome *score = run(e, &s);
    cr_assert_eq(score->prompt_calls, 1);
    cr_assert(score->prompt_has_lp && score->prompt_has_top);
    cr_assert_eq(score->prompt_n_top, TOP);
    cr_assert_eq(score->n_prompt, n_prompt + k);
    cr_assert(isnan(score->prompt_lp[0]), "the first token has no logprob");
    for (int j = 0; j < TOP; j++)
        cr_assert_eq(score->prompt_top[0][j].token, -1);
    for (int i = 1; i < n_prompt; i++)
        cr_assert(score->prompt_lp[i] <= 0 && isfinite(score->prompt_lp[i]));
    for (int i = 0; i < k; i++) {
        float a = score->prompt_lp[n_prompt + i], b = gen->c[0].lp[i];
        cr_assert(fabsf(a - b) < 1e-6f, "position %d: prompt %g, generation %g", n_prompt + i,
                  (double)a, (double)b);
        for (int j = 0; j < TOP; j++) {
            cr_assert_eq(score->prompt_top[n_prompt + i][j].token, gen->c[0].top[i][j].token);
            cr_assert(fabsf(score->prompt_top[n_prompt + i][j].logprob -
                            gen->c[0].top[i][j].logprob) < 1e-6f);
        }
        /* greedy: the chosen token is the top one */
        cr_assert_eq(gen->c[0].tokens[i], gen->c[0].top[i][0].token);
    }
    /* max_new_tokens 0: scored, nothing generated, each choice ends length */
    for (int i = 0; i < 2; i++) {
        cr_assert_eq(score->c[i].n, 0);
        cr_assert_eq(score->c[i].ends, 1);
        cr_assert_eq(score->c[i].end.why, ENG_FINISH_LENGTH);
        cr_assert_eq(score->c[i].end.generated_tokens, 0);
    }
    cr_assert_eq(score->why, ENG_FINISH_LENGTH);
    cr_assert_eq(score->usage.generated_tokens, 0);
    cr_assert_eq(score->usage.prompt_tokens, n_prompt + k);
    cr_assert_eq(stats_of(e).kv_blocks_used, 0);
    outcome_free(gen);
    outcome_free(score);
    eng_engine_stop(e);
}

/* The EOS that ends a choice is no token event, but its logprob is in the
 * choice's logprob_sum: what scoring the prompt, the tokens and EOS gives. */
Test(choices, the_ending_eos_counts_in_the_logprob_sum)
{
    eng_engine *e = start();
    int32_t eos = model.cfg.eos_token_id;
    eng_logit_bias force[1] = {{.token = eos, .bias = 100}};
    eng_request r = request("the theme", 10, NULL);
    r.logprobs = true;
    r.sampling = (eng_sampling){.min_tokens = 2, .logit_bias = force, .n_logit_bias = 1};
    outcome *gen = run(e, &r);
    cr_assert_eq(gen->why, ENG_FINISH_EOS);
    cr_assert_eq(gen->c[0].n, 2, "min_tokens held EOS back twice");
    cr_assert_eq(gen->c[0].end.generated_tokens, 2);
    int32_t all[MAX_PROMPT];
    int32_t n = gen->n_prompt;
    memcpy(all, gen->prompt, (size_t)n * sizeof *all);
    all[n] = gen->c[0].tokens[0];
    all[n + 1] = gen->c[0].tokens[1];
    all[n + 2] = eos;
    eng_request s = {.prompt_tokens = all,
                     .n_prompt_tokens = (size_t)n + 3,
                     .prompt_logprobs = true,
                     .on_prompt = on_prompt,
                     .on_done = on_done};
    outcome *score = run(e, &s);
    double events = (double)gen->c[0].lp[0] + (double)gen->c[0].lp[1];
    double eos_lp = gen->c[0].end.logprob_sum - events;
    cr_assert(fabs(eos_lp - (double)score->prompt_lp[n + 2]) < 1e-6, "EOS %g, scored %g", eos_lp,
              (double)score->prompt_lp[n + 2]);
    cr_assert(eos_lp < 0);
    outcome_free(gen);
    outcome_free(score);
    eng_engine_stop(e);
}

/* Two prompt_logprobs requests at once share the one rows buffer in turns. */
Test(choices, prompt_logprobs_requests_batched_take_turns)
{
    eng_engine *e = start();
    eng_request r = request("the theme of the thesis is long", 3, NULL);
    r.prompt_logprobs = true;
    outcome *alone = run(e, &r);
    outcome *a = outcome_new(), *b = outcome_new();
    eng_request qa = r, qb = r;
    qa.user = a;
    qb.user = b;
    submit_ok(e, &qa, NULL);
    submit_ok(e, &qb, NULL);
    wait_done(a);
    wait_done(b);
    for (int i = 1; i < alone->n_prompt; i++) {
        cr_assert(fabsf(a->prompt_lp[i] - alone->prompt_lp[i]) < 1e-6f, "position %d", i);
        cr_assert(fabsf(b->prompt_lp[i] - alone->prompt_lp[i]) < 1e-6f, "position %d", i);
    }
    cr_assert_not(a->prompt_has_top, "no top_logprobs: no rows");
    same_tokens(&a->c[0], &alone->c[0], "batched");
    outcome_free(alone);
    outcome_free(a);
    outcome_free(b);
    eng_engine_stop(e);
}

Test(choices, max_new_tokens_0_is_only_for_scoring)
{
    eng_engine *e = start();
    char msg[512];
    eng_request r = request("ok", 0, NULL);
    cr_assert_eq(eng_engine_submit(e, &r, NULL, msg, sizeof msg), QL_EINVAL);
    cr_assert(strstr(msg, "max_new_tokens 0 is not in [1, "), "%s", msg);
    cr_assert(strstr(msg, "prompt_logprobs"), "%s", msg);
    r.prompt_logprobs = true;
    outcome *o = run(e, &r);
    cr_assert_eq(o->why, ENG_FINISH_LENGTH);
    cr_assert_eq(o->c[0].n, 0);
    cr_assert_eq(o->c[0].len, 0);
    outcome_free(o);
    eng_engine_stop(e);
}

Test(choices, prompt_token_ids_give_what_the_text_gives)
{
    eng_engine *e = start();
    eng_request r = request("the theme of the thesis", 16, NULL);
    outcome *text = run(e, &r);
    eng_request q = {.prompt_tokens = text->prompt,
                     .n_prompt_tokens = (size_t)text->n_prompt,
                     .prompt = "ignored",
                     .prompt_len = 7,
                     .max_new_tokens = 16,
                     .on_prompt = on_prompt,
                     .on_token = on_token,
                     .on_done = on_done};
    outcome *ids = run(e, &q);
    cr_assert_eq(ids->n_prompt, text->n_prompt);
    cr_assert_eq(memcmp(ids->prompt, text->prompt, (size_t)text->n_prompt * sizeof(int32_t)), 0);
    same_tokens(&ids->c[0], &text->c[0], "ids and text");
    cr_assert_eq(ids->usage.prompt_tokens, text->usage.prompt_tokens);
    /* ids are used as given: no BOS is added in front */
    int32_t one[1] = {text->prompt[text->n_prompt - 1]};
    q.prompt_tokens = one;
    q.n_prompt_tokens = 1;
    outcome *single = run(e, &q);
    cr_assert_eq(single->n_prompt, 1);
    cr_assert_eq(single->prompt[0], one[0]);
    outcome_free(text);
    outcome_free(ids);
    outcome_free(single);
    eng_engine_stop(e);
}

Test(choices, truncate_keeps_the_prompts_last_tokens)
{
    eng_engine *e = start();
    eng_request r = request("the theme of the thesis", 10, NULL);
    outcome *whole = run(e, &r);
    cr_assert(whole->n_prompt > 4);
    r.truncate = 4;
    outcome *cut = run(e, &r);
    cr_assert_eq(cut->n_prompt, 4);
    cr_assert_eq(cut->usage.prompt_tokens, 4);
    cr_assert_eq(memcmp(cut->prompt, whole->prompt + whole->n_prompt - 4, 4 * sizeof(int32_t)), 0);
    /* what the last 4 ids give when sent as ids */
    eng_request q = {.prompt_tokens = whole->prompt + whole->n_prompt - 4,
                     .n_prompt_tokens = 4,
                     .max_new_tokens = 10,
                     .on_token = on_token,
                     .on_done = on_done};
    outcome *ids = run(e, &q);
    same_tokens(&cut->c[0], &ids->c[0], "truncated");
    /* a truncate past the prompt's length keeps it whole */
    r.truncate = 1000;
    outcome *all = run(e, &r);
    cr_assert_eq(all->n_prompt, whole->n_prompt);
    same_tokens(&all->c[0], &whole->c[0], "not truncated");
    outcome_free(whole);
    outcome_free(cut);
    outcome_free(ids);
    outcome_free(all);
    eng_engine_stop(e);
}

Test(choices, skipped_special_tokens_add_no_text_but_count)
{
    eng_engine *e = start();
    int32_t eos = model.cfg.eos_token_id;
    cr_assert(tok_is_special(model.tok, eos));
    eng_logit_bias force[1] = {{.token = eos, .bias = 100}};
    eng_request r = request("hello", 3, NULL);
    r.sampling = (eng_sampling){.ignore_eos = true, .logit_bias = force, .n_logit_bias = 1};
    outcome *shown = run(e, &r);
    cr_assert_eq(shown->c[0].n, 3);
    cr_assert(strstr(shown->c[0].text, "<|endoftext|>"), "'%.*s'", (int)shown->c[0].len,
              shown->c[0].text);
    r.skip_special_tokens = true;
    outcome *skipped = run(e, &r);
    cr_assert_eq(skipped->c[0].n, 3, "the tokens are still reported");
    for (int i = 0; i < 3; i++)
        cr_assert_eq(skipped->c[0].tokens[i], eos);
    cr_assert_eq(skipped->c[0].len, 0, "'%.*s'", (int)skipped->c[0].len, skipped->c[0].text);
    cr_assert_eq(skipped->usage.generated_tokens, 3);
    cr_assert_eq(skipped->why, ENG_FINISH_LENGTH);
    /* ordinary tokens still add their text */
    r.sampling = (eng_sampling){0};
    r.max_new_tokens = 10;
    outcome *plain = run(e, &r);
    r.skip_special_tokens = false;
    outcome *plain_shown = run(e, &r);
    same_tokens(&plain->c[0], &plain_shown->c[0], "skip_special_tokens changes no token");
    bool any_special = false;
    for (int i = 0; i < plain->c[0].n; i++)
        any_special |= tok_is_special(model.tok, plain->c[0].tokens[i]);
    if (!any_special) {
        cr_assert_eq(plain->c[0].len, plain_shown->c[0].len);
        cr_assert_eq(memcmp(plain->c[0].text, plain_shown->c[0].text, plain->c[0].len), 0);
    }
    outcome_free(shown);
    outcome_free(skipped);
    outcome_free(plain);
    outcome_free(plain_shown);
    eng_engine_stop(e);
}

Test(choices, include_stop_str_emits_the_stop_string_and_still_stops)
{
    eng_engine *e = start();
    eng_request r = request("the theme", 30, NULL);
    outcome *plain = run(e, &r);
    cr_assert(plain->c[0].len > 6, "need some text to cut");
    char stop[8];
    memcpy(stop, plain->c[0].text + 2, 4);
    stop[4] = 0;
    const char *stops[1] = {stop};
    r.stop = stops;
    r.n_stop = 1;
    r.include_stop_str = true;
    r.n_choices = 2;
    outcome *cut = run(e, &r);
    const char *at = strstr(plain->c[0].text, stop);
    size_t want = (size_t)(at - plain->c[0].text) + strlen(stop);
    for (int i = 0; i < 2; i++) {
        cr_assert_eq(cut->c[i].end.why, ENG_FINISH_STOP);
        cr_assert_eq(cut->c[i].len, want, "'%.*s'", (int)cut->c[i].len, cut->c[i].text);
        cr_assert_eq(memcmp(cut->c[i].text, plain->c[0].text, want), 0);
    }
    outcome_free(plain);
    outcome_free(cut);
    eng_engine_stop(e);
}

Test(choices, cancel_ends_every_choice_waiting_or_running)
{
    eng_engine *e = start_opts(8 << 20, 4, 16);
    engine_hold_after(e, 0);
    eng_request r = request("the theme of the thesis", 400, NULL);
    r.n_choices = 4;
    outcome *running = outcome_new(), *waiting = outcome_new();
    r.user = running;
    uint64_t id_running, id_waiting;
    submit_ok(e, &r, &id_running);
    engine_step_until_generated(e, 4); /* the prefill is done: all four choices have begun */
    r.user = waiting;
    r.n_choices = 2;
    submit_ok(e, &r, &id_waiting); /* no slot free: it waits */
    engine_hold_after(e, 0);
    eng_engine_stats st = stats_of(e);
    cr_assert_eq(st.waiting, 1);
    cr_assert_eq(st.running, 4);
    eng_engine_cancel(e, id_waiting);
    wait_done(waiting);
    cr_assert_eq(waiting->why, ENG_FINISH_CANCELLED);
    cr_assert_eq(waiting->prompt_calls, 0);
    for (int i = 0; i < 2; i++)
        cr_assert_eq(waiting->c[i].ends, 0, "a choice that never began reports no end");
    engine_hold_after(e, 0);
    cr_assert_not(running->done, "the other request runs on");
    cr_assert_eq(stats_of(e).running, 4);
    eng_engine_cancel(e, id_running);
    wait_done(running);
    cr_assert_eq(running->why, ENG_FINISH_CANCELLED);
    cr_assert_eq(running->dones, 1);
    int generated = 0;
    for (int i = 0; i < 4; i++) {
        cr_assert_eq(running->c[i].ends, 1, "choice %d", i);
        cr_assert_eq(running->c[i].end.why, ENG_FINISH_CANCELLED);
        cr_assert(running->c[i].n >= 1);
        generated += running->c[i].end.generated_tokens;
    }
    cr_assert_eq(running->usage.generated_tokens, generated);
    st = stats_of(e);
    cr_assert_eq(st.kv_blocks_used, 0, "the blocks are back before on_done");
    engine_hold_after(e, 0); /* running is published after the round */
    cr_assert_eq(stats_of(e).running, 0);
    /* the slots are free again: a new request of 4 runs */
    eng_engine_gate(e, -1);
    r.n_choices = 4;
    r.max_new_tokens = 3;
    outcome *after = run(e, &r);
    cr_assert_eq(after->why, ENG_FINISH_LENGTH);
    outcome_free(running);
    outcome_free(waiting);
    outcome_free(after);
    eng_engine_stop(e);
}

/* A request of several choices waits for slots for all of them while a
 * smaller one runs, and stopping the engine ends every choice. */
Test(choices, slots_are_reserved_for_every_choice)
{
    eng_engine *e = start_opts(8 << 20, 4, 16);
    engine_hold_after(e, 0);
    eng_request r = request("hello", 400, NULL);
    outcome *two = outcome_new(), *three = outcome_new();
    r.user = two;
    r.n_choices = 2;
    submit_ok(e, &r, NULL);
    engine_step_until_generated(e, 2); /* the prefill is done: both choices have begun */
    r.user = three;
    r.n_choices = 3;
    submit_ok(e, &r, NULL);
    engine_hold_after(e, 0);
    eng_engine_stats st = stats_of(e);
    cr_assert_eq(st.running, 2, "two choices run");
    cr_assert_eq(st.waiting, 1, "three choices cannot take the 2 slots left");
    eng_engine_stop(e);
    cr_assert(two->done && three->done);
    cr_assert_eq(two->why, ENG_FINISH_CANCELLED);
    cr_assert_eq(two->c[0].ends + two->c[1].ends, 2);
    cr_assert_eq(three->c[0].ends, 0);
    outcome_free(two);
    outcome_free(three);
}

Test(choices, bad_requests_are_refused_naming_the_field)
{
    eng_engine *e = start_opts(8 << 20, 4, 16);
    char msg[512];
    int32_t bad_ids[3] = {1, 2, 999};
    struct {
        eng_request q;
        const char *expect;
    } cases[] = {
        {{.prompt = "ok", .prompt_len = 2, .max_new_tokens = 4, .n_choices = 5},
         "n_choices 5 is not in [1, 4]"},
        {{.prompt = "ok", .prompt_len = 2, .max_new_tokens = 4, .n_choices = -1}, "n_choices -1"},
        {{.prompt = "ok", .prompt_len = 2, .max_new_tokens = 4, .top_logprobs = 21},
         "top_logprobs 21 is not in [0, 20]"},
        {{.prompt = "ok", .prompt_len = 2, .max_new_tokens = 4, .truncate = -2}, "truncate -2"},
        {{.prompt_tokens = bad_ids, .n_prompt_tokens = 3, .max_new_tokens = 4},
         "prompt token 2 is 999, outside the vocabulary of 260"},
        {{.prompt_tokens = bad_ids, .n_prompt_tokens = 0, .max_new_tokens = 4}, "empty"},
    };
    for (size_t i = 0; i < sizeof cases / sizeof *cases; i++) {
        msg[0] = 0;
        cr_assert_eq(eng_engine_submit(e, &cases[i].q, NULL, msg, sizeof msg), QL_EINVAL,
                     "case %zu", i);
        cr_assert(strstr(msg, cases[i].expect), "case %zu: '%s' lacks '%s'", i, msg,
                  cases[i].expect);
    }
    cr_assert_eq(stats_of(e).waiting, 0, "nothing was queued");
    eng_engine_stop(e);
}

/* --- on the default real model, when scripts/fetch-model.sh has put it in place --- */

#include "fixtures/smollm2_reference.h"

TestSuite(smollm2_choices, .timeout = 240);

/* The first token's top_logprobs over llama.cpp's prompt ids: the same
 * five tokens in the same order wherever llama.cpp's own neighbours are
 * 0.5 apart (it quantizes activations to 8 bits, we do not), and logprob
 * differences that are its logit differences (a log-softmax shifts every
 * logit by one constant). Then two greedy choices of 8 tokens are the
 * one-choice answer twice on the real vocabulary. */
Test(smollm2_choices, first_token_alternatives_agree_with_llama_cpp)
{
    char path[1024], msg[512];
    if (!test_default_model_path(path, sizeof path))
        test_cannot_run("%s is absent: scripts/fetch-model.sh puts it there", path);
    eng_model m;
    eng_load_opts lo = {.path = path};
    cr_assert_eq(eng_model_load(&m, &lo, msg, sizeof msg), 0, "%s", msg);
    eng_engine_opts eo = {.threads = 2, .kv_bytes = 32 << 20, .max_running = 4};
    eng_engine *e;
    cr_assert_eq(eng_engine_start(&e, &m, &eo, msg, sizeof msg), 0, "%s", msg);
    int compared = 0;
    for (size_t c = 0; c < sizeof smollm2_refs / sizeof *smollm2_refs; c++) {
        const smollm2_ref *ref = &smollm2_refs[c];
        eng_request r = {.prompt_tokens = ref->prompt_ids,
                         .n_prompt_tokens = ref->n_prompt,
                         .max_new_tokens = 1,
                         .logprobs = true,
                         .top_logprobs = 5,
                         .on_token = on_token,
                         .on_done = on_done};
        outcome *o = run(e, &r);
        const eng_logprob *top = o->c[0].top[0];
        cr_assert_eq(o->c[0].n_top[0], 5);
        cr_assert_eq(top[0].token, ref->top5_ids[0], "prompt %zu: top-1", c);
        cr_assert_eq(o->c[0].tokens[0], top[0].token, "greedy takes the top one");
        double mass = 0;
        for (int j = 0; j < 5; j++) {
            mass += exp((double)top[j].logprob);
            /* the fifth's neighbour below is not in the fixture: unknown */
            bool apart = j < 4 &&
                         (j == 0 || ref->top5_logits[j - 1] - ref->top5_logits[j] > 0.5f) &&
                         ref->top5_logits[j] - ref->top5_logits[j + 1] > 0.5f;
            if (!apart)
                continue;
            cr_assert_eq(top[j].token, ref->top5_ids[j], "prompt %zu: top %d: %d, llama.cpp %d", c,
                         j, top[j].token, ref->top5_ids[j]);
            double ours = (double)top[0].logprob - (double)top[j].logprob;
            double theirs = (double)ref->top5_logits[0] - (double)ref->top5_logits[j];
            cr_assert(fabs(ours - theirs) < 0.5, "prompt %zu top %d: gap %g, llama.cpp %g", c, j,
                      ours, theirs);
            compared++;
        }
        cr_assert(mass <= 1.0 + 1e-6 && mass > 0, "prompt %zu: top-5 mass %g", c, mass);
        outcome_free(o);
    }
    cr_assert(compared >= 4, "only %d alternatives were far enough apart to compare", compared);
    const smollm2_ref *ref = &smollm2_refs[0];
    eng_request r = {.prompt_tokens = ref->prompt_ids,
                     .n_prompt_tokens = ref->n_prompt,
                     .max_new_tokens = 8,
                     .on_token = on_token,
                     .on_done = on_done};
    outcome *one = run(e, &r);
    r.n_choices = 2;
    outcome *two = run(e, &r);
    same_tokens(&two->c[0], &one->c[0], "choice 0");
    same_tokens(&two->c[1], &one->c[0], "choice 1");
    outcome_free(one);
    outcome_free(two);
    eng_engine_stop(e);
    eng_model_free(&m);
}

/*
 * test_engine_grammar.c - constrained decoding through the engine, on a
 * tiny model whose own answers are noise: every answer of a request with
 * a grammar is a sentence of it (sampled, many seeds, several choices per
 * request, batched beside unconstrained requests that it must not
 * change, and with an unmerged adapter), a whole answer ends the choice,
 * a grammar cannot be asked with ignore_eos, and an ambiguous grammar
 * ends its request once its masks pass one step's budget of matcher
 * steps, while a neighbour gets its token every step.
 */
#include <criterion/criterion.h>
#include <pthread.h>
#include <stdlib.h>
#include <string.h>

#include "grammar.h"
#include "lora.h"
#include "lora_fixture.h"
#include "model.h"
#include "scheduler.h"
#include "test_util.h"
#include "tiny_model.h"

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

TestSuite(engine_grammar, .init = setup, .fini = teardown, .timeout = 120);

#define MAX_CHOICES     4
#define OUTCOME_CHOICES 16 /* the most choices a request of these tests asks */

typedef struct outcome {
    pthread_mutex_t mu;
    pthread_cond_t cv;
    char text[OUTCOME_CHOICES][1024];
    size_t len[OUTCOME_CHOICES];
    int32_t tokens[OUTCOME_CHOICES][128];
    int n_tokens[OUTCOME_CHOICES];
    int generated; /* tokens of every choice, past the 128 kept */
    eng_finish why[OUTCOME_CHOICES];
    eng_finish done_why;
    bool done;
} outcome;

static void on_token(void *user, const eng_token_event *ev)
{
    outcome *o = user;
    if (o->len[ev->choice] + ev->len < sizeof o->text[0]) {
        memcpy(o->text[ev->choice] + o->len[ev->choice], ev->text, ev->len);
        o->len[ev->choice] += ev->len;
    }
    if (ev->token >= 0 && o->n_tokens[ev->choice] < 128)
        o->tokens[ev->choice][o->n_tokens[ev->choice]++] = ev->token;
    o->generated += ev->token >= 0;
}

static void on_choice_done(void *user, const eng_choice_end *end)
{
    outcome *o = user;
    o->why[end->choice] = end->why;
}

static void on_done(void *user, eng_finish why, const eng_usage *u)
{
    (void)u;
    outcome *o = user;
    pthread_mutex_lock(&o->mu);
    o->done_why = why;
    o->done = true;
    pthread_cond_signal(&o->cv);
    pthread_mutex_unlock(&o->mu);
}

static outcome *outcome_new(void)
{
    outcome *o = calloc(1, sizeof *o);
    pthread_mutex_init(&o->mu, NULL);
    pthread_cond_init(&o->cv, NULL);
    return o;
}

static void wait_free(outcome *o)
{
    pthread_mutex_lock(&o->mu);
    while (!o->done)
        pthread_cond_wait(&o->cv, &o->mu);
    pthread_mutex_unlock(&o->mu);
    pthread_mutex_destroy(&o->mu);
    pthread_cond_destroy(&o->cv);
}

static eng_engine *start(void)
{
    eng_engine_opts o = {.threads = 2, .kv_bytes = 16 << 20, .max_running = 16};
    eng_engine *e;
    char msg[512];
    cr_assert_eq(eng_engine_start(&e, &model, &o, msg, sizeof msg), 0, "%s", msg);
    return e;
}

#define LIT(b, s) gr_literal((b), (s), strlen(s))

/* {"id": [0-9]{1,3}, "tags": ["x" | "yz"]{0,4}} with an optional space
 * after each colon and comma: every sentence is short, so a sampled
 * answer always completes within the token budget. */
static gr_grammar *record_grammar(void)
{
    gr_builder *b = gr_builder_new(0);
    gr_expr sp = gr_optional(b, LIT(b, " "));
    gr_expr tag = gr_alt2(b, LIT(b, "\"x\""), LIT(b, "\"yz\""));
    gr_expr more = gr_repeat(b, gr_seq2(b, gr_seq2(b, LIT(b, ","), sp), tag), 0, 3);
    gr_expr tags = gr_optional(b, gr_seq2(b, tag, more));
    gr_expr xs[] = {LIT(b, "{\"id\":"),
                    sp,
                    gr_repeat(b, gr_byte_range(b, '0', '9'), 1, 3),
                    LIT(b, ","),
                    sp,
                    LIT(b, "\"tags\":"),
                    sp,
                    LIT(b, "["),
                    tags,
                    LIT(b, "]}")};
    gr_grammar *g = NULL;
    char msg[256];
    cr_assert_eq(gr_build(b, gr_seq(b, xs, sizeof xs / sizeof *xs), &g, msg, sizeof msg), QL_OK,
                 "%s", msg);
    gr_builder_free(b);
    return g;
}

static eng_request request(const char *prompt, gr_grammar *g, outcome *o)
{
    return (eng_request){.prompt = prompt,
                         .prompt_len = strlen(prompt),
                         .max_new_tokens = 100,
                         .grammar = g,
                         .on_token = on_token,
                         .on_choice_done = on_choice_done,
                         .on_done = on_done,
                         .user = o};
}

Test(engine_grammar, every_sampled_answer_is_a_whole_sentence_of_the_grammar)
{
    eng_engine *e = start();
    gr_grammar *g = record_grammar();
    char msg[512];
    enum { ROUNDS = 6, PER_ROUND = 4 };
    for (int round = 0; round < ROUNDS; round++) {
        outcome *o[PER_ROUND];
        for (int i = 0; i < PER_ROUND; i++) { /* submitted together: they share steps */
            o[i] = outcome_new();
            eng_request r = request("the theme", g, o[i]);
            r.n_choices = MAX_CHOICES;
            r.sampling = (eng_sampling){.temperature = 1.5f,
                                        .top_k = i == 1 ? 5 : 0,
                                        .repetition_penalty = i == 2 ? 1.3f : 0,
                                        .seed = (uint64_t)(round * 100 + i)};
            cr_assert_eq(eng_engine_submit(e, &r, NULL, msg, sizeof msg), QL_OK, "%s", msg);
        }
        for (int i = 0; i < PER_ROUND; i++) {
            wait_free(o[i]);
            for (int c = 0; c < MAX_CHOICES; c++) {
                cr_assert_eq(o[i]->why[c], ENG_FINISH_EOS, "round %d request %d choice %d: %s",
                             round, i, c, eng_finish_name(o[i]->why[c]));
                cr_assert(gr_grammar_accepts(g, o[i]->text[c], o[i]->len[c]),
                          "round %d request %d choice %d: '%.*s' is not a sentence", round, i, c,
                          (int)o[i]->len[c], o[i]->text[c]);
            }
            free(o[i]);
        }
    }
    eng_engine_stats st;
    eng_engine_stats_get(e, &st);
    cr_assert_geq(st.grammar_masks, (uint64_t)(ROUNDS * PER_ROUND * MAX_CHOICES * 5),
                  "every constrained draw is counted");
    cr_assert_gt(st.grammar_seconds, 0);
    gr_grammar_unref(g);
    eng_engine_stop(e);
}

Test(engine_grammar, a_constrained_neighbour_changes_no_token_of_an_unconstrained_request)
{
    eng_engine *e = start();
    gr_grammar *g = record_grammar();
    char msg[512];
    eng_sampling greedy = {0};
    outcome *alone = outcome_new();
    eng_request r = request("the theme", NULL, alone);
    r.max_new_tokens = 24;
    r.sampling = greedy;
    cr_assert_eq(eng_engine_submit(e, &r, NULL, msg, sizeof msg), QL_OK, "%s", msg);
    wait_free(alone);
    outcome *beside = outcome_new(), *constrained = outcome_new();
    eng_request c = request("the theme", g, constrained);
    c.sampling = greedy;
    cr_assert_eq(eng_engine_submit(e, &c, NULL, msg, sizeof msg), QL_OK, "%s", msg);
    r.user = beside;
    cr_assert_eq(eng_engine_submit(e, &r, NULL, msg, sizeof msg), QL_OK, "%s", msg);
    wait_free(beside);
    wait_free(constrained);
    cr_assert_eq(beside->n_tokens[0], alone->n_tokens[0]);
    cr_assert_arr_eq(beside->tokens[0], alone->tokens[0],
                     (size_t)alone->n_tokens[0] * sizeof(int32_t));
    cr_assert(gr_grammar_accepts(g, constrained->text[0], constrained->len[0]), "'%.*s'",
              (int)constrained->len[0], constrained->text[0]);
    cr_assert_str_neq(constrained->text[0], alone->text[0], "the grammar changed the answer");
    free(alone);
    free(beside);
    free(constrained);
    gr_grammar_unref(g);
    eng_engine_stop(e);
}

Test(engine_grammar, a_grammar_with_ignore_eos_is_refused)
{
    eng_engine *e = start();
    gr_grammar *g = record_grammar();
    char msg[512];
    outcome *o = outcome_new();
    eng_request r = request("the theme", g, o);
    r.sampling.ignore_eos = true;
    cr_assert_eq(eng_engine_submit(e, &r, NULL, msg, sizeof msg), QL_EINVAL);
    cr_assert(strstr(msg, "ignore_eos"), "%s", msg);
    free(o);
    gr_grammar_unref(g);
    eng_engine_stop(e);
}

Test(engine_grammar, answers_under_an_unmerged_adapter_keep_to_the_grammar)
{
    char folder[700], msg[512];
    snprintf(folder, sizeof folder, "%s/adapter", dir);
    lora_fix_spec spec = lora_fix_default();
    spec.std = 0.5f; /* large enough to move the tiny model's answers */
    lora_fix_write(folder, &model.cfg, &spec);
    eng_lora *lora = NULL;
    lora_meta meta;
    cr_assert_eq(lora_load(&lora, &meta, folder, "a", &model, msg, sizeof msg), QL_OK, "%s", msg);
    eng_engine *e = start();
    gr_grammar *g = record_grammar();
    eng_lora_term term = {.lora = lora, .scale = 1.0f};
    enum { N = 6 };
    outcome *o[N];
    for (int i = 0; i < N; i++) { /* adapter and base interleaved in one batch */
        o[i] = outcome_new();
        eng_request r = request("the theme", g, o[i]);
        r.sampling = (eng_sampling){.temperature = 1.0f, .seed = (uint64_t)i};
        if (i % 2 == 0) {
            r.adapters = &term;
            r.n_adapters = 1;
        }
        cr_assert_eq(eng_engine_submit(e, &r, NULL, msg, sizeof msg), QL_OK, "%s", msg);
    }
    for (int i = 0; i < N; i++) {
        wait_free(o[i]);
        cr_assert_eq(o[i]->why[0], ENG_FINISH_EOS, "request %d: %s", i,
                     eng_finish_name(o[i]->why[0]));
        cr_assert(gr_grammar_accepts(g, o[i]->text[0], o[i]->len[0]), "request %d: '%.*s'", i,
                  (int)o[i]->len[0], o[i]->text[0]);
        free(o[i]);
    }
    eng_engine_stats st;
    eng_engine_stats_get(e, &st);
    cr_assert_eq(st.adapter_requests, (uint64_t)(N / 2), "the adapter was applied unmerged");
    eng_engine_stop(e);
    gr_grammar_unref(g);
    eng_lora_unref(lora);
}

/* (.*.){300}: any byte may end one repeat and begin the next, so after k
 * bytes a state holds a stack per repeat begun, and a mask tests them all
 * at every node of the vocabulary's trie: issue 30's row, where 16 such
 * choices made every other client's token 30 times slower for 20 s. Held
 * one step at a time: in no step do the grammar's masks take more than
 * one request's budget (gr_vocab_step_budget; the step that passes it by
 * at most one state's stacks, the last thing it tested), the request
 * ends with ENG_FINISH_GRAMMAR on every choice long before its token
 * limit, and the neighbour beside it takes a token every step, before and
 * after. Counted in steps, never timed. */
Test(engine_grammar, an_ambiguous_grammar_ends_at_its_step_budget_while_a_neighbour_goes_on)
{
    enum { CHOICES = 16, LIMIT = 400, MOST_STACKS = 4096 };
    eng_engine_opts opts = {.threads = 2, .kv_bytes = 16 << 20, .max_running = 32};
    eng_engine *e;
    char msg[512];
    cr_assert_eq(eng_engine_start(&e, &model, &opts, msg, sizeof msg), 0, "%s", msg);
    gr_vocab *v = NULL;
    cr_assert_eq(gr_vocab_from_tokenizer(&v, model.tok, model.cfg.vocab_size, -1, msg, sizeof msg),
                 QL_OK, "%s", msg);
    int64_t budget = gr_vocab_step_budget(v);
    gr_vocab_free(v);
    gr_grammar *g = NULL;
    cr_assert_eq(gr_compile(GR_REGEX, "(.*.){300}", 10, 0, &g, msg, sizeof msg), QL_OK, "%s", msg);
    engine_hold_after(e, 0); /* nothing runs but the steps this test lets */
    outcome *other = outcome_new(), *bomb = outcome_new();
    eng_request r = request("the theme", NULL, other);
    r.max_new_tokens = LIMIT;
    r.sampling.ignore_eos = true; /* it runs to LIMIT, past the bomb */
    cr_assert_eq(eng_engine_submit(e, &r, NULL, msg, sizeof msg), QL_OK, "%s", msg);
    eng_request b = request("the theme", g, bomb);
    b.n_choices = CHOICES;
    b.max_new_tokens = LIMIT;
    b.sampling = (eng_sampling){.temperature = 1.0f, .seed = 30};
    cr_assert_eq(eng_engine_submit(e, &b, NULL, msg, sizeof msg), QL_OK, "%s", msg);
    eng_engine_stats st;
    eng_engine_stats_get(e, &st);
    uint64_t work = st.grammar_steps, most = 0;
    int steps = 0;
    while (!bomb->done) {
        engine_hold_after(e, 1);
        steps++;
        eng_engine_stats_get(e, &st);
        uint64_t took = st.grammar_steps - work;
        work = st.grammar_steps;
        most = took > most ? took : most;
        cr_assert_leq(took, (uint64_t)budget + MOST_STACKS, "step %d: %llu matcher steps", steps,
                      (unsigned long long)took);
        /* the prompts are one step's prefill: a token each step from the first */
        cr_assert_eq(other->generated, steps, "step %d", steps);
        cr_assert_lt(steps, LIMIT, "the bomb ran to its token limit");
    }
    cr_assert_eq(bomb->done_why, ENG_FINISH_GRAMMAR, "%s", eng_finish_name(bomb->done_why));
    cr_assert_str_eq(eng_finish_name(bomb->done_why), "grammar");
    for (int c = 0; c < CHOICES; c++)
        cr_assert_eq(bomb->why[c], ENG_FINISH_GRAMMAR, "choice %d: %s", c,
                     eng_finish_name(bomb->why[c]));
    cr_assert_gt(most, (uint64_t)budget, "the last step took the budget and a step more");
    engine_hold_after(e, 1); /* the neighbour goes on */
    cr_assert_eq(other->generated, steps + 1);
    cr_assert(!other->done);
    eng_engine_stop(e); /* the neighbour ends cancelled */
    wait_free(other);
    wait_free(bomb);
    free(other);
    free(bomb);
    gr_grammar_unref(g);
}

/* 4000 alternatives of two any-bytes and a tail: at the start 4000
 * stacks, and every first byte of the vocabulary advances them all, so
 * the first mask alone takes about 256 x 8000 matcher steps, twice a
 * small vocabulary's budget. Refused where the server compiles it (on
 * its pool), naming the budget, before any engine step could pay for it;
 * a record grammar passes the same check. */
Test(engine_grammar, a_grammar_whose_first_mask_passes_the_budget_is_refused_before_the_engine)
{
    eng_engine *e = start();
    gr_builder *b = gr_builder_new(0);
    enum { ALTS = 4000 };
    gr_expr *alts = malloc(ALTS * sizeof *alts);
    for (int i = 0; i < ALTS; i++) {
        char tail[16];
        snprintf(tail, sizeof tail, "k%d", i);
        gr_expr xs[] = {gr_byte_range(b, 0, 255), gr_byte_range(b, 0, 255), LIT(b, tail)};
        alts[i] = gr_seq(b, xs, 3);
    }
    gr_grammar *wide = NULL, *g = record_grammar();
    char msg[512];
    cr_assert_eq(gr_build(b, gr_alt(b, alts, ALTS), &wide, msg, sizeof msg), QL_OK, "%s", msg);
    free(alts);
    gr_builder_free(b);
    cr_assert_eq(eng_engine_check_grammar(e, wide, msg, sizeof msg), QL_EINVAL);
    cr_assert(strstr(msg, "matcher steps") && strstr(msg, "first token"), "%s", msg);
    cr_assert_eq(eng_engine_check_grammar(e, g, msg, sizeof msg), QL_OK, "%s", msg);
    gr_grammar_unref(wide);
    gr_grammar_unref(g);
    eng_engine_stop(e);
}

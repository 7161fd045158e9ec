/*
 * test_server_choices.c - n, best_of, logprobs, echo, prompt lists, and
 * TGI's best_of, top_n_tokens, decoder_input_details, truncate and
 * typical_p, end to end: the real binary on the tiny random model (a
 * byte-level tokenizer, 260 tokens, <|endoftext|> 259), spoken to over TCP
 * (tests/server_process.h).
 *
 * What is pinned:
 *   - n greedy choices are one answer n times; n sampled choices are the
 *     one-choice answers for seeds s, s + 1, ...; best_of answers with the
 *     candidate of the highest summed logprob among those same seeds;
 *   - the prompt is prefilled once for all its choices (the engine's
 *     prefilled-token counter moves by the prompt's length), the choices
 *     share its KV blocks (the shared and copied counters move by what the
 *     block arithmetic says) and every block is back when they end;
 *   - logprobs agree with themselves across routes and paths: a greedy
 *     token's logprob is the largest of its alternatives, and the logprobs
 *     TGI reports for generated tokens equal those OpenAI's echo reports
 *     when the same tokens are scored as a prompt (one prefill against
 *     step-by-step decodes: within 1e-4);
 *   - a list of prompts answers prompt-major, each prompt as it would
 *     alone; token-id prompts answer as their text does;
 *   - TGI's details carry best_of_sequences, top_tokens, prefill (the
 *     first logprob null) and truncate's shortened prompt;
 *   - special tokens are skipped from the text unless asked, a stop string
 *     is kept when include_stop_str_in_output asks;
 *   - what cannot be done is refused by name (best_of with a stream, a
 *     seed with TGI's best_of, max_tokens 0 without echo, too many
 *     choices).
 */
#include <criterion/criterion.h>
#include <math.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>

#include "tiny_server.h"

TestSuite(choices, .init = ts_setup, .fini = ts_teardown, .timeout = 300);

/* 40 bytes: 40 tokens and more with the tokenizer's few merges, so the
 * prompt fills two KV blocks of 16 and part of a third */
#define LONG_PROMPT "Once upon a time, far away, lived a fox."

/* A counter or gauge of /metrics. */
static double metric(const char *name)
{
    hc_response r;
    cr_assert(hc_request(sp.port, "GET", "/metrics", NULL, NULL, &r));
    cr_assert_eq(r.status, 200);
    char needle[160];
    snprintf(needle, sizeof needle, "\n%s ", name);
    const char *at = strstr(r.body, needle);
    cr_assert(at, "no %s in /metrics", name);
    double v = strtod(at + strlen(needle), NULL);
    hc_response_free(&r);
    return v;
}

/* The engine, held at its gate since it had run `steps` steps, holds no
 * request, running or waiting, and no KV block: what was there was
 * cancelled, since nothing could end by running. */
static void expect_held_and_empty(double steps)
{
    cJSON *st = sp_engine_state(NULL);
    cr_assert_eq(sp_num_at(st, "steps"), steps, "the engine ran a step while held");
    cr_assert_eq(sp_num_at(st, "running"), 0, "a request still runs");
    cr_assert_eq(sp_num_at(st, "waiting"), 0, "a request still waits");
    cJSON_Delete(st);
    cr_assert_eq(metric("qlserve_kv_blocks_used"), 0, "KV blocks still in use");
}

/* Blocks in use go back to 0 (the engine publishes it between steps). */
static void expect_blocks_back(void)
{
    for (int i = 0; i < 200 && metric("qlserve_kv_blocks_used") != 0; i++)
        usleep(10000);
    cr_assert_eq(metric("qlserve_kv_blocks_used"), 0, "KV blocks still in use");
}

static const cJSON *choice_at(const cJSON *j, int i)
{
    const cJSON *c = cJSON_GetArrayItem(cJSON_GetObjectItem(j, "choices"), i);
    cr_assert(c, "no choice %d", i);
    return c;
}

/* The text of completions' choice 0 for body (a copy). */
static char *completion_text(const char *body)
{
    cJSON *j = ts_ok("/v1/completions", body);
    char *t = strdup(sp_str_at(choice_at(j, 0), "text"));
    cJSON_Delete(j);
    return t;
}

Test(choices, n_greedy_choices_share_the_prompts_blocks_and_prefill_it_once)
{
    double prefilled = metric("qlserve_prefilled_tokens_total");
    double shared = metric("qlserve_kv_blocks_shared_total");
    double copied = metric("qlserve_kv_blocks_copied_total");
    cJSON *j = ts_ok("/v1/completions", "{\"prompt\": \"" LONG_PROMPT "\", \"n\": 3, "
                                        "\"max_tokens\": 12, \"temperature\": 0, "
                                        "\"ignore_eos\": true}");
    const cJSON *usage = cJSON_GetObjectItem(j, "usage");
    int prompt = (int)sp_num_at(usage, "prompt_tokens");
    cr_assert_gt(prompt, 32, "the prompt should pass two blocks: %d tokens", prompt);
    cr_assert_eq(sp_num_at(usage, "completion_tokens"), 36);
    cr_assert_eq(cJSON_GetArraySize(cJSON_GetObjectItem(j, "choices")), 3);
    const char *first = sp_str_at(choice_at(j, 0), "text");
    for (int i = 0; i < 3; i++) {
        cr_assert_eq(sp_num_at(choice_at(j, i), "index"), i);
        cr_assert_str_eq(sp_str_at(choice_at(j, i), "text"), first);
        cr_assert_str_eq(sp_str_at(choice_at(j, i), "finish_reason"), "length");
    }
    /* the same as one choice alone */
    char *alone = completion_text("{\"prompt\": \"" LONG_PROMPT "\", \"max_tokens\": 12, "
                                  "\"temperature\": 0, \"ignore_eos\": true}");
    cr_assert_str_eq(alone, first);
    free(alone);
    cJSON_Delete(j);
    /* the first request's prompt once (the second's once more) */
    cr_assert_eq(metric("qlserve_prefilled_tokens_total") - prefilled, 2.0 * prompt);
    /* two forks, each sharing every block the prompt touches; the partly
     * filled last one is copied by all its writers but the last */
    int blocks = (prompt + 15) / 16;
    cr_assert_eq(metric("qlserve_kv_blocks_shared_total") - shared, 2.0 * blocks);
    cr_assert_eq(metric("qlserve_kv_blocks_copied_total") - copied, prompt % 16 ? 2.0 : 0.0);
    expect_blocks_back();
}

Test(choices, sampled_choices_are_the_one_choice_answers_of_successive_seeds)
{
    cJSON *j = ts_ok("/v1/completions", "{\"prompt\": \"Once\", \"n\": 3, \"max_tokens\": 10, "
                                        "\"temperature\": 1, \"seed\": 77, "
                                        "\"ignore_eos\": true}");
    bool differ = false;
    for (int i = 0; i < 3; i++) {
        char body[256];
        snprintf(body, sizeof body,
                 "{\"prompt\": \"Once\", \"max_tokens\": 10, \"temperature\": 1, \"seed\": %d, "
                 "\"ignore_eos\": true}",
                 77 + i);
        char *alone = completion_text(body);
        cr_assert_str_eq(sp_str_at(choice_at(j, i), "text"), alone, "choice %d", i);
        differ |= strcmp(alone, sp_str_at(choice_at(j, 0), "text")) != 0;
        free(alone);
    }
    cr_assert(differ, "three seeds gave one text");
    cJSON_Delete(j);
    expect_blocks_back();
}

/* The sum of a completions choice's token_logprobs. */
static double logprob_sum(const cJSON *choice)
{
    const cJSON *lp =
        cJSON_GetObjectItem(cJSON_GetObjectItem(choice, "logprobs"), "token_logprobs");
    cr_assert(cJSON_IsArray(lp));
    double sum = 0;
    for (const cJSON *v = lp->child; v; v = v->next)
        sum += v->valuedouble;
    return sum;
}

Test(choices, best_of_answers_with_the_likeliest_of_its_candidates)
{
    const char *common = "\"prompt\": \"Once\", \"max_tokens\": 8, \"temperature\": 1.5, "
                         "\"seed\": 5, \"ignore_eos\": true, \"logprobs\": 0";
    char body[512];
    snprintf(body, sizeof body, "{%s, \"n\": 4}", common);
    cJSON *all = ts_ok("/v1/completions", body);
    int best = 0;
    for (int i = 1; i < 4; i++)
        if (logprob_sum(choice_at(all, i)) > logprob_sum(choice_at(all, best)))
            best = i;
    snprintf(body, sizeof body, "{%s, \"best_of\": 4}", common);
    cJSON *one = ts_ok("/v1/completions", body);
    cr_assert_eq(cJSON_GetArraySize(cJSON_GetObjectItem(one, "choices")), 1);
    cr_assert_str_eq(sp_str_at(choice_at(one, 0), "text"), sp_str_at(choice_at(all, best), "text"));
    /* usage counts every candidate's tokens, as OpenAI bills best_of */
    cr_assert_eq(sp_num_at(cJSON_GetObjectItem(one, "usage"), "completion_tokens"), 32);
    cJSON_Delete(all);
    cJSON_Delete(one);
    ts_refused("/v1/completions", "{\"prompt\": \"a\", \"best_of\": 3, \"stream\": true}",
               "cannot be streamed");
    ts_refused("/v1/completions", "{\"prompt\": \"a\", \"n\": 65}", "\"n\"");
    ts_refused("/v1/completions", "{\"prompt\": [\"a\", \"b\", \"c\"], \"n\": 30}",
               "over the server's limit");
    ts_refused("/v1/completions", "{\"prompt\": \"a\", \"max_tokens\": 0}", "needs \"echo\"");
}

Test(choices, completions_logprobs_have_openais_shape_and_greedy_takes_the_top)
{
    cJSON *j = ts_ok("/v1/completions", "{\"prompt\": \"Once upon\", \"max_tokens\": 10, "
                                        "\"temperature\": 0, \"logprobs\": 3, "
                                        "\"ignore_eos\": true}");
    const cJSON *lp = cJSON_GetObjectItem(choice_at(j, 0), "logprobs");
    const cJSON *tokens = cJSON_GetObjectItem(lp, "tokens");
    const cJSON *values = cJSON_GetObjectItem(lp, "token_logprobs");
    const cJSON *tops = cJSON_GetObjectItem(lp, "top_logprobs");
    const cJSON *offsets = cJSON_GetObjectItem(lp, "text_offset");
    cr_assert_eq(cJSON_GetArraySize(tokens), 10);
    cr_assert_eq(cJSON_GetArraySize(values), 10);
    cr_assert_eq(cJSON_GetArraySize(tops), 10);
    cr_assert_eq(cJSON_GetArraySize(offsets), 10);
    double last_offset = -1;
    for (int i = 0; i < 10; i++) {
        double v = cJSON_GetArrayItem(values, i)->valuedouble;
        cr_assert(v <= 0 && v > -50, "logprob %g", v);
        const cJSON *top = cJSON_GetArrayItem(tops, i);
        cr_assert(cJSON_IsObject(top));
        int n = cJSON_GetArraySize(top);
        cr_assert(n >= 1 && n <= 4, "%d alternatives", n);
        double best = -1e9, mass = 0;
        for (const cJSON *t = top->child; t; t = t->next) {
            best = t->valuedouble > best ? t->valuedouble : best;
            mass += exp(t->valuedouble);
        }
        cr_assert(mass <= 1.0 + 1e-6, "alternatives weigh %g", mass);
        cr_assert_float_eq(v, best, 1e-6, "greedy token %d is not the likeliest", i);
        double off = cJSON_GetArrayItem(offsets, i)->valuedouble;
        cr_assert(off >= last_offset, "text_offset goes back");
        last_offset = off;
    }
    cr_assert_eq(cJSON_GetArrayItem(offsets, 0)->valuedouble, 0);
    cJSON_Delete(j);
}

/* The ids of text as /tokenize gives them, into ids; their count. */
static int tokenize(const char *text, int32_t *ids, int cap)
{
    char body[512];
    snprintf(body, sizeof body, "{\"inputs\": \"%s\"}", text);
    cJSON *j = ts_ok("/tokenize", body);
    int n = 0;
    for (const cJSON *t = j->child; t && n < cap; t = t->next)
        ids[n++] = (int32_t)sp_num_at(t, "id");
    cJSON_Delete(j);
    return n;
}

Test(choices, generated_logprobs_equal_the_same_tokens_scored_as_a_prompt)
{
    /* TGI: greedy tokens with their ids and logprobs */
    cJSON *g = ts_ok("/generate", "{\"inputs\": \"Once upon\", \"parameters\": "
                                  "{\"max_new_tokens\": 6, \"details\": true, "
                                  "\"decoder_input_details\": true}}");
    const cJSON *details = cJSON_GetObjectItem(g, "details");
    const cJSON *gen = cJSON_GetObjectItem(details, "tokens");
    const cJSON *prefill = cJSON_GetObjectItem(details, "prefill");
    int32_t ids[64];
    int n = tokenize("Once upon", ids, 64);
    cr_assert_eq(cJSON_GetArraySize(prefill), n, "prefill lists the prompt's tokens");
    cr_assert(cJSON_IsNull(cJSON_GetObjectItem(cJSON_GetArrayItem(prefill, 0), "logprob")));
    int k = cJSON_GetArraySize(gen);
    cr_assert(k >= 1);
    for (int i = 0; i < k; i++)
        ids[n + i] = (int32_t)sp_num_at(cJSON_GetArrayItem(gen, i), "id");
    /* OpenAI: the prompt and those tokens as ids, echoed and scored */
    char body[2048] = "{\"prompt\": [";
    for (int i = 0; i < n + k; i++)
        snprintf(body + strlen(body), sizeof body - strlen(body), "%s%d", i ? ", " : "", ids[i]);
    strcat(body, "], \"echo\": true, \"logprobs\": 1, \"max_tokens\": 0}");
    cJSON *o = ts_ok("/v1/completions", body);
    const cJSON *lp = cJSON_GetObjectItem(choice_at(o, 0), "logprobs");
    const cJSON *values = cJSON_GetObjectItem(lp, "token_logprobs");
    cr_assert_eq(cJSON_GetArraySize(values), n + k);
    cr_assert(cJSON_IsNull(cJSON_GetArrayItem(values, 0)), "the first token has no logprob");
    cr_assert(cJSON_IsNull(cJSON_GetArrayItem(cJSON_GetObjectItem(lp, "top_logprobs"), 0)));
    for (int i = 1; i < n; i++) /* the prompt's, both ways */
        cr_assert_float_eq(cJSON_GetArrayItem(values, i)->valuedouble,
                           sp_num_at(cJSON_GetArrayItem(prefill, i), "logprob"), 1e-4,
                           "prompt token %d", i);
    for (int i = 0; i < k; i++)
        cr_assert_float_eq(cJSON_GetArrayItem(values, n + i)->valuedouble,
                           sp_num_at(cJSON_GetArrayItem(gen, i), "logprob"), 1e-4,
                           "generated token %d", i);
    cr_assert_eq(sp_num_at(cJSON_GetObjectItem(o, "usage"), "completion_tokens"), 0);
    cr_assert_str_eq(sp_str_at(choice_at(o, 0), "finish_reason"), "length");
    cJSON_Delete(g);
    cJSON_Delete(o);
}

Test(choices, a_list_of_prompts_answers_prompt_major_each_as_alone)
{
    cJSON *j = ts_ok("/v1/completions", "{\"prompt\": [\"Once\", \"the then\"], \"n\": 2, "
                                        "\"max_tokens\": 6, \"temperature\": 0}");
    cr_assert_eq(cJSON_GetArraySize(cJSON_GetObjectItem(j, "choices")), 4);
    char *a = completion_text("{\"prompt\": \"Once\", \"max_tokens\": 6, \"temperature\": 0}");
    char *b = completion_text("{\"prompt\": \"the then\", \"max_tokens\": 6, \"temperature\": 0}");
    for (int i = 0; i < 4; i++) {
        cr_assert_eq(sp_num_at(choice_at(j, i), "index"), i);
        cr_assert_str_eq(sp_str_at(choice_at(j, i), "text"), i < 2 ? a : b, "choice %d", i);
    }
    /* token ids answer as their text does */
    int32_t ids[32];
    int n = tokenize("the then", ids, 32);
    char body[512] = "{\"prompt\": [";
    for (int i = 0; i < n; i++)
        snprintf(body + strlen(body), sizeof body - strlen(body), "%s%d", i ? ", " : "", ids[i]);
    strcat(body, "], \"max_tokens\": 6, \"temperature\": 0}");
    char *c = completion_text(body);
    cr_assert_str_eq(c, b);
    free(a);
    free(b);
    free(c);
    cJSON_Delete(j);
    ts_refused("/v1/completions", "{\"prompt\": [\"a\", [1, 2]]}", "one kind");
    ts_refused("/v1/completions", "{\"prompt\": [1, -2]}", "item 1 is not a token id");
    ts_refused("/v1/completions", "{\"prompt\": [[]]}", "is empty");
    /* one prompt of several refused by the engine: the one already
     * submitted (prompt 0) is cancelled; the engine is held at its gate,
     * where it cannot end by itself, and after the refusal nothing runs
     * or waits there and no block is in use */
    sp_hold_after(0, NULL);
    double steps = sp_engine_figure("steps", NULL);
    ts_refused("/v1/completions",
               "{\"prompt\": [[65, 66], [65, 99999], [67]], \"max_tokens\": 300, \"echo\": true}",
               "prompt 1:");
    sp_hold_after(0, NULL);
    expect_held_and_empty(steps);
    sp_hold_after(-1, NULL);
}

Test(choices, chat_answers_n_choices_with_logprobs_whole_and_streamed)
{
    cJSON *j = ts_ok("/v1/chat/completions",
                     "{\"messages\": [{\"role\": \"user\", \"content\": \"Once\"}], "
                     "\"n\": 2, \"max_tokens\": 5, \"temperature\": 0, \"logprobs\": true, "
                     "\"top_logprobs\": 2, \"ignore_eos\": true}");
    for (int i = 0; i < 2; i++) {
        const cJSON *content =
            cJSON_GetObjectItem(cJSON_GetObjectItem(choice_at(j, i), "logprobs"), "content");
        cr_assert_eq(cJSON_GetArraySize(content), 5);
        for (const cJSON *e = content->child; e; e = e->next) {
            cr_assert(cJSON_IsString(cJSON_GetObjectItem(e, "token")));
            cr_assert(cJSON_IsArray(cJSON_GetObjectItem(e, "bytes")));
            const cJSON *top = cJSON_GetObjectItem(e, "top_logprobs");
            cr_assert_eq(cJSON_GetArraySize(top), 2);
            cr_assert_float_eq(sp_num_at(e, "logprob"), sp_num_at(top->child, "logprob"), 1e-6);
        }
    }
    cJSON_Delete(j);
    char *events[64];
    int n = sp_stream_events("/v1/chat/completions",
                             "{\"messages\": [{\"role\": \"user\", \"content\": \"Once\"}], "
                             "\"n\": 2, \"max_tokens\": 4, \"temperature\": 0, "
                             "\"stream\": true, \"ignore_eos\": true}",
                             events, 64);
    int roles[2] = {0}, finishes[2] = {0};
    for (int i = 0; i < n - 1; i++) {
        cJSON *e = sp_json(events[i]);
        const cJSON *c = choice_at(e, 0);
        int index = (int)sp_num_at(c, "index");
        cr_assert(index == 0 || index == 1);
        const cJSON *delta = cJSON_GetObjectItem(c, "delta");
        if (cJSON_GetObjectItem(delta, "role"))
            cr_assert_eq(finishes[index] + roles[index]++, 0, "role first, once");
        if (cJSON_IsString(cJSON_GetObjectItem(c, "finish_reason")))
            finishes[index]++;
        cJSON_Delete(e);
    }
    cr_assert_str_eq(events[n - 1], "[DONE]");
    cr_assert(roles[0] == 1 && roles[1] == 1 && finishes[0] == 1 && finishes[1] == 1);
    for (int i = 0; i < n; i++)
        free(events[i]);
    expect_blocks_back();
}

Test(choices, tgi_reports_best_of_sequences_top_tokens_and_a_truncated_prefill)
{
    cJSON *j = ts_ok("/generate", "{\"inputs\": \"Once upon\", \"parameters\": "
                                  "{\"max_new_tokens\": 5, \"details\": true, "
                                  "\"do_sample\": true, \"best_of\": 3, "
                                  "\"top_n_tokens\": 2, \"typical_p\": 0.95}}");
    const cJSON *d = cJSON_GetObjectItem(j, "details");
    const cJSON *others = cJSON_GetObjectItem(d, "best_of_sequences");
    cr_assert_eq(cJSON_GetArraySize(others), 2);
    int tokens = cJSON_GetArraySize(cJSON_GetObjectItem(d, "tokens"));
    const cJSON *top = cJSON_GetObjectItem(d, "top_tokens");
    cr_assert_eq(cJSON_GetArraySize(top), tokens);
    for (const cJSON *t = top->child; t; t = t->next)
        cr_assert_eq(cJSON_GetArraySize(t), 2);
    for (const cJSON *o = others->child; o; o = o->next)
        cr_assert(cJSON_IsString(cJSON_GetObjectItem(o, "generated_text")));
    cJSON_Delete(j);
    /* truncate keeps the prompt's last tokens */
    j = ts_ok("/generate", "{\"inputs\": \"Once upon a time\", \"parameters\": "
                           "{\"max_new_tokens\": 2, \"details\": true, \"truncate\": 3, "
                           "\"decoder_input_details\": true}}");
    cr_assert_eq(
        cJSON_GetArraySize(cJSON_GetObjectItem(cJSON_GetObjectItem(j, "details"), "prefill")), 3);
    cJSON_Delete(j);
    ts_refused("/generate_stream",
               "{\"inputs\": \"a\", \"parameters\": {\"best_of\": 2, "
               "\"do_sample\": true}}",
               "cannot be streamed");
    ts_refused("/generate", "{\"inputs\": \"a\", \"parameters\": {\"best_of\": 2}}",
               "needs sampling");
    ts_refused("/generate",
               "{\"inputs\": \"a\", \"parameters\": {\"best_of\": 2, "
               "\"do_sample\": true, \"seed\": 1}}",
               "parameters.seed");
    ts_refused("/generate", "{\"inputs\": \"a\", \"parameters\": {\"watermark\": true}}",
               "watermark");
    expect_blocks_back();
}

Test(choices, special_tokens_are_skipped_unless_asked_and_stop_strings_kept_when_asked)
{
    /* +100 on EOS: every token is EOS, kept by ignore_eos */
    const char *eos = "\"prompt\": \"Once\", \"max_tokens\": 3, \"temperature\": 0, "
                      "\"ignore_eos\": true, \"logit_bias\": {\"259\": 100}";
    char body[512];
    snprintf(body, sizeof body, "{%s}", eos);
    char *skipped = completion_text(body);
    cr_assert_str_eq(skipped, "");
    snprintf(body, sizeof body, "{%s, \"skip_special_tokens\": false}", eos);
    char *kept = completion_text(body);
    cr_assert_str_eq(kept, "<|endoftext|><|endoftext|><|endoftext|>");
    free(skipped);
    free(kept);
    /* a stop string inside the greedy answer (only the letters a, b, c, x
     * allowed, so it is plain ASCII): dropped, or kept when asked */
    char bias[4096] = "";
    for (int id = 0; id < 260; id++)
        if (id >= 256 || !strchr("abcx", id) || id == 0)
            snprintf(bias + strlen(bias), sizeof bias - strlen(bias), "%s\"%d\": -100",
                     bias[0] ? ", " : "", id);
    char big[8192];
    snprintf(big, sizeof big,
             "{\"prompt\": \"Once\", \"max_tokens\": 12, \"temperature\": 0, \"ignore_eos\": "
             "true, \"logit_bias\": {%s}}",
             bias);
    char *plain = completion_text(big);
    cr_assert_eq(strlen(plain), 12, "\"%s\"", plain);
    char stop[3] = {plain[4], plain[5], 0};
    snprintf(big, sizeof big,
             "{\"prompt\": \"Once\", \"max_tokens\": 12, \"temperature\": 0, \"ignore_eos\": "
             "true, \"logit_bias\": {%s}, \"stop\": \"%s\", \"include_stop_str_in_output\": "
             "%s}",
             bias, stop, "true");
    char *with = completion_text(big);
    const char *at = strstr(plain, stop);
    cr_assert_eq(strlen(with), (size_t)(at - plain) + 2, "\"%s\" for stop \"%s\" in \"%s\"", with,
                 stop, plain);
    cr_assert(strncmp(with, plain, strlen(with)) == 0);
    snprintf(big + strlen(big) - 5, 7, "false}");
    char *without = completion_text(big);
    cr_assert_eq(strlen(without), (size_t)(at - plain), "\"%s\"", without);
    free(without);
    free(with);
    free(plain);
}

/* The choices are held running at the engine's gate (the prompt prefilled,
 * tokens generated, blocks taken) when the client leaves: the blocks come
 * back while the engine is still held, so by the cancel, not by the
 * choices ending. */
Test(choices, a_client_leaving_a_stream_of_choices_frees_their_blocks)
{
    sp_hold_after(0, NULL);
    double cancelled = metric("qlserve_cancelled_total");
    hc_conn c;
    hc_response r = {0};
    cr_assert(hc_open(&c, sp.port));
    cr_assert(hc_send_request(&c, "POST", "/v1/completions", NULL,
                              "{\"prompt\": \"" LONG_PROMPT "\", \"n\": 3, \"max_tokens\": 400, "
                              "\"stream\": true, \"ignore_eos\": true}"));
    cr_assert(hc_read_head(&c, &r));
    cr_assert_eq(r.status, 200);
    sp_engine_reaches("running", 1, NULL);
    /* the prefill, then a step of the three choices */
    sp_hold_after(2, NULL);
    cJSON *st = sp_engine_state(NULL);
    double steps = sp_num_at(st, "steps");
    cr_assert_eq(sp_num_at(st, "running"), 3, "the choices do not run");
    cr_assert_geq(sp_num_at(st, "tokens_generated"), 3, "the choices have not begun");
    cJSON_Delete(st);
    cr_assert_gt(metric("qlserve_kv_blocks_used"), 0);
    hc_response_free(&r);
    hc_close(&c);
    /* the server sees the client go, then the engine takes the cancel in */
    for (int i = 0; i < 10000 && metric("qlserve_cancelled_total") == cancelled; i++)
        usleep(1000); /* a bound for a broken server, not a timing */
    cr_assert_eq(metric("qlserve_cancelled_total"), cancelled + 1,
                 "the client's leaving was not seen");
    sp_hold_after(0, NULL);
    expect_held_and_empty(steps);
    sp_hold_after(-1, NULL);
}

/* The text of a stream's chunks of choice 0, joined (a copy). */
static char *streamed_text(const char *path, const char *body, bool chat)
{
    char *events[512];
    int n = sp_stream_events(path, body, events, 512);
    size_t cap = 4096, len = 0;
    char *out = calloc(1, cap);
    for (int i = 0; i < n; i++) {
        if (strcmp(events[i], "[DONE]") != 0) {
            cJSON *e = sp_json(events[i]);
            const cJSON *c = cJSON_GetArrayItem(cJSON_GetObjectItem(e, "choices"), 0);
            const cJSON *t = chat ? cJSON_GetObjectItem(cJSON_GetObjectItem(c, "delta"), "content")
                                  : cJSON_GetObjectItem(c, "text");
            if (cJSON_IsString(t) && len + strlen(t->valuestring) < cap) {
                memcpy(out + len, t->valuestring, strlen(t->valuestring));
                len += strlen(t->valuestring);
            }
            cJSON_Delete(e);
        }
        free(events[i]);
    }
    return out;
}

Test(choices, whole_answers_equal_their_streams_joined_bytes_and_all)
{
    /* the random model's greedy bytes are often not UTF-8: the engine
     * shows them as U+FFFD, held back to the end when incomplete (NUL
     * banned here: cJSON, which reads these answers, ends a string there;
     * it has its own test below) */
    const char *base = "\"max_tokens\": 40, \"temperature\": 0, \"ignore_eos\": true, "
                       "\"logit_bias\": {\"0\": -100}";
    char body[512];
    snprintf(body, sizeof body, "{\"prompt\": \"Once upon\", %s}", base);
    char *whole = completion_text(body);
    snprintf(body, sizeof body, "{\"prompt\": \"Once upon\", %s, \"stream\": true}", base);
    char *joined = streamed_text("/v1/completions", body, false);
    cr_assert_str_eq(whole, joined);
    free(whole);
    free(joined);
    snprintf(body, sizeof body, "{\"messages\": [{\"role\": \"user\", \"content\": \"Once\"}], %s}",
             base);
    cJSON *j = ts_ok("/v1/chat/completions", body);
    char *content = strdup(sp_str_at(cJSON_GetObjectItem(choice_at(j, 0), "message"), "content"));
    cJSON_Delete(j);
    snprintf(body, sizeof body,
             "{\"messages\": [{\"role\": \"user\", \"content\": \"Once\"}], %s, \"stream\": true}",
             base);
    joined = streamed_text("/v1/chat/completions", body, true);
    cr_assert_str_eq(content, joined);
    free(content);
    free(joined);
}

Test(choices, a_nul_byte_in_the_text_is_sent_as_an_escape_not_an_end)
{
    /* +100 on the byte token 0: every token is NUL */
    const char *bodies[][2] = {
        {"/v1/completions", "{\"prompt\": \"Once\", \"max_tokens\": 3, \"temperature\": 0, "
                            "\"logit_bias\": {\"0\": 100}}"},
        {"/v1/chat/completions",
         "{\"messages\": [{\"role\": \"user\", \"content\": \"a\"}], "
         "\"max_tokens\": 3, \"temperature\": 0, \"logit_bias\": {\"0\": 100}}"},
    };
    for (size_t i = 0; i < sizeof bodies / sizeof *bodies; i++) {
        int status;
        char *raw = sp_answer(bodies[i][0], bodies[i][1], &status);
        cr_assert_eq(status, 200, "%s", raw);
        cr_assert(strstr(raw, "\"\\u0000\\u0000\\u0000\""), "%s: %s", bodies[i][0], raw);
        free(raw);
    }
}

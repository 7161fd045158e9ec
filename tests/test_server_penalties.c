/*
 * test_server_penalties.c - OpenAI's presence_penalty, frequency_penalty and
 * logit_bias, vLLM's min_tokens and ignore_eos, and TGI's frequency_penalty,
 * end to end: the real binary on the tiny random model (a byte-level
 * tokenizer: 256 byte tokens, three merges of " ", "t", "h", "e", and
 * <|endoftext|> 259), spoken to over TCP (tests/server_process.h).
 *
 * What is pinned: with byte tokens the text is the concatenation of the
 * tokens' bytes, so a byte token banned by logit_bias is out of the greedy
 * answer exactly when its byte is out of the text; +100 on EOS ends the
 * answer at once, min_tokens holds it back that many tokens (and keeps a
 * stop string from ending the answer before them, as vLLM v1), ignore_eos
 * runs to max_tokens; a large frequency_penalty changes TGI's greedy token
 * ids and no id repeats more often than without it; and every refusal
 * names the field and the value.
 */
#include <criterion/criterion.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>

#include "tiny_server.h"

TestSuite(penalties, .init = ts_setup, .fini = ts_teardown, .timeout = 300);

#define PROMPT "Once upon a time"
#define EOS_ID 259

/* The first choice's text of a /v1/completions answer (a copy) and its
 * finish_reason and completion_tokens. */
static char *completion(const char *body, char *finish, size_t finish_len, int *tokens)
{
    cJSON *j = ts_ok("/v1/completions", body);
    const cJSON *choice = cJSON_GetArrayItem(cJSON_GetObjectItem(j, "choices"), 0);
    char *text = strdup(sp_str_at(choice, "text"));
    if (finish)
        snprintf(finish, finish_len, "%s", sp_str_at(choice, "finish_reason"));
    if (tokens)
        *tokens = (int)sp_num_at(cJSON_GetObjectItem(j, "usage"), "completion_tokens");
    cJSON_Delete(j);
    return text;
}

/* A logit_bias object banning every byte token but those in `allowed`,
 * the three merges and EOS (257 entries at most), appended to out. */
static void ban_all_but(char *out, size_t cap, const char *allowed)
{
    size_t n = strlen(out);
    n += (size_t)snprintf(out + n, cap - n, "{");
    bool first = true;
    for (int id = 0; id < 260; id++) {
        if (id < 256 && strchr(allowed, id) && id != 0)
            continue;
        n += (size_t)snprintf(out + n, cap - n, "%s\"%d\": -100", first ? "" : ", ", id);
        first = false;
    }
    snprintf(out + n, cap - n, "}");
    cr_assert(n + 2 < cap);
}

Test(penalties, logit_bias_bans_keep_byte_tokens_out_of_greedy_text)
{
    /* the unbiased answer uses more than "abcx" */
    char *plain = completion("{\"prompt\": \"" PROMPT "\", \"max_tokens\": 24, \"temperature\": 0}",
                             NULL, 0, NULL);
    cr_assert(strspn(plain, "abcx") < strlen(plain), "unbiased answer \"%s\"", plain);

    /* every byte token but a, b, c, x banned: only those letters come */
    char body[8192] =
        "{\"prompt\": \"" PROMPT "\", \"max_tokens\": 24, \"temperature\": 0, \"logit_bias\": ";
    ban_all_but(body, sizeof body, "abcx");
    strcat(body, "}");
    int tokens = 0;
    char *only = completion(body, NULL, 0, &tokens);
    cr_assert_eq(tokens, 24);
    cr_assert_eq(strlen(only), 24, "\"%s\"", only);
    cr_assert_eq(strspn(only, "abcx"), 24, "\"%s\" has other bytes", only);

    /* one more ban: the letter the restricted answer uses most is gone */
    int count[256] = {0};
    for (const char *p = only; *p; p++)
        count[(unsigned char)*p]++;
    int most = 'a';
    for (int ch = 0; ch < 256; ch++)
        if (count[ch] > count[most])
            most = ch;
    char allowed[5] = "", *w = allowed;
    for (const char *p = "abcx"; *p; p++)
        if (*p != most)
            *w++ = *p;
    *w = 0;
    cr_assert_eq(strlen(allowed), 3);
    char body2[8192] =
        "{\"prompt\": \"" PROMPT "\", \"max_tokens\": 24, \"temperature\": 0, \"logit_bias\": ";
    ban_all_but(body2, sizeof body2, allowed);
    strcat(body2, "}");
    char *fewer = completion(body2, NULL, 0, NULL);
    cr_assert_null(strchr(fewer, most), "'%c' banned, yet \"%s\"", most, fewer);
    cr_assert_eq(strspn(fewer, allowed), strlen(fewer), "\"%s\" outside \"%s\"", fewer, allowed);
    free(plain);
    free(only);
    free(fewer);
}

Test(penalties, eos_bias_min_tokens_and_ignore_eos)
{
    char finish[32];
    int tokens = -1;
    /* +100 on EOS: the answer ends at once */
    char *text = completion("{\"prompt\": \"" PROMPT "\", \"max_tokens\": 8, \"temperature\": 0, "
                            "\"logit_bias\": {\"259\": 100}}",
                            finish, sizeof finish, &tokens);
    cr_assert_str_eq(finish, "stop");
    cr_assert_eq(tokens, 0);
    cr_assert_str_eq(text, "");
    free(text);
    /* min_tokens 5: five tokens first, then EOS */
    text = completion("{\"prompt\": \"" PROMPT "\", \"max_tokens\": 8, \"temperature\": 0, "
                      "\"min_tokens\": 5, \"logit_bias\": {\"259\": 100}}",
                      finish, sizeof finish, &tokens);
    cr_assert_str_eq(finish, "stop");
    cr_assert_eq(tokens, 5);
    free(text);
    /* ignore_eos: EOS is chosen every time and never ends the answer */
    text = completion("{\"prompt\": \"" PROMPT "\", \"max_tokens\": 6, \"temperature\": 0, "
                      "\"ignore_eos\": true, \"logit_bias\": {\"259\": 100}}",
                      finish, sizeof finish, &tokens);
    cr_assert_str_eq(finish, "length");
    cr_assert_eq(tokens, 6);
    free(text);
    /* a stop string cannot end the answer before min_tokens (vLLM v1:
     * only once more than min_tokens tokens are out) */
    text = completion("{\"prompt\": \"" PROMPT "\", \"max_tokens\": 8, \"temperature\": 0, "
                      "\"stop\": \"a\", \"logit_bias\": {\"97\": 100}}",
                      finish, sizeof finish, &tokens);
    cr_assert_str_eq(finish, "stop");
    cr_assert_str_eq(text, "");
    free(text);
    text = completion("{\"prompt\": \"" PROMPT "\", \"max_tokens\": 8, \"temperature\": 0, "
                      "\"stop\": \"a\", \"min_tokens\": 3, \"logit_bias\": {\"97\": 100}}",
                      finish, sizeof finish, &tokens);
    cr_assert_str_eq(finish, "stop");
    cr_assert_str_eq(text, "aaa");
    free(text);
    /* the chat route takes them too */
    cJSON *j = ts_ok("/v1/chat/completions",
                     "{\"messages\": [{\"role\": \"user\", \"content\": \"hi\"}], "
                     "\"max_tokens\": 4, \"temperature\": 0, \"ignore_eos\": true, "
                     "\"min_tokens\": 4, \"presence_penalty\": 1.5, \"frequency_penalty\": "
                     "-0.5, \"logit_bias\": {\"259\": 100}}");
    const cJSON *choice = cJSON_GetArrayItem(cJSON_GetObjectItem(j, "choices"), 0);
    cr_assert_str_eq(sp_str_at(choice, "finish_reason"), "length");
    cr_assert_eq((int)sp_num_at(cJSON_GetObjectItem(j, "usage"), "completion_tokens"), 4);
    cJSON_Delete(j);
}

/* TGI's greedy token ids for PROMPT (details), with the given extra
 * parameters; how many there are in *n (at most cap). */
static void tgi_ids(const char *extra, int *ids, int cap, int *n)
{
    char body[512];
    snprintf(body, sizeof body,
             "{\"inputs\": \"" PROMPT "\", \"parameters\": {\"max_new_tokens\": %d, "
             "\"details\": true%s}}",
             cap, extra);
    cJSON *j = ts_ok("/generate", body);
    const cJSON *toks = cJSON_GetObjectItem(cJSON_GetObjectItem(j, "details"), "tokens");
    *n = 0;
    const cJSON *t;
    cJSON_ArrayForEach (t, toks)
        ids[(*n)++] = (int)sp_num_at(t, "id");
    cJSON_Delete(j);
}

static int most_repeats(const int *ids, int n)
{
    int most = 0;
    for (int i = 0; i < n; i++) {
        int c = 0;
        for (int k = 0; k < n; k++)
            c += ids[k] == ids[i];
        most = c > most ? c : most;
    }
    return most;
}

Test(penalties, frequency_penalty_changes_greedy_tokens_and_repeats_no_more)
{
    int plain[40], pen[40], n_plain, n_pen;
    tgi_ids("", plain, 40, &n_plain);
    tgi_ids(", \"frequency_penalty\": 2.0", pen, 40, &n_pen);
    cr_assert(n_plain > 1 && n_pen > 1);
    bool differ = n_plain != n_pen;
    for (int i = 0; i < n_plain && i < n_pen; i++)
        differ |= plain[i] != pen[i];
    cr_assert(differ, "frequency_penalty 2 gave the unpenalised tokens");
    int r_plain = most_repeats(plain, n_plain), r_pen = most_repeats(pen, n_pen);
    cr_assert(r_pen <= r_plain, "a token repeats %d times penalised, %d without", r_pen, r_plain);
    cr_assert(r_plain > 1, "the unpenalised answer repeats no token: the test shows nothing");

    /* the first token is never penalised (nothing generated before it) */
    cr_assert_eq(pen[0], plain[0]);

    /* OpenAI's route: the same penalty changes the text too */
    char *a = completion("{\"prompt\": \"" PROMPT "\", \"max_tokens\": 40, \"temperature\": 0}",
                         NULL, 0, NULL);
    char *b = completion("{\"prompt\": \"" PROMPT "\", \"max_tokens\": 40, \"temperature\": 0, "
                         "\"frequency_penalty\": 2}",
                         NULL, 0, NULL);
    cr_assert(strcmp(a, b) != 0, "\"%s\" unchanged", a);
    free(a);
    free(b);
}

Test(penalties, refusals_name_the_field_and_the_value)
{
    const char *c = "/v1/completions";
    ts_refused(c, "{\"prompt\": \"x\", \"presence_penalty\": 2.5}", "\"presence_penalty\" is 2.5");
    ts_refused(c, "{\"prompt\": \"x\", \"frequency_penalty\": -3}", "\"frequency_penalty\" is -3");
    ts_refused(c, "{\"prompt\": \"x\", \"logit_bias\": [1]}", "\"logit_bias\" must be an object");
    ts_refused(c, "{\"prompt\": \"x\", \"logit_bias\": {\"abc\": 1}}",
               "key \"abc\" is not a token id");
    ts_refused(c, "{\"prompt\": \"x\", \"logit_bias\": {\"-1\": 1}}", "key \"-1\"");
    ts_refused(c, "{\"prompt\": \"x\", \"logit_bias\": {\"260\": 1}}",
               "token id 260 is outside the vocabulary of 260");
    ts_refused(c, "{\"prompt\": \"x\", \"logit_bias\": {\"5\": -101}}", "token 5 is -101");
    ts_refused(c, "{\"prompt\": \"x\", \"logit_bias\": {\"5\": \"big\"}}", "token 5 is \"big\"");
    ts_refused(c, "{\"prompt\": \"x\", \"logit_bias\": {\"5\": 1, \"05\": 2}}",
               "names token id 5 twice");
    ts_refused(c, "{\"prompt\": \"x\", \"min_tokens\": -1}", "\"min_tokens\" is -1");
    ts_refused(c, "{\"prompt\": \"x\", \"min_tokens\": 17}", "\"min_tokens\" is 17");
    ts_refused(c, "{\"prompt\": \"x\", \"ignore_eos\": 1}", "\"ignore_eos\" must be true or false");
    /* every token of the vocabulary named once is fine (the limit of 300
     * entries, OpenAI's, is pinned in test_sampler.c: this vocabulary
     * cannot name 301 distinct tokens) */
    char body[8192] = "{\"prompt\": \"x\", \"logit_bias\": {";
    for (int id = 0; id < 260; id++)
        snprintf(body + strlen(body), sizeof body - strlen(body), "%s\"%d\": 0", id ? ", " : "",
                 id);
    strcat(body, "}}");
    int status;
    char *text = sp_answer(c, body, &status);
    cr_assert_eq(status, 200, "260 entries: %s", text);
    free(text);
    /* the chat route checks the same way */
    ts_refused("/v1/chat/completions",
               "{\"messages\": [{\"role\": \"user\", \"content\": \"hi\"}], \"logit_bias\": "
               "{\"7\": 100.5}}",
               "token 7 is 100.5");
    /* TGI: frequency_penalty in [-2, 2]; no presence_penalty or logit_bias */
    ts_refused("/generate", "{\"inputs\": \"x\", \"parameters\": {\"frequency_penalty\": 3}}",
               "\"frequency_penalty\" is 3");
    ts_refused("/generate", "{\"inputs\": \"x\", \"parameters\": {\"presence_penalty\": 1}}",
               "presence_penalty");
    ts_refused("/generate", "{\"inputs\": \"x\", \"parameters\": {\"logit_bias\": {}}}",
               "logit_bias");
}

/*
 * logprobs.c - the logprobs of a generation in each API's words: OpenAI
 * completions' {"tokens", "token_logprobs", "top_logprobs", "text_offset"}
 * (the prompt's first with echo), chat's {"content": [{"token", "logprob",
 * "bytes", "top_logprobs"}]}, and the token text both show.
 *
 * What the numbers are: the engine's (scheduler.h, eng_token_event): the
 * log-softmax of the model's raw logits at each step, before logit_bias,
 * penalties and temperature (vLLM's default). A token's text is its own
 * decoding when that is whole UTF-8, else "bytes:" and its bytes as \xNN
 * escapes (vLLM's spelling), since a JSON string cannot hold part of a
 * character; chat's "bytes" carries the raw bytes either way. Completions'
 * top_logprobs hold the asked number of alternatives and the chosen token
 * when it is not among them (vLLM's); chat's hold exactly the asked
 * number. text_offset counts characters (code points) into the answer's
 * text: with echo the prompt's tokens start at 0 and the generated ones at
 * the prompt text's length; without, the generated ones start at 0. A
 * log-probability of minus infinity is sent as -9999.0 (OpenAI's), since
 * JSON has no infinity.
 *
 * Offers srv_logprobs_token_text, srv_logprobs_oai and srv_logprobs_chat
 * (internal/logprobs.h) to the API files. Owns nothing past a
 * call. Touches the tokenizer's decoding and the generation's choices.
 */
#include "internal/logprobs.h"
#include "internal/gen.h"

#include <cjson/cJSON.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

static double shown(float lp)
{
    return isfinite(lp) ? (double)lp : -9999.0;
}

char *srv_logprobs_token_text(const tok_tokenizer *t, int32_t id, cJSON **bytes)
{
    char *raw = NULL;
    size_t len = 0;
    if (bytes)
        *bytes = NULL;
    if (tok_decode(t, &id, 1, false, &raw, &len, NULL, 0) != QL_OK)
        return strdup("");
    if (bytes) {
        *bytes = cJSON_CreateArray();
        for (size_t i = 0; i < len; i++)
            cJSON_AddItemToArray(*bytes, cJSON_CreateNumber((unsigned char)raw[i]));
    }
    if (ql_utf8_invalid_at((const uint8_t *)raw, len) < 0)
        return raw;
    char *out = malloc(6 + 4 * len + 1);
    if (out) {
        size_t n = (size_t)sprintf(out, "bytes:");
        for (size_t i = 0; i < len; i++)
            n += (size_t)sprintf(out + n, "\\x%02x", (unsigned char)raw[i]);
    }
    free(raw);
    return out ? out : strdup("");
}

/* --- OpenAI completions ---------------------------------------------------------- */

/* The four lists, filled one token at a time. */
typedef struct oai_lists {
    cJSON *o, *tokens, *logprobs, *top, *offsets;
} oai_lists;

static oai_lists oai_lists_new(void)
{
    oai_lists l = {.o = cJSON_CreateObject()};
    l.tokens = cJSON_AddArrayToObject(l.o, "tokens");
    l.logprobs = cJSON_AddArrayToObject(l.o, "token_logprobs");
    l.top = cJSON_AddArrayToObject(l.o, "top_logprobs");
    l.offsets = cJSON_AddArrayToObject(l.o, "text_offset");
    return l;
}

/* One token: id with logprob lp (NaN: none, as the prompt's first) and
 * its n_top alternatives (NULL: none), at character offset. */
static void oai_add(const srv_gen *g, oai_lists *l, int32_t id, float lp, const eng_logprob *top,
                    int32_t n_top, size_t offset)
{
    const tok_tokenizer *t = g->s->model.tok;
    char *text = srv_logprobs_token_text(t, id, NULL);
    cJSON_AddItemToArray(l->tokens, cJSON_CreateString(text ? text : ""));
    cJSON_AddItemToArray(l->offsets, cJSON_CreateNumber((double)offset));
    if (isnan(lp)) {
        cJSON_AddItemToArray(l->logprobs, cJSON_CreateNull());
        cJSON_AddItemToArray(l->top, cJSON_CreateNull());
        free(text);
        return;
    }
    cJSON_AddItemToArray(l->logprobs, cJSON_CreateNumber(shown(lp)));
    cJSON *d = cJSON_CreateObject();
    bool chosen_in = false;
    for (int32_t k = 0; top && k < n_top && top[k].token >= 0; k++) {
        char *alt = srv_logprobs_token_text(t, top[k].token, NULL);
        if (alt && !cJSON_GetObjectItemCaseSensitive(d, alt))
            cJSON_AddNumberToObject(d, alt, shown(top[k].logprob));
        chosen_in |= top[k].token == id;
        free(alt);
    }
    if (!chosen_in && text && !cJSON_GetObjectItemCaseSensitive(d, text))
        cJSON_AddNumberToObject(d, text, shown(lp));
    cJSON_AddItemToArray(l->top, d);
    free(text);
}

/* The prompt's tokens (echo): their logprobs, offsets over the texts the
 * tokens decode to one after another. */
static void oai_add_prompt(const srv_gen *g, const srv_gen_part *part, oai_lists *l)
{
    const tok_tokenizer *t = g->s->model.tok;
    tok_stream st = {0};
    char piece[1024];
    size_t offset = 0;
    for (int32_t i = 0; i < part->n_tokens; i++) {
        float lp = part->logprobs ? part->logprobs[i] : NAN;
        const eng_logprob *top = part->top ? part->top + (size_t)i * (size_t)g->top_n : NULL;
        oai_add(g, l, part->tokens[i], lp, top, g->top_n, offset);
        long n = tok_stream_push(t, &st, part->tokens[i], piece, sizeof piece);
        if (n > 0)
            offset += ql_utf8_chars((const uint8_t *)piece, (size_t)n);
    }
}

cJSON *srv_logprobs_oai(const srv_gen *g, int32_t i, size_t from, size_t to, bool echo)
{
    const srv_gen_choice *ch = &g->choices[i];
    const srv_gen_part *part = &g->parts[i / g->per_part];
    oai_lists l = oai_lists_new();
    size_t base = 0; /* the generated text starts after the echoed prompt */
    if (echo) {
        oai_add_prompt(g, part, &l);
        base = part->text ? ql_utf8_chars((const uint8_t *)part->text, strlen(part->text)) : 0;
    }
    for (size_t k = from; k < to && k < ch->n_tokens; k++) {
        const eng_logprob *top = ch->top ? ch->top + k * (size_t)g->top_n : NULL;
        oai_add(g, &l, ch->tokens[k], ch->logprobs[k], top, g->top_n, base + ch->offsets[k]);
    }
    return l.o;
}

/* --- chat ------------------------------------------------------------------------ */

static cJSON *chat_entry(const tok_tokenizer *t, int32_t id, float lp)
{
    cJSON *e = cJSON_CreateObject();
    cJSON *bytes = NULL;
    char *text = srv_logprobs_token_text(t, id, &bytes);
    cJSON_AddStringToObject(e, "token", text ? text : "");
    cJSON_AddNumberToObject(e, "logprob", shown(lp));
    if (bytes)
        cJSON_AddItemToObject(e, "bytes", bytes);
    else
        cJSON_AddNullToObject(e, "bytes");
    free(text);
    return e;
}

cJSON *srv_logprobs_chat(const srv_gen *g, int32_t i, size_t from, size_t to)
{
    const tok_tokenizer *t = g->s->model.tok;
    const srv_gen_choice *ch = &g->choices[i];
    cJSON *o = cJSON_CreateObject();
    cJSON *content = cJSON_AddArrayToObject(o, "content");
    for (size_t k = from; k < to && k < ch->n_tokens; k++) {
        cJSON *e = chat_entry(t, ch->tokens[k], ch->logprobs[k]);
        cJSON *tops = cJSON_AddArrayToObject(e, "top_logprobs");
        const eng_logprob *top = ch->top ? ch->top + k * (size_t)g->top_n : NULL;
        for (int32_t j = 0; top && j < g->top_n && top[j].token >= 0; j++)
            cJSON_AddItemToArray(tops, chat_entry(t, top[j].token, top[j].logprob));
        cJSON_AddItemToArray(content, e);
    }
    cJSON_AddNullToObject(o, "refusal");
    return o;
}

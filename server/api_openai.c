/*
 * api_openai.c - OpenAI's completions API, so its clients work unchanged:
 * POST /v1/completions ("prompt" a string, a list of strings, a list of
 * token ids or a list of lists; n choices each, the best n of best_of by
 * summed logprob; echo; logprobs 0..20 (logprobs.c); "model" names the
 * base model or a loaded adapter; a text_completion answer with usage,
 * its choices prompt-major (index = prompt * n + choice), or one
 * server-sent chunk per piece of text per choice, a finishing chunk per
 * choice, the usage when stream_options.include_usage, and [DONE]) and
 * GET /v1/models (the base model and every loaded adapter).
 * response_format (as vLLM takes it on this route: request.c's
 * srv_req_get_grammar) keeps every choice's text inside a JSON Schema;
 * llama-server's speculative.n_max and speculative.n_min bound the
 * request's drafts (request.c's srv_req_get_speculative), and its usage
 * reports them as OpenAI reports a predicted output's tokens.
 *
 * Offers the route handlers srv_oai_*; owns the OpenAI request fields
 * (the ones it has that this server does not implement are accepted only
 * at their defaults) and the OpenAI answer shapes. Touches request.c's
 * helpers, http.c's stream events, bridge.c's srv_gen_submit and the
 * generation it hands back as tokens arrive, and the adapter registry's
 * list.
 */
#include "internal/api_openai.h"
#include "internal/gen.h"
#include "internal/http.h"
#include "internal/logprobs.h"
#include "internal/pool_job.h"
#include "internal/request.h"

#include <cjson/cJSON.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

/* --- the request ----------------------------------------------------------------- */

/* A token id of a prompt given as ids. */
static bool read_id(srv_conn *c, const cJSON *v, size_t at, int32_t *out)
{
    if (!cJSON_IsNumber(v) || v->valuedouble < 0 || v->valuedouble > INT32_MAX ||
        v->valuedouble != (double)(int32_t)v->valuedouble) {
        srv_req_fail(c, 400, "\"prompt\": item %zu is not a token id (an integer >= 0)", at);
        return false;
    }
    *out = (int32_t)v->valuedouble;
    return true;
}

/* Ids of one list into store from *used; the prompt p points at them. */
static bool read_ids(srv_conn *c, const cJSON *list, int32_t *store, size_t *used,
                     srv_req_prompt *p)
{
    size_t n = (size_t)cJSON_GetArraySize(list), at = 0;
    if (n == 0) {
        srv_req_fail(c, 400, "\"prompt\": a list of token ids is empty");
        return false;
    }
    p->tokens = store + *used;
    p->n_tokens = n;
    for (const cJSON *v = list->child; v; v = v->next)
        if (!read_id(c, v, at++, &store[(*used)++]))
            return false;
    return true;
}

/* "prompt": a string, a list of strings, a list of token ids, or a list of
 * lists of token ids (OpenAI's four forms). */
static bool read_prompts(srv_conn *c, const cJSON *prompt, srv_req_ask *a)
{
    if (cJSON_IsString(prompt)) {
        a->prompt = prompt->valuestring;
        return true;
    }
    size_t n = cJSON_IsArray(prompt) ? (size_t)cJSON_GetArraySize(prompt) : 0;
    if (n == 0) {
        srv_req_fail(c, 400,
                     "\"prompt\" must be a string, or a non-empty list of strings, of token "
                     "ids, or of lists of token ids");
        return false;
    }
    const cJSON *first = prompt->child;
    if (cJSON_IsNumber(first)) { /* one prompt of ids */
        a->token_store = malloc(n * sizeof *a->token_store);
        size_t used = 0;
        a->n_prompts = 1;
        return a->token_store ? read_ids(c, prompt, a->token_store, &used, &a->prompts[0])
                              : (srv_req_fail(c, 503, "out of memory"), false);
    }
    if (n > SRV_MAX_PROMPTS) {
        srv_req_fail(c, 400, "\"prompt\" lists %zu prompts; at most %d", n, SRV_MAX_PROMPTS);
        return false;
    }
    size_t total = 0;
    for (const cJSON *v = first; v; v = v->next) {
        if (cJSON_IsArray(first) ? !cJSON_IsArray(v) : !cJSON_IsString(v)) {
            srv_req_fail(c, 400,
                         "\"prompt\": a list must hold prompts of one kind (strings, or "
                         "lists of token ids)");
            return false;
        }
        total += cJSON_IsArray(v) ? (size_t)cJSON_GetArraySize(v) : 0;
    }
    if (total && !(a->token_store = malloc(total * sizeof *a->token_store))) {
        srv_req_fail(c, 503, "out of memory");
        return false;
    }
    size_t used = 0;
    for (const cJSON *v = first; v; v = v->next) {
        srv_req_prompt *p = &a->prompts[a->n_prompts++];
        if (cJSON_IsString(v))
            p->text = v->valuestring;
        else if (!read_ids(c, v, a->token_store, &used, p))
            return false;
    }
    if (a->n_prompts == 1 && a->prompts[0].text) { /* ["one"] is "one" */
        a->prompt = a->prompts[0].text;
        a->n_prompts = 0;
    }
    return true;
}

/* n, best_of, echo and logprobs. */
static bool read_choices(srv_conn *c, const cJSON *root, srv_req_ask *a, bool stream)
{
    int64_t n = 1, best_of = 0, logprobs = -1;
    bool echo = false, has_best_of = false;
    if (!srv_req_get_int(c, root, "n", 1, SRV_MAX_CHOICES, &n, NULL) ||
        !srv_req_get_int(c, root, "best_of", 1, SRV_MAX_CHOICES, &best_of, &has_best_of) ||
        !srv_req_get_bool(c, root, "echo", &echo) ||
        !srv_req_get_int(c, root, "logprobs", 0, ENG_MAX_LOGPROBS, &logprobs, NULL))
        return false;
    if (has_best_of && best_of < n) {
        srv_req_fail(c, 400, "\"best_of\" (%lld) must be at least \"n\" (%lld)", (long long)best_of,
                     (long long)n);
        return false;
    }
    if (stream && has_best_of && best_of > n) {
        srv_req_fail(c, 400, "\"best_of\" greater than \"n\" cannot be streamed");
        return false;
    }
    size_t prompts = a->n_prompts ? a->n_prompts : 1;
    int64_t per = has_best_of ? best_of : n;
    if ((int64_t)prompts * per > SRV_MAX_CHOICES) {
        srv_req_fail(c, 400, "%zu prompts x %lld choices is over the server's limit of %d", prompts,
                     (long long)per, SRV_MAX_CHOICES);
        return false;
    }
    a->n = (int32_t)n;
    a->best_of = (int32_t)per;
    a->logprobs = logprobs >= 0;
    a->top_logprobs = logprobs >= 0 ? (int32_t)logprobs : 0;
    a->prompt_logprobs = echo && a->logprobs;
    a->prompt_logprobs_field = "\"echo\" with \"logprobs\"";
    a->return_full_text = echo;
    if (a->max_new_tokens == 0) {
        if (!echo) {
            srv_req_fail(c, 400,
                         "\"max_tokens\" 0 needs \"echo\": there would be nothing to answer");
            return false;
        }
        a->prompt_logprobs = true; /* the prompt is scored; nothing is generated */
    }
    return true;
}

/* OpenAI completions. */
static bool parse_oai(srv_conn *c, const cJSON *root, srv_req_ask *a, const char **model,
                      bool *stream)
{
    static const char *const fields[] = {"model",
                                         "prompt",
                                         "max_tokens",
                                         "temperature",
                                         "top_p",
                                         "stop",
                                         "seed",
                                         "stream",
                                         "stream_options",
                                         "n",
                                         "echo",
                                         "logprobs",
                                         "user",
                                         "top_k",
                                         "repetition_penalty",
                                         "presence_penalty",
                                         "frequency_penalty",
                                         "logit_bias",
                                         "min_tokens",
                                         "ignore_eos",
                                         "best_of",
                                         "suffix",
                                         "skip_special_tokens",
                                         "include_stop_str_in_output",
                                         "response_format",
                                         SRV_GUIDED_FIELDS,
                                         SRV_SPECULATIVE_FIELDS,
                                         NULL};
    if (!srv_req_only_known(c, root, "the body", fields))
        return false;
    if (!srv_req_get_string(c, root, "model", model) ||
        !srv_req_get_bool(c, root, "stream", stream))
        return false;
    /* vLLM takes chat's response_format here too */
    if (!srv_req_get_grammar(c, root, "response_format", "response_format", a) ||
        !srv_req_get_guided(c, root, a))
        return false;
    if (!read_prompts(c, cJSON_GetObjectItemCaseSensitive(root, "prompt"), a))
        return false;
    a->max_new_tokens = 16; /* OpenAI's default */
    if (!srv_req_get_int(c, root, "max_tokens", 0, INT32_MAX, &a->max_new_tokens, NULL) ||
        !srv_req_get_sampling(c, root, a, false) || !srv_req_get_stops(c, root, "stop", a) ||
        !read_choices(c, root, a, *stream) || !srv_req_get_vllm_output(c, root, a) ||
        !srv_req_get_speculative(c, root, a))
        return false;
    /* fields that would change the answer are refused, not ignored */
    const cJSON *suffix = cJSON_GetObjectItemCaseSensitive(root, "suffix");
    if (!srv_req_is_null(suffix) && !(cJSON_IsString(suffix) && suffix->valuestring[0] == 0)) {
        srv_req_fail(c, 400, "\"suffix\" (insertion) is not supported by this server");
        return false;
    }
    return srv_oai_stream_options(c, root, a);
}

bool srv_oai_stream_options(srv_conn *c, const cJSON *root, srv_req_ask *a)
{
    const cJSON *so = cJSON_GetObjectItemCaseSensitive(root, "stream_options");
    if (srv_req_is_null(so))
        return true;
    static const char *const fields[] = {"include_usage", NULL};
    if (!cJSON_IsObject(so)) {
        srv_req_fail(c, 400, "\"stream_options\" must be an object");
        return false;
    }
    return srv_req_only_known(c, so, "stream_options", fields) &&
           srv_req_get_bool(c, so, "include_usage", &a->include_usage);
}

/* --- the answer ------------------------------------------------------------------ */

const char *srv_oai_finish(eng_finish f)
{
    switch (f) {
    case ENG_FINISH_EOS:
    case ENG_FINISH_STOP: return "stop";
    case ENG_FINISH_LENGTH: return "length";
    case ENG_FINISH_CANCELLED: return "cancelled";
    case ENG_FINISH_ERROR:
    case ENG_FINISH_GRAMMAR: return "error";
    }
    return "unknown";
}

/* A text_completion object with no choices yet. */
static cJSON *oai_object(const srv_gen *g, cJSON **choices)
{
    cJSON *o = cJSON_CreateObject();
    cJSON_AddStringToObject(o, "id", g->oai_id);
    cJSON_AddStringToObject(o, "object", "text_completion");
    cJSON_AddNumberToObject(o, "created", (double)time(NULL));
    cJSON_AddStringToObject(o, "model", g->model_id);
    *choices = cJSON_AddArrayToObject(o, "choices");
    return o;
}

/* One choice: text, its index, logprobs (consumed; NULL: null), finish. */
static void add_choice(cJSON *choices, int32_t index, const char *text, size_t len, cJSON *logprobs,
                       const char *finish)
{
    cJSON *c = cJSON_CreateObject();
    cJSON_AddItemToObject(c, "text", srv_req_json_text(text, len));
    cJSON_AddNumberToObject(c, "index", index);
    if (logprobs)
        cJSON_AddItemToObject(c, "logprobs", logprobs);
    else
        cJSON_AddNullToObject(c, "logprobs");
    if (finish)
        cJSON_AddStringToObject(c, "finish_reason", finish);
    else
        cJSON_AddNullToObject(c, "finish_reason");
    cJSON_AddItemToArray(choices, c);
}

/* A chunk of one choice. */
static cJSON *oai_chunk(const srv_gen *g, int32_t index, const char *text, size_t len,
                        cJSON *logprobs, const char *finish)
{
    cJSON *choices;
    cJSON *o = oai_object(g, &choices);
    add_choice(choices, index, text, len, logprobs, finish);
    return o;
}

void srv_oai_add_usage(cJSON *o, const eng_usage *u)
{
    cJSON *us = cJSON_AddObjectToObject(o, "usage");
    cJSON_AddNumberToObject(us, "prompt_tokens", u->prompt_tokens);
    cJSON_AddNumberToObject(us, "completion_tokens", u->generated_tokens);
    cJSON_AddNumberToObject(us, "total_tokens", u->prompt_tokens + u->generated_tokens);
    /* OpenAI's own field for prompt tokens served from a cache */
    cJSON *details = cJSON_AddObjectToObject(us, "prompt_tokens_details");
    cJSON_AddNumberToObject(details, "cached_tokens", u->cached_tokens);
    if (u->spec.drafted == 0)
        return; /* it never speculated: the answer an engine without drafts gives */
    /* OpenAI's fields for a predicted output's tokens, which is what a draft is: those the model
     * took, and those it verified and refused */
    details = cJSON_AddObjectToObject(us, "completion_tokens_details");
    cJSON_AddNumberToObject(details, "accepted_prediction_tokens", (double)u->spec.accepted);
    cJSON_AddNumberToObject(details, "rejected_prediction_tokens",
                            (double)(u->spec.drafted - u->spec.accepted));
}

void srv_oai_usage_chunk(srv_conn *c, cJSON *chunk, const eng_usage *u)
{
    cJSON_DeleteItemFromObject(chunk, "choices");
    cJSON_AddArrayToObject(chunk, "choices");
    srv_oai_add_usage(chunk, u);
    srv_req_stream_cjson(c, chunk);
}

/* The whole answer (srv_gen_shape.whole: may run on a pool thread). */
static cJSON *whole_json(const srv_gen *g, const eng_usage *u)
{
    int32_t order[SRV_MAX_CHOICES];
    int32_t n = srv_gen_answer_order(g, order);
    cJSON *choices;
    cJSON *o = oai_object(g, &choices);
    for (int32_t k = 0; k < n; k++) {
        const srv_gen_choice *ch = &g->choices[order[k]];
        size_t len;
        char *full = srv_gen_full_text(g, order[k], &len);
        cJSON *lp = g->logprobs ? srv_logprobs_oai(g, order[k], 0, ch->n_tokens,
                                                   g->return_full_text && g->prompt_logprobs)
                                : NULL;
        add_choice(choices, k, full ? full : "", len, lp, srv_oai_finish(ch->why));
        free(full);
    }
    srv_oai_add_usage(o, u);
    return o;
}

/* A stream's first chunk of choice i: with echo, the prompt (and its
 * logprobs when asked), as vLLM streams it. */
static void open_choice(srv_gen *g, srv_conn *c, int32_t i)
{
    srv_gen_choice *ch = &g->choices[i];
    if (ch->opened)
        return;
    ch->opened = true;
    const srv_gen_part *part = &g->parts[i / g->per_part];
    if (!g->return_full_text || !part->text)
        return;
    cJSON *lp = g->logprobs && g->prompt_logprobs ? srv_logprobs_oai(g, i, 0, 0, true) : NULL;
    srv_req_stream_cjson(c, oai_chunk(g, i, part->text, strlen(part->text), lp, NULL));
}

static void stream_token(srv_gen *g, srv_conn *c, int32_t i, int32_t token, const char *text,
                         size_t len)
{
    open_choice(g, c, i);
    const srv_gen_choice *ch = &g->choices[i];
    cJSON *lp = g->logprobs && token >= 0 && ch->n_tokens
                    ? srv_logprobs_oai(g, i, ch->n_tokens - 1, ch->n_tokens, false)
                    : NULL;
    /* held-back text at the end is a chunk like any other */
    srv_req_stream_cjson(c, oai_chunk(g, i, text, len, lp, NULL));
}

static void stream_done(srv_gen *g, srv_conn *c, eng_finish why, const eng_usage *u)
{
    (void)why; /* each choice's own finish is sent */
    for (int32_t i = 0; i < g->n_choices; i++) {
        open_choice(g, c, i);
        srv_req_stream_cjson(c, oai_chunk(g, i, "", 0, NULL, srv_oai_finish(g->choices[i].why)));
    }
    if (g->include_usage) {
        cJSON *choices;
        srv_oai_usage_chunk(c, oai_object(g, &choices), u);
    }
    srv_http_stream_event(c, "[DONE]", 6);
    srv_http_stream_end(c);
}

static const srv_gen_shape oai_whole = {
    .adapter_noun = "model", .adapter_unknown = SRV_UNKNOWN_MODEL, .whole = whole_json};
static const srv_gen_shape oai_stream = {.stream = true,
                                         .adapter_noun = "model",
                                         .adapter_unknown = SRV_UNKNOWN_MODEL,
                                         .on_token = stream_token,
                                         .on_done = stream_done};

/* --- the routes ------------------------------------------------------------------ */

void srv_oai_completions(srv_conn *c, const char *name)
{
    (void)name;
    cJSON *root = srv_req_body_object(c);
    if (!root)
        return;
    srv_req_ask a = {0};
    const char *model = NULL;
    bool stream = false;
    if (parse_oai(c, root, &a, &model, &stream)) {
        /* the model: the base, or an adapter by its name */
        a.adapter = srv_req_adapter_named(c, model);
        srv_gen_submit(c, &a, stream ? &oai_stream : &oai_whole);
    }
    srv_req_ask_free(&a);
    cJSON_Delete(root);
}

/* A model object of /v1/models: the base model, or an adapter on it. */
static void add_model(cJSON *data, const srv_server *s, const char *id, bool adapter, bool loaded)
{
    cJSON *m = cJSON_CreateObject();
    cJSON_AddStringToObject(m, "id", id);
    cJSON_AddStringToObject(m, "object", "model");
    cJSON_AddNumberToObject(m, "created", (double)(int64_t)s->started_at);
    cJSON_AddStringToObject(m, "owned_by", "qlserve");
    if (adapter) {
        cJSON_AddStringToObject(m, "parent", s->model_id);
        cJSON_AddBoolToObject(m, "loaded", loaded);
    }
    cJSON_AddItemToArray(data, m);
}

/* The list: the base model and the loaded adapters, then, with all, the
 * folders of the adapter folder a request could load by name (lazy
 * loading on). */
static cJSON *models_json(const srv_server *s, bool all)
{
    cJSON *root = cJSON_CreateObject();
    cJSON_AddStringToObject(root, "object", "list");
    cJSON *data = cJSON_AddArrayToObject(root, "data");
    add_model(data, s, s->model_id, false, true);
    lora_info *list = NULL;
    size_t n = 0;
    if (s->registry && lora_registry_list(s->registry, &list, &n) == QL_OK)
        for (size_t i = 0; i < n; i++)
            add_model(data, s, list[i].name, true, true);
    char **names = NULL;
    size_t n_names = 0;
    if (all && s->registry && s->cfg->adapter_dir && !s->cfg->no_lazy_adapters &&
        lora_list_dir(s->cfg->adapter_dir, &names, &n_names, NULL, 0) == QL_OK) {
        for (size_t k = 0; k < n_names; k++) {
            bool loaded = false;
            for (size_t i = 0; i < n && !loaded; i++)
                loaded = strcmp(list[i].name, names[k]) == 0;
            if (!loaded && names[k][0] != '.' && srv_req_is_adapter_name(names[k]))
                add_model(data, s, names[k], true, false);
            free(names[k]);
        }
        free(names);
    }
    free(list);
    return root;
}

static void models_run(srv_pool_job *w)
{
    w->data = models_json(w->s, true);
}

static void models_done(srv_pool_job *w)
{
    if (w->conn)
        srv_req_respond_cjson(w->conn, 200, w->data);
    else
        cJSON_Delete(w->data);
}

/* Whether the request's query string has all=1 or all=true. */
static bool asks_all(const srv_conn *c)
{
    const char *q = c->req.url ? strchr(c->req.url, '?') : NULL;
    while (q && *q) {
        q++; /* past '?' or '&' */
        size_t n = strcspn(q, "&");
        if ((n == 5 && strncmp(q, "all=1", 5) == 0) || (n == 8 && strncmp(q, "all=true", 8) == 0))
            return true;
        q += n;
    }
    return false;
}

/* GET /v1/models; ?all=1 (or true) reads the adapter folder, on the pool. */
void srv_oai_models(srv_conn *c, const char *name)
{
    (void)name;
    bool all = asks_all(c);
    const srv_server *s = c->s;
    /* only a listing that reads the folder goes to the pool */
    if (!all || !s->registry || !s->cfg->adapter_dir || s->cfg->no_lazy_adapters)
        srv_req_respond_cjson(c, 200, models_json(c->s, false));
    else
        srv_pool_begin(c, NULL, models_run, models_done);
}

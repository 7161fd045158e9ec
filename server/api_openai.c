/*
 * api_openai.c - OpenAI's completions API, so its clients work unchanged:
 * POST /v1/completions (one prompt per request; "model" names the base
 * model or a loaded adapter; a text_completion answer with usage, or one
 * server-sent chunk per piece of text, a finishing chunk, the usage when
 * stream_options.include_usage, and [DONE]) and GET /v1/models (the base
 * model and every loaded adapter).
 *
 * Offers the route handlers srv_oai_*; owns the OpenAI request fields
 * (the ones it has that this server does not implement are accepted only
 * at their defaults) and the OpenAI answer shapes. Touches request.c's
 * helpers, http.c's stream events, bridge.c's srv_generate and the
 * generation it hands back as tokens arrive, and the adapter registry's
 * list.
 */
#include "internal/server_internal.h"

#include <stdlib.h>
#include <string.h>
#include <time.h>

/* --- the request ----------------------------------------------------------------- */

/* OpenAI completions. */
static bool parse_oai(srv_conn *c, const cJSON *root, srv_ask *a, const char **model, bool *stream)
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
                                         NULL};
    if (!srv_only_known(c, root, "the body", fields))
        return false;
    if (!srv_get_string(c, root, "model", model) || !srv_get_bool(c, root, "stream", stream))
        return false;
    const cJSON *prompt = cJSON_GetObjectItemCaseSensitive(root, "prompt");
    if (cJSON_IsArray(prompt) && cJSON_GetArraySize(prompt) == 1 &&
        cJSON_IsString(cJSON_GetArrayItem(prompt, 0)))
        prompt = cJSON_GetArrayItem(prompt, 0);
    if (!cJSON_IsString(prompt)) {
        srv_fail(c, 400, "\"prompt\" must be a string (one prompt per request)");
        return false;
    }
    a->prompt = prompt->valuestring;
    a->max_new_tokens = 16; /* OpenAI's default */
    int64_t n = 1;
    bool echo = false;
    if (!srv_get_int(c, root, "max_tokens", 1, INT32_MAX, &a->max_new_tokens, NULL) ||
        !srv_get_sampling(c, root, a, false) || !srv_get_stops(c, root, "stop", a) ||
        !srv_get_int(c, root, "n", 1, 1, &n, NULL) || !srv_get_bool(c, root, "echo", &echo))
        return false;
    const cJSON *lp = cJSON_GetObjectItemCaseSensitive(root, "logprobs");
    if (!srv_is_null(lp) && !(cJSON_IsNumber(lp) && lp->valuedouble == 0)) {
        srv_fail(c, 400, "\"logprobs\" is not supported by this server");
        return false;
    }
    /* fields that would change the answer are refused, not ignored */
    int64_t best_of = 1;
    if (!srv_get_int(c, root, "best_of", 1, 1, &best_of, NULL))
        return false;
    const cJSON *suffix = cJSON_GetObjectItemCaseSensitive(root, "suffix");
    if (!srv_is_null(suffix) && !(cJSON_IsString(suffix) && suffix->valuestring[0] == 0)) {
        srv_fail(c, 400, "\"suffix\" (insertion) is not supported by this server");
        return false;
    }
    if (!srv_oai_stream_options(c, root, a))
        return false;
    a->return_full_text = echo;
    return true;
}

bool srv_oai_stream_options(srv_conn *c, const cJSON *root, srv_ask *a)
{
    const cJSON *so = cJSON_GetObjectItemCaseSensitive(root, "stream_options");
    if (srv_is_null(so))
        return true;
    static const char *const fields[] = {"include_usage", NULL};
    if (!cJSON_IsObject(so)) {
        srv_fail(c, 400, "\"stream_options\" must be an object");
        return false;
    }
    return srv_only_known(c, so, "stream_options", fields) &&
           srv_get_bool(c, so, "include_usage", &a->include_usage);
}

/* --- the answer ------------------------------------------------------------------ */

const char *srv_oai_finish(eng_finish f)
{
    switch (f) {
    case ENG_FINISH_EOS:
    case ENG_FINISH_STOP: return "stop";
    case ENG_FINISH_LENGTH: return "length";
    case ENG_FINISH_CANCELLED: return "cancelled";
    case ENG_FINISH_ERROR: return "error";
    }
    return "unknown";
}

static cJSON *oai_chunk(const srv_gen *g, const char *text, size_t len, const char *finish)
{
    cJSON *o = cJSON_CreateObject();
    cJSON_AddStringToObject(o, "id", g->oai_id);
    cJSON_AddStringToObject(o, "object", "text_completion");
    cJSON_AddNumberToObject(o, "created", (double)time(NULL));
    cJSON_AddStringToObject(o, "model", g->model_id);
    cJSON *choices = cJSON_AddArrayToObject(o, "choices");
    cJSON *c = cJSON_CreateObject();
    char *s = strndup(text ? text : "", len);
    cJSON_AddStringToObject(c, "text", s ? s : "");
    free(s);
    cJSON_AddNumberToObject(c, "index", 0);
    cJSON_AddNullToObject(c, "logprobs");
    if (finish)
        cJSON_AddStringToObject(c, "finish_reason", finish);
    else
        cJSON_AddNullToObject(c, "finish_reason");
    cJSON_AddItemToArray(choices, c);
    return o;
}

void srv_oai_add_usage(cJSON *o, const eng_usage *u)
{
    cJSON *us = cJSON_AddObjectToObject(o, "usage");
    cJSON_AddNumberToObject(us, "prompt_tokens", u->prompt_tokens);
    cJSON_AddNumberToObject(us, "completion_tokens", u->generated_tokens);
    cJSON_AddNumberToObject(us, "total_tokens", u->prompt_tokens + u->generated_tokens);
}

void srv_oai_usage_chunk(srv_conn *c, cJSON *chunk, const eng_usage *u)
{
    cJSON_DeleteItemFromObject(chunk, "choices");
    cJSON_AddArrayToObject(chunk, "choices");
    srv_oai_add_usage(chunk, u);
    srv_stream_cjson(c, chunk);
}

static void whole_done(srv_gen *g, srv_conn *c, const char *full, eng_finish why,
                       const eng_usage *u)
{
    cJSON *o = oai_chunk(g, full, strlen(full), srv_oai_finish(why));
    srv_oai_add_usage(o, u);
    srv_respond_generation(c, o, why);
}

static void stream_token(srv_gen *g, srv_conn *c, int32_t token, const char *text, size_t len)
{
    (void)token; /* held-back text at the end is a chunk like any other */
    srv_stream_cjson(c, oai_chunk(g, text, len, NULL));
}

static void stream_done(srv_gen *g, srv_conn *c, const char *full, eng_finish why,
                        const eng_usage *u)
{
    (void)full; /* the chunks carried it */
    srv_stream_cjson(c, oai_chunk(g, "", 0, srv_oai_finish(why)));
    if (g->include_usage)
        srv_oai_usage_chunk(c, oai_chunk(g, "", 0, NULL), u);
    srv_stream_event(c, "[DONE]", 6);
    srv_stream_end(c);
}

static const srv_shape oai_whole = {
    .adapter_noun = "model", .adapter_unknown = SRV_UNKNOWN_MODEL, .on_done = whole_done};
static const srv_shape oai_stream = {.stream = true,
                                     .adapter_noun = "model",
                                     .adapter_unknown = SRV_UNKNOWN_MODEL,
                                     .on_token = stream_token,
                                     .on_done = stream_done};

/* --- the routes ------------------------------------------------------------------ */

void srv_oai_completions(srv_conn *c, const char *name)
{
    (void)name;
    cJSON *root = srv_body_object(c);
    if (!root)
        return;
    srv_ask a = {0};
    const char *model = NULL;
    bool stream = false;
    if (parse_oai(c, root, &a, &model, &stream)) {
        /* the model: the base, or an adapter by its name */
        a.adapter = srv_adapter_named(c, model);
        srv_generate(c, &a, stream ? &oai_stream : &oai_whole);
    }
    cJSON_Delete(root);
}

void srv_oai_models(srv_conn *c, const char *name)
{
    (void)name;
    srv_server *s = c->s;
    cJSON *root = cJSON_CreateObject();
    cJSON_AddStringToObject(root, "object", "list");
    cJSON *data = cJSON_AddArrayToObject(root, "data");
    cJSON *base = cJSON_CreateObject();
    cJSON_AddStringToObject(base, "id", s->model_id);
    cJSON_AddStringToObject(base, "object", "model");
    cJSON_AddNumberToObject(base, "created", (double)(int64_t)s->started_at);
    cJSON_AddStringToObject(base, "owned_by", "qlserve");
    cJSON_AddItemToArray(data, base);
    lora_info *list = NULL;
    size_t n = 0;
    if (s->registry && lora_registry_list(s->registry, &list, &n) == QL_OK) {
        for (size_t i = 0; i < n; i++) {
            cJSON *m = cJSON_CreateObject();
            cJSON_AddStringToObject(m, "id", list[i].name);
            cJSON_AddStringToObject(m, "object", "model");
            cJSON_AddNumberToObject(m, "created", (double)(int64_t)s->started_at);
            cJSON_AddStringToObject(m, "owned_by", "qlserve");
            cJSON_AddStringToObject(m, "parent", s->model_id);
            cJSON_AddItemToArray(data, m);
        }
    }
    free(list);
    srv_respond_cjson(c, 200, root);
}

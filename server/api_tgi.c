/*
 * api_tgi.c - Text Generation Inference's API, so its clients work
 * unchanged: POST /generate and /generate_stream ({"inputs",
 * "parameters", "stream"} in; {"generated_text", "details"} out, or one
 * server-sent event per token and a last one with the whole text and
 * details) and GET /info.
 *
 * Offers the route handlers srv_tgi_*; owns the TGI request fields (the
 * ones TGI has that this server does not implement are accepted only when
 * off) and the TGI answer shapes. Touches request.c's helpers, http.c's
 * stream end, and bridge.c's srv_generate and the generation it hands
 * back as tokens arrive.
 */
#include "internal/server_internal.h"

#include <stdlib.h>
#include <string.h>

/* --- the request ----------------------------------------------------------------- */

/* TGI: {"inputs", "parameters": {...}, "stream"} */
static bool parse_tgi(srv_conn *c, const cJSON *root, srv_ask *a)
{
    static const char *const top[] = {"inputs", "parameters", "stream", NULL};
    static const char *const params[] = {"max_new_tokens",
                                         "temperature",
                                         "top_k",
                                         "top_p",
                                         "seed",
                                         "stop",
                                         "do_sample",
                                         "repetition_penalty",
                                         "adapter_id",
                                         "adapter_scale",
                                         "details",
                                         "return_full_text",
                                         "decoder_input_details",
                                         "watermark",
                                         "truncate",
                                         "typical_p",
                                         "best_of",
                                         "top_n_tokens",
                                         "frequency_penalty",
                                         "grammar",
                                         NULL};
    if (!srv_only_known(c, root, "the body", top))
        return false;
    if (!srv_get_string(c, root, "inputs", &a->prompt))
        return false;
    if (!a->prompt) {
        srv_fail(c, 400, "\"inputs\" is required");
        return false;
    }
    const cJSON *p = cJSON_GetObjectItemCaseSensitive(root, "parameters");
    if (!srv_is_null(p) && !cJSON_IsObject(p)) {
        srv_fail(c, 400, "\"parameters\" must be an object");
        return false;
    }
    a->max_new_tokens = 100; /* TGI's default */
    if (srv_is_null(p))
        return srv_get_sampling(c, NULL, a, true);
    if (!srv_only_known(c, p, "parameters", params))
        return false;
    /* TGI fields we take but do not implement: accepted only when off */
    static const char *const off[] = {
        "watermark",    "decoder_input_details", "truncate", "typical_p", "best_of",
        "top_n_tokens", "frequency_penalty",     "grammar",  NULL};
    for (const char *const *o = off; *o; o++) {
        const cJSON *v = cJSON_GetObjectItemCaseSensitive(p, *o);
        if (!srv_is_null(v) && !cJSON_IsFalse(v) && !(cJSON_IsNumber(v) && v->valuedouble == 0) &&
            !(strcmp(*o, "best_of") == 0 && cJSON_IsNumber(v) && v->valuedouble == 1)) {
            srv_fail(c, 400, "parameters.%s is not supported by this server", *o);
            return false;
        }
    }
    if (!srv_get_int(c, p, "max_new_tokens", 1, INT32_MAX, &a->max_new_tokens, NULL) ||
        !srv_get_sampling(c, p, a, true) || !srv_get_stops(c, p, "stop", a) ||
        !srv_get_string(c, p, "adapter_id", &a->adapter) ||
        !srv_get_number(c, p, "adapter_scale", -100.0, 100.0, &a->adapter_scale, &a->has_scale) ||
        !srv_get_bool(c, p, "details", &a->details) ||
        !srv_get_bool(c, p, "return_full_text", &a->return_full_text))
        return false;
    return true;
}

/* --- the answer ------------------------------------------------------------------ */

static const char *tgi_finish(eng_finish f)
{
    switch (f) {
    case ENG_FINISH_EOS: return "eos_token";
    case ENG_FINISH_LENGTH: return "length";
    case ENG_FINISH_STOP: return "stop_sequence";
    case ENG_FINISH_CANCELLED: return "cancelled";
    case ENG_FINISH_ERROR: return "error";
    }
    return "unknown";
}

static cJSON *token_json(int32_t id, const char *text, size_t len, bool special)
{
    cJSON *t = cJSON_CreateObject();
    cJSON_AddNumberToObject(t, "id", id);
    char *s = strndup(text ? text : "", len);
    cJSON_AddStringToObject(t, "text", s ? s : "");
    free(s);
    cJSON_AddNullToObject(t, "logprob");
    cJSON_AddBoolToObject(t, "special", special);
    return t;
}

static cJSON *tgi_details(const srv_gen *g, eng_finish why, const eng_usage *u, bool tokens)
{
    cJSON *d = cJSON_CreateObject();
    cJSON_AddStringToObject(d, "finish_reason", tgi_finish(why));
    cJSON_AddNumberToObject(d, "generated_tokens", u ? u->generated_tokens : (double)g->n_tokens);
    if (g->sampled)
        cJSON_AddNumberToObject(d, "seed", (double)g->seed);
    else
        cJSON_AddNullToObject(d, "seed");
    if (tokens) {
        cJSON_AddArrayToObject(d, "prefill");
        cJSON *arr = cJSON_AddArrayToObject(d, "tokens");
        for (size_t i = 0; i < g->n_tokens; i++)
            cJSON_AddItemToArray(
                arr, token_json(g->tokens[i], g->pieces[i], strlen(g->pieces[i]), false));
    }
    return d;
}

static void whole_done(srv_gen *g, srv_conn *c, const char *full, eng_finish why,
                       const eng_usage *u)
{
    cJSON *o = cJSON_CreateObject();
    cJSON_AddStringToObject(o, "generated_text", full);
    if (g->details)
        cJSON_AddItemToObject(o, "details", tgi_details(g, why, u, true));
    srv_respond_generation(c, o, why);
}

static void stream_token(srv_gen *g, srv_conn *c, int32_t token, const char *text, size_t len)
{
    if (token < 0)
        return; /* held-back text at the end: the final event carries it */
    cJSON *o = cJSON_CreateObject();
    cJSON_AddNumberToObject(o, "index", (double)g->n_tokens);
    cJSON_AddItemToObject(o, "token", token_json(token, text, len, false));
    cJSON_AddNullToObject(o, "generated_text");
    cJSON_AddNullToObject(o, "details");
    srv_stream_cjson(c, o);
}

static void stream_done(srv_gen *g, srv_conn *c, const char *full, eng_finish why,
                        const eng_usage *u)
{
    /* the end: a pseudo-token carrying the whole text and details. Its own
     * text is what the engine held back until the end (a stop string's
     * possible start, an incomplete UTF-8 tail), as ordinary text, so
     * clients that join the non-special tokens' texts get the whole
     * generated_text; with no such tail it is an empty special token. */
    const char *tail = g->text ? g->text + g->text_len - g->tail_len : "";
    cJSON *o = cJSON_CreateObject();
    cJSON_AddNumberToObject(o, "index", (double)g->n_tokens + 1);
    cJSON_AddItemToObject(o, "token", token_json(-1, tail, g->tail_len, g->tail_len == 0));
    cJSON_AddStringToObject(o, "generated_text", full);
    cJSON_AddItemToObject(o, "details", tgi_details(g, why, u, false));
    srv_stream_cjson(c, o);
    srv_stream_end(c);
}

static const srv_shape tgi_whole = {
    .adapter_noun = "adapter", .adapter_unknown = " is not loaded", .on_done = whole_done};
static const srv_shape tgi_stream = {.stream = true,
                                     .adapter_noun = "adapter",
                                     .adapter_unknown = " is not loaded",
                                     .on_token = stream_token,
                                     .on_done = stream_done};

/* --- the routes ------------------------------------------------------------------ */

/* POST /generate answers whole unless the body says "stream": true;
 * /generate_stream always streams (and ignores "stream"). */
static void generate(srv_conn *c, bool stream_route)
{
    cJSON *root = srv_body_object(c);
    if (!root)
        return;
    srv_ask a = {0};
    bool stream = stream_route;
    if (parse_tgi(c, root, &a) && (stream_route || srv_get_bool(c, root, "stream", &stream)))
        srv_generate(c, &a, stream ? &tgi_stream : &tgi_whole);
    cJSON_Delete(root);
}

void srv_tgi_generate(srv_conn *c, const char *name)
{
    (void)name;
    generate(c, false);
}

void srv_tgi_generate_stream(srv_conn *c, const char *name)
{
    (void)name;
    generate(c, true);
}

void srv_tgi_info(srv_conn *c, const char *name)
{
    (void)name;
    srv_server *s = c->s;
    cJSON *root = cJSON_CreateObject();
    cJSON_AddStringToObject(root, "model_id", s->model_id);
    cJSON_AddStringToObject(root, "version", QL_VERSION);
    cJSON_AddBoolToObject(root, "serving", s->serving);
    if (s->serving) {
        const eng_model *m = &s->model;
        cJSON_AddStringToObject(root, "architecture", eng_arch_name(m->cfg.arch));
        cJSON_AddStringToObject(root, "format", m->format);
        cJSON_AddStringToObject(root, "quant", m->quant);
        cJSON_AddNumberToObject(root, "weight_bytes", (double)eng_model_weight_bytes(m));
        int64_t context = m->cfg.max_position_embeddings;
        if (s->cfg->max_context > 0 && s->cfg->max_context < context)
            context = s->cfg->max_context;
        cJSON_AddNumberToObject(root, "max_total_tokens", (double)context);
        cJSON_AddNumberToObject(root, "max_new_tokens", s->cfg->max_new_tokens);
        cJSON_AddNumberToObject(root, "max_concurrent_requests", s->cfg->max_running);
        cJSON_AddNumberToObject(root, "max_queued_requests", s->cfg->max_queued);
        cJSON_AddStringToObject(root, "cpu_kernels", qt_cpu_path());
        cJSON_AddStringToObject(root, "device", eng_engine_backend(s->engine));
    }
    srv_respond_cjson(c, 200, root);
}

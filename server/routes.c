/*
 * routes.c - what each route accepts and answers.
 *
 * Generation is shaped as Text Generation Inference (/generate,
 * /generate_stream) and as OpenAI's completions (/v1/completions,
 * /v1/models), so their clients work unchanged. Bodies are checked field
 * by field before anything is submitted: a wrong type or an unknown field
 * is a 400 naming the field; an unknown adapter is a 404. The admin routes
 * (adapters, merge, unmerge, state) need the bearer token, compared in
 * constant time, or, with no token configured, a loopback client.
 *
 * Every error is {"error": {"type", "message"}} with the status the
 * engine's or registry's code maps to (errors_status).
 */
#include "server.h"

#include <cjson/cJSON.h>
#include <errno.h>
#include <limits.h>
#include <math.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#define MAX_STOPS 8

/* --- helpers ------------------------------------------------------------------- */

/* The HTTP status each error code of base/ql_base.h stands for: the one
 * table. A code not listed is the client's mistake (400). */
static const struct {
    int code;
    int status;
} status_table[] = {
    {QL_ENOTFOUND, 404}, {QL_ECONFLICT, 409}, {QL_EBUSY, 503},  {QL_ENONFINITE, 422},
    {QL_EFORMAT, 422},   {QL_EIO, 422},       {QL_ENOMEM, 503}, {QL_EDEVICE, 500},
};

static int status_of(int rc)
{
    for (size_t i = 0; i < sizeof status_table / sizeof status_table[0]; i++)
        if (status_table[i].code == rc)
            return status_table[i].status;
    return 400;
}

static const char *type_of(int status)
{
    switch (status) {
    case 401: return "unauthorized";
    case 403: return "forbidden";
    case 404: return "not_found";
    case 409: return "conflict";
    case 413: return "invalid_request";
    case 422: return "unprocessable";
    case 503: return "overloaded";
    default: return status >= 500 ? "internal" : "invalid_request";
    }
}

static void fail(srv_conn *c, int status, const char *fmt, ...)
    __attribute__((format(printf, 3, 4)));
static void fail(srv_conn *c, int status, const char *fmt, ...)
{
    char m[1200];
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(m, sizeof m, fmt, ap);
    va_end(ap);
    srv_respond_error(c, status, type_of(status), m, status == 503 ? "Retry-After: 1\r\n" : NULL);
}

static void respond_cjson(srv_conn *c, int status, cJSON *root)
{
    char *text = cJSON_PrintUnformatted(root);
    cJSON_Delete(root);
    if (!text) {
        fail(c, 500, "out of memory");
        return;
    }
    srv_respond_json(c, status, text);
    free(text);
}

/* The body as a JSON object, or a 400 (and NULL). */
static cJSON *body_object(srv_conn *c)
{
    if (!c->req.body || c->req.body_len == 0) {
        fail(c, 400, "the request needs a JSON object body");
        return NULL;
    }
    const char *end = NULL;
    cJSON *root = cJSON_ParseWithLengthOpts(c->req.body, c->req.body_len, &end, false);
    if (!root) {
        long at = end ? (long)(end - c->req.body) : 0;
        fail(c, 400, "the body is not valid JSON (parsing stopped at byte %ld)", at);
        return NULL;
    }
    if (!cJSON_IsObject(root)) {
        cJSON_Delete(root);
        fail(c, 400, "the body must be a JSON object");
        return NULL;
    }
    return root;
}

/* Refuse members of obj not named in allowed (NULL-terminated). */
static bool only_known(srv_conn *c, const cJSON *obj, const char *where, const char *const *allowed)
{
    const cJSON *it;
    cJSON_ArrayForEach (it, obj) {
        bool ok = false;
        for (const char *const *a = allowed; *a && !ok; a++)
            ok = strcmp(it->string, *a) == 0;
        if (!ok) {
            fail(c, 400, "%s: unknown field \"%s\"", where, it->string);
            return false;
        }
    }
    return true;
}

static bool is_null(const cJSON *v)
{
    return !v || cJSON_IsNull(v);
}

static bool get_number(srv_conn *c, const cJSON *obj, const char *name, double lo, double hi,
                       double *out, bool *present)
{
    const cJSON *v = cJSON_GetObjectItemCaseSensitive(obj, name);
    if (present)
        *present = !is_null(v);
    if (is_null(v))
        return true;
    if (!cJSON_IsNumber(v) || !isfinite(v->valuedouble)) {
        fail(c, 400, "\"%s\" must be a number", name);
        return false;
    }
    if (v->valuedouble < lo || v->valuedouble > hi) {
        fail(c, 400, "\"%s\" is %g; it must be in [%g, %g]", name, v->valuedouble, lo, hi);
        return false;
    }
    *out = v->valuedouble;
    return true;
}

static bool get_int(srv_conn *c, const cJSON *obj, const char *name, double lo, double hi,
                    int64_t *out, bool *present)
{
    double d = 0;
    bool have = false;
    if (!get_number(c, obj, name, lo, hi, &d, &have))
        return false;
    if (present)
        *present = have;
    if (have) {
        if (d != floor(d)) {
            fail(c, 400, "\"%s\" must be an integer, not %g", name, d);
            return false;
        }
        *out = (int64_t)d;
    }
    return true;
}

static bool get_bool(srv_conn *c, const cJSON *obj, const char *name, bool *out)
{
    const cJSON *v = cJSON_GetObjectItemCaseSensitive(obj, name);
    if (is_null(v))
        return true;
    if (!cJSON_IsBool(v)) {
        fail(c, 400, "\"%s\" must be true or false", name);
        return false;
    }
    *out = cJSON_IsTrue(v);
    return true;
}

static bool get_string(srv_conn *c, const cJSON *obj, const char *name, const char **out)
{
    const cJSON *v = cJSON_GetObjectItemCaseSensitive(obj, name);
    if (is_null(v))
        return true;
    if (!cJSON_IsString(v)) {
        fail(c, 400, "\"%s\" must be a string", name);
        return false;
    }
    *out = v->valuestring;
    return true;
}

/* --- generation ------------------------------------------------------------------ */

/* What a generation request asks for, whatever its shape. Strings point
 * into the parsed body. */
typedef struct gen_ask {
    const char *prompt;
    int64_t max_new_tokens;
    eng_sampling sampling;
    const char *stops[MAX_STOPS];
    size_t n_stops;
    const char *adapter; /* NULL: the base model */
    double adapter_scale;
    bool has_scale;
    bool details, include_usage, return_full_text;
} gen_ask;

static bool get_stops(srv_conn *c, const cJSON *obj, const char *name, gen_ask *a)
{
    const cJSON *v = cJSON_GetObjectItemCaseSensitive(obj, name);
    if (is_null(v))
        return true;
    if (cJSON_IsString(v)) {
        a->stops[a->n_stops++] = v->valuestring;
        return true;
    }
    if (!cJSON_IsArray(v)) {
        fail(c, 400, "\"%s\" must be a string or an array of strings", name);
        return false;
    }
    const cJSON *it;
    cJSON_ArrayForEach (it, v) {
        if (!cJSON_IsString(it) || !it->valuestring[0]) {
            fail(c, 400, "\"%s\" must hold non-empty strings", name);
            return false;
        }
        if (a->n_stops == MAX_STOPS) {
            fail(c, 400, "\"%s\": at most %d stop strings", name, MAX_STOPS);
            return false;
        }
        a->stops[a->n_stops++] = it->valuestring;
    }
    return true;
}

/* The sampling fields both shapes share. */
static bool get_sampling(srv_conn *c, const cJSON *p, gen_ask *a, bool greedy_default)
{
    double temperature = greedy_default ? 0.0 : 1.0, top_p = 1.0, penalty = 1.0;
    int64_t top_k = 0, seed = 0;
    bool has_t = false, has_seed = false, has_k = false, has_p = false;
    if (!get_number(c, p, "temperature", 0.0, 100.0, &temperature, &has_t) ||
        !get_number(c, p, "top_p", 0.0, 1.0, &top_p, &has_p) ||
        !get_int(c, p, "top_k", 0, 1 << 24, &top_k, &has_k) ||
        !get_number(c, p, "repetition_penalty", 0.0, 100.0, &penalty, NULL) ||
        !get_int(c, p, "seed", 0, 9007199254740991.0, &seed, &has_seed))
        return false;
    if (greedy_default) {
        /* TGI: do_sample, or any sampling parameter, turns sampling on */
        bool do_sample = false;
        if (!get_bool(c, p, "do_sample", &do_sample))
            return false;
        if (!do_sample && !has_t && !has_k && !has_p)
            temperature = 0.0;
        else if (!has_t)
            temperature = 1.0;
    }
    if (has_p && top_p == 0.0) {
        fail(c, 400, "\"top_p\" must be in (0, 1]");
        return false;
    }
    a->sampling.temperature = (float)temperature;
    a->sampling.top_p = (float)top_p;
    a->sampling.top_k = (int32_t)top_k;
    a->sampling.repetition_penalty = (float)penalty;
    a->sampling.seed = has_seed ? (uint64_t)seed : (uint64_t)time(NULL) ^ (uint64_t)c->serial;
    return true;
}

/* TGI: {"inputs", "parameters": {...}, "stream"} */
static bool parse_tgi(srv_conn *c, const cJSON *root, gen_ask *a)
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
    if (!only_known(c, root, "the body", top))
        return false;
    if (!get_string(c, root, "inputs", &a->prompt))
        return false;
    if (!a->prompt) {
        fail(c, 400, "\"inputs\" is required");
        return false;
    }
    const cJSON *p = cJSON_GetObjectItemCaseSensitive(root, "parameters");
    if (!is_null(p) && !cJSON_IsObject(p)) {
        fail(c, 400, "\"parameters\" must be an object");
        return false;
    }
    a->max_new_tokens = 100; /* TGI's default */
    if (is_null(p))
        return get_sampling(c, NULL, a, true);
    if (!only_known(c, p, "parameters", params))
        return false;
    /* TGI fields we take but do not implement: accepted only when off */
    static const char *const off[] = {
        "watermark",    "decoder_input_details", "truncate", "typical_p", "best_of",
        "top_n_tokens", "frequency_penalty",     "grammar",  NULL};
    for (const char *const *o = off; *o; o++) {
        const cJSON *v = cJSON_GetObjectItemCaseSensitive(p, *o);
        if (!is_null(v) && !cJSON_IsFalse(v) && !(cJSON_IsNumber(v) && v->valuedouble == 0) &&
            !(strcmp(*o, "best_of") == 0 && cJSON_IsNumber(v) && v->valuedouble == 1)) {
            fail(c, 400, "parameters.%s is not supported by this server", *o);
            return false;
        }
    }
    if (!get_int(c, p, "max_new_tokens", 1, INT32_MAX, &a->max_new_tokens, NULL) ||
        !get_sampling(c, p, a, true) || !get_stops(c, p, "stop", a) ||
        !get_string(c, p, "adapter_id", &a->adapter) ||
        !get_number(c, p, "adapter_scale", -100.0, 100.0, &a->adapter_scale, &a->has_scale) ||
        !get_bool(c, p, "details", &a->details) ||
        !get_bool(c, p, "return_full_text", &a->return_full_text))
        return false;
    return true;
}

/* OpenAI completions. */
static bool parse_oai(srv_conn *c, const cJSON *root, gen_ask *a, const char **model, bool *stream)
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
                                         "best_of",
                                         "suffix",
                                         NULL};
    if (!only_known(c, root, "the body", fields))
        return false;
    if (!get_string(c, root, "model", model) || !get_bool(c, root, "stream", stream))
        return false;
    const cJSON *prompt = cJSON_GetObjectItemCaseSensitive(root, "prompt");
    if (cJSON_IsArray(prompt) && cJSON_GetArraySize(prompt) == 1 &&
        cJSON_IsString(cJSON_GetArrayItem(prompt, 0)))
        prompt = cJSON_GetArrayItem(prompt, 0);
    if (!cJSON_IsString(prompt)) {
        fail(c, 400, "\"prompt\" must be a string (one prompt per request)");
        return false;
    }
    a->prompt = prompt->valuestring;
    a->max_new_tokens = 16; /* OpenAI's default */
    int64_t n = 1;
    bool echo = false;
    double presence = 0, frequency = 0;
    if (!get_int(c, root, "max_tokens", 1, INT32_MAX, &a->max_new_tokens, NULL) ||
        !get_sampling(c, root, a, false) || !get_stops(c, root, "stop", a) ||
        !get_int(c, root, "n", 1, 1, &n, NULL) || !get_bool(c, root, "echo", &echo) ||
        !get_number(c, root, "presence_penalty", 0, 0, &presence, NULL) ||
        !get_number(c, root, "frequency_penalty", 0, 0, &frequency, NULL))
        return false;
    const cJSON *lp = cJSON_GetObjectItemCaseSensitive(root, "logprobs");
    if (!is_null(lp) && !(cJSON_IsNumber(lp) && lp->valuedouble == 0)) {
        fail(c, 400, "\"logprobs\" is not supported by this server");
        return false;
    }
    const cJSON *so = cJSON_GetObjectItemCaseSensitive(root, "stream_options");
    if (!is_null(so)) {
        static const char *const sof[] = {"include_usage", NULL};
        if (!cJSON_IsObject(so)) {
            fail(c, 400, "\"stream_options\" must be an object");
            return false;
        }
        if (!only_known(c, so, "stream_options", sof) ||
            !get_bool(c, so, "include_usage", &a->include_usage))
            return false;
    }
    a->return_full_text = echo;
    return true;
}

/* The server's own limit on new tokens; the context length (prompt plus
 * new tokens) is checked by the engine at submit, which counts the
 * prompt's tokens once. */
static bool check_limits(srv_conn *c, const gen_ask *a)
{
    const cfg_serve *cfg = c->s->cfg;
    if (a->max_new_tokens > cfg->max_new_tokens) {
        fail(c, 400, "max new tokens %lld is over the server's limit of %d",
             (long long)a->max_new_tokens, cfg->max_new_tokens);
        return false;
    }
    return true;
}

static bool ready(srv_conn *c)
{
    if (c->s->draining) {
        fail(c, 503, "the server is shutting down");
        return false;
    }
    if (!c->s->serving) {
        fail(c, 503, "the model is still loading");
        return false;
    }
    return true;
}

static void generate(srv_conn *c, srv_shape shape)
{
    cJSON *root = body_object(c);
    if (!root)
        return;
    gen_ask a = {0};
    const char *model = NULL;
    bool stream = false;
    bool ok = shape == SRV_OAI ? parse_oai(c, root, &a, &model, &stream) : parse_tgi(c, root, &a);
    if (ok && shape == SRV_TGI) {
        bool s = false;
        ok = get_bool(c, root, "stream", &s);
        if (s)
            shape = SRV_TGI_STREAM;
    }
    if (shape == SRV_OAI && stream)
        shape = SRV_OAI_STREAM;
    if (ok && !ready(c))
        ok = false;
    /* the adapter: TGI names it; OpenAI's model is the base or an adapter */
    if (ok && shape >= SRV_OAI && model && strcmp(model, c->s->model_id) != 0)
        a.adapter = model;
    /* the adapter and its default scale, when the request gives none */
    eng_lora_term term = {NULL, 1.0f};
    char msg[1024];
    if (ok && a.adapter && a.adapter[0]) {
        if (!c->s->registry ||
            lora_registry_want(c->s->registry, a.adapter, &term, msg, sizeof msg) != QL_OK) {
            fail(c, 404,
                 shape >= SRV_OAI ? "model %s: neither the base model nor a loaded adapter"
                                  : "adapter %s is not loaded",
                 a.adapter);
            ok = false;
        }
    }
    eng_lora *lora = term.lora;
    if (a.has_scale)
        term.scale = (float)a.adapter_scale;
    if (ok)
        ok = check_limits(c, &a);
    if (!ok) {
        eng_lora_unref(lora);
        cJSON_Delete(root);
        return;
    }
    srv_gen *g = calloc(1, sizeof *g);
    if (!g) {
        eng_lora_unref(lora);
        cJSON_Delete(root);
        fail(c, 503, "out of memory");
        return;
    }
    g->s = c->s;
    g->conn = c;
    g->shape = shape;
    g->details = a.details;
    g->include_usage = a.include_usage;
    g->return_full_text = a.return_full_text;
    g->seed = a.sampling.seed;
    g->sampled = a.sampling.temperature > 0;
    snprintf(g->model_id, sizeof g->model_id, "%s", lora ? lora->name : c->s->model_id);
    if (a.return_full_text)
        g->prompt = strdup(a.prompt);
    eng_request r = {.prompt = a.prompt,
                     .prompt_len = strlen(a.prompt),
                     .max_new_tokens = (int32_t)a.max_new_tokens,
                     .sampling = a.sampling,
                     .stop = a.stops,
                     .n_stop = a.n_stops,
                     .adapters = lora ? &term : NULL,
                     .n_adapters = lora ? 1 : 0};
    int rc = srv_gen_submit(g, &r, msg, sizeof msg);
    eng_lora_unref(lora); /* the engine took its own reference */
    cJSON_Delete(root);
    if (rc != QL_OK) {
        free(g->prompt);
        free(g);
        fail(c, status_of(rc), "%s", msg);
        return;
    }
    c->gen = g;
    if (shape == SRV_TGI_STREAM || shape == SRV_OAI_STREAM)
        srv_stream_begin(c);
}

static void list_models(srv_conn *c)
{
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
    respond_cjson(c, 200, root);
}

static void info(srv_conn *c)
{
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
    respond_cjson(c, 200, root);
}

/* --- admin ----------------------------------------------------------------------- */

/* Equal, in time that depends on the lengths only. */
static bool same_secret(const char *a, const char *b)
{
    size_t la = strlen(a), lb = strlen(b);
    unsigned diff = (unsigned)(la ^ lb);
    for (size_t i = 0; i < la; i++)
        diff |= (unsigned char)a[i] ^ (unsigned char)b[i % (lb ? lb : 1)];
    return diff == 0;
}

static bool admin_allowed(srv_conn *c)
{
    const char *token = c->s->cfg->admin_token;
    if (!token) {
        if (!c->loopback) {
            fail(c, 403,
                 "admin routes answer only to loopback clients when no admin token is configured");
            return false;
        }
        return true;
    }
    const char *h = c->req.authorization;
    if (c->req.auth_too_long || strncasecmp(h, "Bearer ", 7) != 0 || !same_secret(h + 7, token)) {
        srv_respond_error(c, 401, "unauthorized", "a valid admin bearer token is required",
                          "WWW-Authenticate: Bearer\r\n");
        return false;
    }
    return true;
}

/* A lora_info as JSON. */
static cJSON *info_json(const lora_info *in)
{
    cJSON *o = cJSON_CreateObject();
    cJSON_AddStringToObject(o, "name", in->name);
    cJSON_AddNumberToObject(o, "rank", in->meta.r);
    cJSON_AddNumberToObject(o, "alpha", in->meta.alpha);
    cJSON_AddBoolToObject(o, "use_rslora", in->meta.use_rslora);
    cJSON_AddStringToObject(o, "targets", in->meta.targets);
    cJSON_AddNumberToObject(o, "modules", in->meta.n_modules);
    cJSON_AddStringToObject(o, "base_model", in->meta.base_model);
    cJSON_AddNumberToObject(o, "bytes", (double)in->bytes);
    cJSON_AddNumberToObject(o, "scale", in->scale);
    cJSON_AddBoolToObject(o, "merged", in->merged);
    if (in->merged)
        cJSON_AddNumberToObject(o, "merged_scale", in->merged_scale);
    cJSON_AddNumberToObject(o, "requests", (double)in->requests);
    if (in->last_merge.delta_sq > 0) {
        cJSON *lm = cJSON_AddObjectToObject(o, "last_merge");
        cJSON_AddNumberToObject(lm, "delta_retained", in->last_merge.delta_retained);
        cJSON_AddNumberToObject(lm, "relative_error", in->last_merge.relative_error);
        cJSON_AddNumberToObject(lm, "seconds", in->last_merge_seconds);
    }
    if (in->meta.warning[0])
        cJSON_AddStringToObject(o, "warning", in->meta.warning);
    return o;
}

static void list_adapters(srv_conn *c)
{
    cJSON *root = cJSON_CreateObject();
    cJSON *arr = cJSON_AddArrayToObject(root, "adapters");
    lora_info *list = NULL;
    size_t n = 0;
    if (lora_registry_list(c->s->registry, &list, &n) == QL_OK)
        for (size_t i = 0; i < n; i++)
            cJSON_AddItemToArray(arr, info_json(&list[i]));
    free(list);
    respond_cjson(c, 200, root);
}

static cJSON *report_json(const lora_report *r)
{
    cJSON *o = cJSON_CreateObject();
    cJSON_AddStringToObject(o, "adapter", r->adapter);
    cJSON_AddNumberToObject(o, "version", (double)r->version);
    char digest[20];
    snprintf(digest, sizeof digest, "%016llx", (unsigned long long)r->digest);
    cJSON_AddStringToObject(o, "weights_digest", digest);
    cJSON_AddNumberToObject(o, "seconds", r->seconds);
    cJSON_AddNumberToObject(o, "modules_requantized", (double)r->n_modules);
    if (r->n_modules) {
        cJSON_AddNumberToObject(o, "delta_retained", r->overall.delta_retained);
        cJSON_AddNumberToObject(o, "relative_error", r->overall.relative_error);
        cJSON *mods = cJSON_AddArrayToObject(o, "modules");
        for (size_t i = 0; i < r->n_modules; i++) {
            const struct lora_module_cost *mc = &r->modules[i];
            cJSON *m = cJSON_CreateObject();
            char name[96];
            snprintf(name, sizeof name, "model.layers.%d.%s.%s", mc->layer,
                     eng_proj_parent(mc->proj), eng_proj_name(mc->proj));
            cJSON_AddStringToObject(m, "module", name);
            cJSON_AddStringToObject(m, "kind", qt_kind_name(mc->kind));
            cJSON_AddNumberToObject(m, "delta_retained", mc->cost.delta_retained);
            cJSON_AddNumberToObject(m, "relative_error", mc->cost.relative_error);
            cJSON_AddItemToArray(mods, m);
        }
    }
    return o;
}

/* Resolve a client's adapter path under the adapter directory: relative,
 * no "..", and (symlinks followed) still inside it. */
static bool resolve_adapter_path(srv_conn *c, const char *path, char *out, size_t out_len)
{
    const char *root = c->s->cfg->adapter_dir;
    if (!root) {
        fail(c, 403, "adapter loading is off: start the server with --adapter-dir DIR");
        return false;
    }
    char real_root[PATH_MAX];
    if (!realpath(root, real_root)) {
        fail(c, 500, "the adapter directory %s cannot be resolved: %s", root, strerror(errno));
        return false;
    }
    char joined[PATH_MAX * 2];
    if (path[0] == '/') {
        size_t n = strlen(real_root);
        if (strncmp(path, real_root, n) != 0 || (path[n] != '/' && path[n] != 0)) {
            fail(c, 400, "path %s is outside the adapter directory", path);
            return false;
        }
        snprintf(joined, sizeof joined, "%s", path);
    } else {
        snprintf(joined, sizeof joined, "%s/%s", real_root, path);
    }
    for (const char *p = path; *p;) {
        size_t seg = strcspn(p, "/");
        if (seg == 2 && p[0] == '.' && p[1] == '.') {
            fail(c, 400, "path %s: \"..\" is not allowed", path);
            return false;
        }
        p += seg;
        while (*p == '/')
            p++;
    }
    char real[PATH_MAX];
    if (!realpath(joined, real)) {
        fail(c, 404, "adapter path %s: %s", path, strerror(errno));
        return false;
    }
    size_t n = strlen(real_root);
    if (strncmp(real, real_root, n) != 0 || (real[n] != '/' && real[n] != 0)) {
        fail(c, 400, "path %s leads outside the adapter directory", path);
        return false;
    }
    snprintf(out, out_len, "%s", real);
    return true;
}

static void run_load(srv_work *w)
{
    w->rc = lora_registry_load(w->s->registry, w->name, w->path, w->scale, &w->meta, w->msg,
                               sizeof w->msg);
}

static void done_load(srv_work *w)
{
    srv_conn *c = w->conn;
    if (!c)
        return;
    if (w->rc != QL_OK) {
        fail(c, status_of(w->rc), "%s", w->msg);
        return;
    }
    /* the registry's own listing of it (bytes, requests) */
    lora_info *list = NULL, in = {0};
    size_t n = 0;
    snprintf(in.name, sizeof in.name, "%.127s", w->name);
    in.meta = w->meta;
    in.scale = w->scale;
    if (lora_registry_list(w->s->registry, &list, &n) == QL_OK)
        for (size_t i = 0; i < n; i++)
            if (strcmp(list[i].name, w->name) == 0)
                in = list[i];
    free(list);
    respond_cjson(c, 201, info_json(&in));
}

static void run_merge(srv_work *w)
{
    lora_merge_opts o = {.safe_merge = w->safe_merge, .into = w->into};
    w->rc = lora_registry_merge(w->s->registry, w->name, w->scale, &o, &w->report, w->msg,
                                sizeof w->msg);
    w->has_report = w->rc == QL_OK;
}

static void run_unmerge(srv_work *w)
{
    w->rc = lora_registry_unmerge(w->s->registry, w->name, &w->report, w->msg, sizeof w->msg);
    w->has_report = w->rc == QL_OK;
}

static void done_merge(srv_work *w)
{
    srv_server *s = w->s;
    if (w->rc == QL_OK && w->run == run_merge)
        s->metrics.merges++;
    else if (w->rc == QL_OK)
        s->metrics.unmerges++;
    else
        s->metrics.merge_failures++;
    if (!w->conn)
        return;
    if (w->rc != QL_OK)
        fail(w->conn, status_of(w->rc), "%s", w->msg);
    else
        respond_cjson(w->conn, 200, report_json(&w->report));
}

static srv_work *new_work(srv_conn *c, const char *name)
{
    srv_work *w = calloc(1, sizeof *w);
    if (!w) {
        fail(c, 503, "out of memory");
        return NULL;
    }
    w->s = c->s;
    w->conn = c;
    snprintf(w->name, sizeof w->name, "%s", name);
    return w;
}

static void start_work(srv_conn *c, srv_work *w)
{
    c->work = w;
    if (srv_work_start(w) != 0) {
        c->work = NULL;
        free(w);
        fail(c, 503, "cannot start the work");
    }
}

static bool valid_name(srv_conn *c, const char *name)
{
    size_t n = strlen(name);
    if (n == 0 || n >= 128) {
        fail(c, 400, "\"name\" must have 1 to 127 characters");
        return false;
    }
    for (size_t i = 0; i < n; i++) {
        char ch = name[i];
        if (!((ch >= 'a' && ch <= 'z') || (ch >= 'A' && ch <= 'Z') || (ch >= '0' && ch <= '9') ||
              ch == '-' || ch == '_' || ch == '.')) {
            fail(c, 400, "\"name\" %s: only letters, digits, '-', '_' and '.'", name);
            return false;
        }
    }
    return true;
}

static void load_adapter(srv_conn *c)
{
    cJSON *root = body_object(c);
    if (!root)
        return;
    static const char *const fields[] = {"name", "path", "scale", NULL};
    const char *name = NULL, *path = NULL;
    double scale = 1.0;
    char resolved[PATH_MAX];
    bool ok = only_known(c, root, "the body", fields) && get_string(c, root, "name", &name) &&
              get_string(c, root, "path", &path) &&
              get_number(c, root, "scale", -100.0, 100.0, &scale, NULL);
    if (ok && (!name || !path)) {
        fail(c, 400, "\"name\" and \"path\" are required");
        ok = false;
    }
    ok = ok && valid_name(c, name);
    if (ok && strcmp(name, c->s->model_id) == 0) {
        fail(c, 409, "%s is the base model's name", name);
        ok = false;
    }
    ok = ok && resolve_adapter_path(c, path, resolved, sizeof resolved);
    srv_work *w = ok ? new_work(c, name) : NULL;
    cJSON_Delete(root);
    if (!w)
        return;
    snprintf(w->path, sizeof w->path, "%s", resolved);
    w->scale = (float)scale;
    w->run = run_load;
    w->done = done_load;
    start_work(c, w);
}

static void merge_adapter(srv_conn *c, const char *name, bool merge)
{
    cJSON *root = c->req.body_len ? body_object(c) : cJSON_CreateObject();
    if (!root)
        return;
    static const char *const fields[] = {"scale", "safe_merge", "into", NULL};
    static const char *const none[] = {NULL};
    /* the adapter's default scale unless the body names one (an unknown
     * adapter is refused by the merge itself) */
    eng_lora_term known = {NULL, 1.0f};
    lora_registry_want(c->s->registry, name, &known, NULL, 0);
    eng_lora_unref(known.lora);
    double scale = known.scale;
    bool safe = true;
    const char *into = NULL;
    bool ok = only_known(c, root, "the body", merge ? fields : none) &&
              get_number(c, root, "scale", -100.0, 100.0, &scale, NULL) &&
              get_bool(c, root, "safe_merge", &safe) && get_string(c, root, "into", &into);
    qt_kind kind = QT_KIND_COUNT;
    if (ok && into) {
        if (strcmp(into, "int8") == 0) {
            kind = QT_AFFINE;
        } else if (strcmp(into, "bf16") == 0) {
            kind = QT_BF16;
        } else {
            fail(c, 400, "\"into\" %s: one of int8, bf16 (or absent: the weight's own kind)", into);
            ok = false;
        }
    }
    cJSON_Delete(root);
    srv_work *w = ok ? new_work(c, name) : NULL;
    if (!w)
        return;
    w->scale = (float)scale;
    w->safe_merge = safe;
    w->into = kind;
    w->run = merge ? run_merge : run_unmerge;
    w->done = done_merge;
    start_work(c, w);
}

static void unload_adapter(srv_conn *c, const char *name)
{
    char msg[512];
    int rc = lora_registry_unload(c->s->registry, name, msg, sizeof msg);
    if (rc != QL_OK) {
        fail(c, status_of(rc), "%s", msg);
        return;
    }
    cJSON *root = cJSON_CreateObject();
    cJSON_AddStringToObject(root, "unloaded", name);
    respond_cjson(c, 200, root);
}

static void admin_state(srv_conn *c)
{
    lora_state st;
    lora_registry_state(c->s->registry, &st);
    cJSON *root = cJSON_CreateObject();
    cJSON_AddNumberToObject(root, "weights_version", (double)st.version);
    char digest[20];
    snprintf(digest, sizeof digest, "%016llx", (unsigned long long)st.digest);
    cJSON_AddStringToObject(root, "weights_digest", digest);
    cJSON *merged = cJSON_AddArrayToObject(root, "merged");
    for (size_t i = 0; i < st.n_merged && i < 16; i++) {
        cJSON *m = cJSON_CreateObject();
        cJSON_AddStringToObject(m, "name", st.merged[i].name);
        cJSON_AddNumberToObject(m, "scale", st.merged[i].scale);
        cJSON_AddItemToArray(merged, m);
    }
    cJSON_AddNumberToObject(root, "adapters_loaded", (double)st.n_loaded);
    cJSON_AddNumberToObject(root, "adapter_bytes", (double)st.bytes);
    cJSON_AddNumberToObject(root, "merges", (double)st.merges);
    cJSON_AddNumberToObject(root, "unmerges", (double)st.unmerges);
    respond_cjson(c, 200, root);
}

static void admin(srv_conn *c, const char *path, uint8_t method)
{
    if (!admin_allowed(c))
        return;
    if (!c->s->serving || !c->s->registry) {
        fail(c, 503, "the model is still loading");
        return;
    }
    if (strcmp(path, "/admin/state") == 0) {
        if (method != HTTP_GET)
            fail(c, 405, "/admin/state: GET only");
        else
            admin_state(c);
        return;
    }
    if (strcmp(path, "/admin/adapters") == 0) {
        if (method == HTTP_GET)
            list_adapters(c);
        else if (method == HTTP_POST)
            load_adapter(c);
        else
            fail(c, 405, "/admin/adapters: GET or POST");
        return;
    }
    const char *prefix = "/admin/adapters/";
    size_t np = strlen(prefix);
    if (strncmp(path, prefix, np) != 0) {
        fail(c, 404, "no route %s", path);
        return;
    }
    char name[160];
    const char *rest = path + np;
    size_t n = strcspn(rest, "/");
    if (n == 0 || n >= sizeof name) {
        fail(c, 404, "no route %s", path);
        return;
    }
    memcpy(name, rest, n);
    name[n] = 0;
    const char *action = rest + n;
    if (*action == 0) {
        if (method == HTTP_DELETE)
            unload_adapter(c, name);
        else
            fail(c, 405, "%s: DELETE only", path);
    } else if (strcmp(action, "/merge") == 0 || strcmp(action, "/unmerge") == 0) {
        if (method != HTTP_POST)
            fail(c, 405, "%s: POST only", path);
        else
            merge_adapter(c, name, strcmp(action, "/merge") == 0);
    } else {
        fail(c, 404, "no route %s", path);
    }
}

/* --- the router --------------------------------------------------------------------- */

void srv_route(srv_conn *c)
{
    srv_server *s = c->s;
    /* the path, without the query string */
    char path[512];
    size_t n = c->req.url ? strcspn(c->req.url, "?") : 0;
    if (n == 0 || n >= sizeof path) {
        fail(c, n ? 414 : 400, "the request target is missing or too long");
        return;
    }
    memcpy(path, c->req.url, n);
    path[n] = 0;
    uint8_t m = c->req.method;
    if (strncmp(path, "/admin/", 7) == 0) {
        admin(c, path, m);
        return;
    }
    struct {
        const char *path;
        uint8_t method;
        int what;
    } routes[] = {
        {"/generate", HTTP_POST, 1},       {"/generate_stream", HTTP_POST, 2},
        {"/v1/completions", HTTP_POST, 3}, {"/v1/models", HTTP_GET, 4},
        {"/health", HTTP_GET, 5},          {"/info", HTTP_GET, 6},
        {"/metrics", HTTP_GET, 7},
    };
    for (size_t i = 0; i < sizeof routes / sizeof *routes; i++) {
        if (strcmp(path, routes[i].path) != 0)
            continue;
        if (m != routes[i].method) {
            fail(c, 405, "%s: %s only", path, routes[i].method == HTTP_GET ? "GET" : "POST");
            return;
        }
        switch (routes[i].what) {
        case 1: generate(c, SRV_TGI); return;
        case 2: generate(c, SRV_TGI_STREAM); return;
        case 3: generate(c, SRV_OAI); return;
        case 4: list_models(c); return;
        case 5:
            if (s->serving && !s->draining)
                srv_respond_json(c, 200, "{\"status\":\"ok\"}");
            else
                fail(c, 503, s->draining ? "shutting down" : "the model is still loading");
            return;
        case 6: info(c); return;
        case 7: {
            size_t len = 0;
            char *text = srv_metrics_render(s, &len);
            if (!text) {
                fail(c, 500, "out of memory");
                return;
            }
            srv_respond(c, 200, "text/plain; version=0.0.4", text, len, NULL);
            free(text);
            return;
        }
        }
    }
    fail(c, 404, "no route %s", path);
}

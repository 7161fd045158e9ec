/*
 * request.c - what every route handler shares: the JSON body and its
 * field readers, errors, the one table from error codes to HTTP statuses,
 * and the answers built from cJSON.
 *
 * Bodies are checked field by field before anything is submitted: a wrong
 * type, a value out of range or an unknown field is a 400 naming the
 * field. Every error is {"error": {"type", "message"}} with the status
 * the engine's or registry's code maps to (status_table); a 503 adds
 * Retry-After.
 *
 * Offers srv_req_status_of, srv_req_fail, srv_req_respond_cjson, srv_req_stream_cjson,
 * srv_req_respond_generation, srv_req_body_object, srv_req_only_known, srv_req_is_null,
 * the srv_req_get_* readers and the two generation APIs' shared srv_req_get_stops,
 * srv_req_get_sampling, srv_req_get_speculative and srv_req_get_grammar (response_format and TGI's
 * grammar, with srv_req_ask_grammar and srv_req_ask_schema, which put a grammar's text on a
 * request), and srv_req_ask_free (internal/request.h) to bridge.c, the API
 * files, admin.c and routes.c, and srv_secret_equal (server.h), the
 * constant-time compare of a bearer token. Owns nothing past a call.
 * Touches only http.c's responses.
 */
#include "internal/request.h"
#include "internal/http.h"

#include <cjson/cJSON.h>
#include <math.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

/* --- secrets ------------------------------------------------------------------- */

bool srv_secret_equal(const char *given, size_t given_len, const char *want)
{
    size_t want_len = strnlen(want, CFG_SECRET_MAX + 1);
    if (given_len > CFG_SECRET_MAX || want_len > CFG_SECRET_MAX)
        return false;
    unsigned char a[CFG_SECRET_MAX] = {0}, b[CFG_SECRET_MAX] = {0};
    memcpy(a, given, given_len);
    memcpy(b, want, want_len);
    /* volatile: the compiler may not turn the loop into one that stops at
     * the first difference */
    volatile unsigned diff = (unsigned)(given_len ^ want_len);
    for (size_t i = 0; i < CFG_SECRET_MAX; i++)
        diff |= (unsigned)(a[i] ^ b[i]);
    return diff == 0;
}

/* --- errors and answers -------------------------------------------------------- */

/* The HTTP status each error code of base/ql_base.h stands for: the one
 * table. A code not listed is the client's mistake (400). */
static const struct {
    int code;
    int status;
} status_table[] = {
    {QL_ENOTFOUND, 404}, {QL_ECONFLICT, 409}, {QL_EBUSY, 503},  {QL_ENONFINITE, 422},
    {QL_EFORMAT, 422},   {QL_EIO, 422},       {QL_ENOMEM, 503}, {QL_EDEVICE, 500},
};

int srv_req_status_of(int rc)
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

void srv_req_fail(srv_conn *c, int status, const char *fmt, ...)
{
    char m[1200];
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(m, sizeof m, fmt, ap);
    va_end(ap);
    srv_http_respond_error(c, status, type_of(status), m,
                           status == 503 ? "Retry-After: 1\r\n" : NULL);
}

cJSON *srv_req_json_text(const char *text, size_t len)
{
    if (!text)
        return cJSON_CreateString("");
    if (!memchr(text, 0, len)) {
        char *t = strndup(text, len);
        cJSON *o = cJSON_CreateString(t ? t : "");
        free(t);
        return o;
    }
    /* a cJSON string ends at its first NUL: this one's JSON is written
     * here, every control byte as \u00XX */
    char *out = malloc(6 * len + 3);
    if (!out)
        return cJSON_CreateString("");
    size_t n = 0;
    out[n++] = '"';
    for (size_t i = 0; i < len; i++) {
        unsigned char b = (unsigned char)text[i];
        if (b == '"' || b == '\\') {
            out[n++] = '\\';
            out[n++] = (char)b;
        } else if (b < 0x20) {
            n += (size_t)sprintf(out + n, "\\u%04x", b);
        } else {
            out[n++] = (char)b;
        }
    }
    out[n++] = '"';
    out[n] = 0;
    cJSON *o = cJSON_CreateRaw(out);
    free(out);
    return o;
}

void srv_req_respond_cjson(srv_conn *c, int status, cJSON *root)
{
    char *text = cJSON_PrintUnformatted(root);
    cJSON_Delete(root);
    if (!text) {
        srv_req_fail(c, 500, "out of memory");
        return;
    }
    srv_http_respond_json_owned(c, status, text);
}

void srv_req_stream_cjson(srv_conn *c, cJSON *o)
{
    char *text = cJSON_PrintUnformatted(o);
    cJSON_Delete(o);
    if (text) {
        srv_http_stream_event(c, text, strlen(text));
        free(text);
    }
}

void srv_req_stream_error(srv_conn *c, int status, const char *message)
{
    if (c->req.error_shape == SRV_ERRORS_ANTHROPIC) {
        /* Anthropic's: an "error" event with the error body's shape */
        char *text = srv_http_error_json(c, status, type_of(status), message);
        if (text)
            srv_http_stream_named_event(c, "error", text, strlen(text));
        free(text);
        return;
    }
    cJSON *root = cJSON_CreateObject();
    cJSON *err = cJSON_AddObjectToObject(root, "error");
    cJSON_AddStringToObject(err, "type", type_of(status));
    cJSON_AddStringToObject(err, "message", message);
    cJSON_AddNumberToObject(err, "code", status);
    srv_req_stream_cjson(c, root);
}

void srv_req_respond_generation(srv_conn *c, cJSON *o, eng_finish why)
{
    char *text = o && why != ENG_FINISH_ERROR ? cJSON_PrintUnformatted(o) : NULL;
    cJSON_Delete(o);
    if (why == ENG_FINISH_ERROR || !text)
        srv_http_respond_error(
            c, 500, "internal",
            why == ENG_FINISH_ERROR ? "the engine failed this request" : "out of memory", NULL);
    else
        srv_http_respond_json_owned(c, 200, text); /* written without a copy */
}

cJSON *srv_req_body_object(srv_conn *c)
{
    if (!c->req.body || c->req.body_len == 0) {
        srv_req_fail(c, 400, "the request needs a JSON object body");
        return NULL;
    }
    const char *end = NULL;
    cJSON *root = cJSON_ParseWithLengthOpts(c->req.body, c->req.body_len, &end, false);
    if (!root) {
        long at = end ? (long)(end - c->req.body) : 0;
        srv_req_fail(c, 400, "the body is not valid JSON (parsing stopped at byte %ld)", at);
        return NULL;
    }
    if (!cJSON_IsObject(root)) {
        cJSON_Delete(root);
        srv_req_fail(c, 400, "the body must be a JSON object");
        return NULL;
    }
    return root;
}

bool srv_req_only_known(srv_conn *c, const cJSON *obj, const char *where,
                        const char *const *allowed)
{
    const cJSON *it;
    cJSON_ArrayForEach (it, obj) {
        bool ok = false;
        for (const char *const *a = allowed; *a && !ok; a++)
            ok = strcmp(it->string, *a) == 0;
        if (!ok) {
            srv_req_fail(c, 400, "%s: unknown field \"%s\"", where, it->string);
            return false;
        }
    }
    return true;
}

bool srv_req_is_null(const cJSON *v)
{
    return !v || cJSON_IsNull(v);
}

bool srv_req_get_number(srv_conn *c, const cJSON *obj, const char *name, double lo, double hi,
                        double *out, bool *present)
{
    const cJSON *v = cJSON_GetObjectItemCaseSensitive(obj, name);
    if (present)
        *present = !srv_req_is_null(v);
    if (srv_req_is_null(v))
        return true;
    if (!cJSON_IsNumber(v) || !isfinite(v->valuedouble)) {
        srv_req_fail(c, 400, "\"%s\" must be a number", name);
        return false;
    }
    if (v->valuedouble < lo || v->valuedouble > hi) {
        srv_req_fail(c, 400, "\"%s\" is %g; it must be in [%g, %g]", name, v->valuedouble, lo, hi);
        return false;
    }
    *out = v->valuedouble;
    return true;
}

bool srv_req_get_int(srv_conn *c, const cJSON *obj, const char *name, double lo, double hi,
                     int64_t *out, bool *present)
{
    double d = 0;
    bool have = false;
    if (!srv_req_get_number(c, obj, name, lo, hi, &d, &have))
        return false;
    if (present)
        *present = have;
    if (have) {
        if (d != floor(d)) {
            srv_req_fail(c, 400, "\"%s\" must be an integer, not %g", name, d);
            return false;
        }
        *out = (int64_t)d;
    }
    return true;
}

bool srv_req_get_bool(srv_conn *c, const cJSON *obj, const char *name, bool *out)
{
    const cJSON *v = cJSON_GetObjectItemCaseSensitive(obj, name);
    if (srv_req_is_null(v))
        return true;
    if (!cJSON_IsBool(v)) {
        srv_req_fail(c, 400, "\"%s\" must be true or false", name);
        return false;
    }
    *out = cJSON_IsTrue(v);
    return true;
}

bool srv_req_get_string(srv_conn *c, const cJSON *obj, const char *name, const char **out)
{
    const cJSON *v = cJSON_GetObjectItemCaseSensitive(obj, name);
    if (srv_req_is_null(v))
        return true;
    if (!cJSON_IsString(v)) {
        srv_req_fail(c, 400, "\"%s\" must be a string", name);
        return false;
    }
    *out = v->valuestring;
    return true;
}

/* --- what both generation APIs read
 * ------------------------------------------------------------------ */

/* One more stop string for a, inside the bounds: SRV_MAX_STOPS of them,
 * ENG_STOP_MAX_BYTES each and ENG_STOP_MAX_TOTAL_BYTES in all (the
 * engine's, checked here so that a request past them costs nothing). */
static bool add_stop(srv_conn *c, const char *name, const cJSON *it, srv_req_ask *a)
{
    if (!cJSON_IsString(it) || !it->valuestring[0]) {
        srv_req_fail(c, 400, "\"%s\" must hold non-empty strings", name);
        return false;
    }
    if (a->n_stops == SRV_MAX_STOPS) {
        srv_req_fail(c, 400, "\"%s\": at most %d stop strings", name, SRV_MAX_STOPS);
        return false;
    }
    size_t len = strlen(it->valuestring), total = len;
    for (size_t i = 0; i < a->n_stops; i++)
        total += strlen(a->stops[i]);
    if (len > ENG_STOP_MAX_BYTES) {
        srv_req_fail(c, 400, "\"%s\": a stop string of %zu bytes; at most %d bytes each", name, len,
                     ENG_STOP_MAX_BYTES);
        return false;
    }
    if (total > ENG_STOP_MAX_TOTAL_BYTES) {
        srv_req_fail(c, 400,
                     "\"%s\": the stop strings have over %d bytes in all (the most allowed)", name,
                     ENG_STOP_MAX_TOTAL_BYTES);
        return false;
    }
    a->stops[a->n_stops++] = it->valuestring;
    return true;
}

bool srv_req_get_stops(srv_conn *c, const cJSON *obj, const char *name, srv_req_ask *a)
{
    const cJSON *v = cJSON_GetObjectItemCaseSensitive(obj, name);
    if (srv_req_is_null(v))
        return true;
    if (cJSON_IsString(v))
        return add_stop(c, name, v, a);
    if (!cJSON_IsArray(v)) {
        srv_req_fail(c, 400, "\"%s\" must be a string or an array of strings", name);
        return false;
    }
    const cJSON *it;
    cJSON_ArrayForEach (it, v)
        if (!add_stop(c, name, it, a))
            return false;
    return true;
}

/*
 * OpenAI's logit_bias: an object of token ids (decimal strings) to biases
 * in [-100, 100], at most ENG_MAX_LOGIT_BIAS of them, each id inside the
 * model's vocabulary and named once; into a->logit_bias.
 */
static bool get_logit_bias(srv_conn *c, const cJSON *p, srv_req_ask *a)
{
    const cJSON *v = cJSON_GetObjectItemCaseSensitive(p, "logit_bias");
    if (srv_req_is_null(v))
        return true;
    if (!cJSON_IsObject(v)) {
        srv_req_fail(c, 400, "\"logit_bias\" must be an object of token ids to biases");
        return false;
    }
    int32_t vocab = c->s->model.cfg.vocab_size;
    size_t n = 0;
    const cJSON *it;
    cJSON_ArrayForEach (it, v) {
        const char *key = it->string;
        char *end = NULL;
        long long id = -1;
        if (key[0] >= '0' && key[0] <= '9' && strlen(key) <= 10)
            id = strtoll(key, &end, 10);
        if (id < 0 || *end) {
            srv_req_fail(c, 400, "\"logit_bias\": key \"%s\" is not a token id (a decimal integer)",
                         key);
            return false;
        }
        if (vocab > 0 && id >= vocab) {
            srv_req_fail(c, 400,
                         "\"logit_bias\": token id %lld is outside the vocabulary of %d tokens", id,
                         (int)vocab);
            return false;
        }
        if (!cJSON_IsNumber(it) || !(it->valuedouble >= -100 && it->valuedouble <= 100)) {
            char *shown = cJSON_PrintUnformatted(it);
            srv_req_fail(
                c, 400,
                "\"logit_bias\": the bias of token %lld is %s; it must be a number in [-100, 100]",
                id, shown ? shown : "?");
            cJSON_free(shown);
            return false;
        }
        if (n == ENG_MAX_LOGIT_BIAS) {
            srv_req_fail(c, 400, "\"logit_bias\" has %d entries; at most %d", cJSON_GetArraySize(v),
                         ENG_MAX_LOGIT_BIAS);
            return false;
        }
        for (size_t i = 0; i < n; i++)
            if (a->logit_bias[i].token == (int32_t)id) {
                srv_req_fail(c, 400, "\"logit_bias\" names token id %lld twice", id);
                return false;
            }
        a->logit_bias[n++] = (eng_logit_bias){.token = (int32_t)id, .bias = (float)it->valuedouble};
    }
    a->sampling.logit_bias = n ? a->logit_bias : NULL;
    a->sampling.n_logit_bias = n;
    return true;
}

/*
 * The OpenAI and vLLM fields beyond HF's sampling: penalties over the
 * generated tokens, logit_bias, min_tokens (at most the request's maximum,
 * as vLLM checks), ignore_eos. TGI's frequency_penalty is read here too,
 * in TGI's range [-2, 2] and with the formula TGI's documentation gives
 * (OpenAI's). TGI's own code differs: its batched processor counts the
 * prompt and the generated tokens and divides each count by the padded
 * length of the batch's sequences, which would make a request's tokens
 * depend on what else is in the batch; we do not copy that.
 */
static bool get_openai_sampling(srv_conn *c, const cJSON *p, srv_req_ask *a)
{
    double presence = 0, frequency = 0;
    int64_t min_tokens = 0;
    bool ignore_eos = false;
    if (!srv_req_get_number(c, p, "presence_penalty", -2.0, 2.0, &presence, NULL) ||
        !srv_req_get_number(c, p, "frequency_penalty", -2.0, 2.0, &frequency, NULL) ||
        !srv_req_get_int(c, p, "min_tokens", 0, INT32_MAX, &min_tokens, NULL) ||
        !srv_req_get_bool(c, p, "ignore_eos", &ignore_eos) || !get_logit_bias(c, p, a))
        return false;
    if (min_tokens > a->max_new_tokens) {
        srv_req_fail(c, 400, "\"min_tokens\" is %lld; it may not pass the maximum of %lld tokens",
                     (long long)min_tokens, (long long)a->max_new_tokens);
        return false;
    }
    a->sampling.presence_penalty = (float)presence;
    a->sampling.frequency_penalty = (float)frequency;
    a->sampling.min_tokens = (int32_t)min_tokens;
    a->sampling.ignore_eos = ignore_eos;
    return true;
}

bool srv_req_get_sampling(srv_conn *c, const cJSON *p, srv_req_ask *a, bool greedy_default)
{
    double temperature = greedy_default ? 0.0 : 1.0, top_p = 1.0, penalty = 1.0, typical = 1.0;
    int64_t top_k = 0, seed = 0;
    bool has_t = false, has_seed = false, has_k = false, has_p = false, has_typical = false;
    if (!srv_req_get_number(c, p, "temperature", 0.0, 100.0, &temperature, &has_t) ||
        !srv_req_get_number(c, p, "top_p", 0.0, 1.0, &top_p, &has_p) ||
        !srv_req_get_number(c, p, "typical_p", 0.0, 1.0, &typical, &has_typical) ||
        !srv_req_get_int(c, p, "top_k", 0, 1 << 24, &top_k, &has_k) ||
        !srv_req_get_number(c, p, "repetition_penalty", 0.0, 100.0, &penalty, NULL) ||
        !srv_req_get_int(c, p, "seed", 0, 9007199254740991.0, &seed, &has_seed))
        return false;
    if (greedy_default) {
        /* TGI: do_sample, or any sampling parameter, turns sampling on */
        bool do_sample = false;
        if (!srv_req_get_bool(c, p, "do_sample", &do_sample))
            return false;
        if (!do_sample && !has_t && !has_k && !has_p && !has_typical)
            temperature = 0.0;
        else if (!has_t)
            temperature = 1.0;
    }
    if (!get_openai_sampling(c, p, a))
        return false;
    if (has_p && top_p == 0.0) {
        srv_req_fail(c, 400, "\"top_p\" must be in (0, 1]");
        return false;
    }
    if (has_typical && typical == 0.0) {
        srv_req_fail(c, 400, "\"typical_p\" must be in (0, 1]");
        return false;
    }
    a->sampling.typical_p = (float)typical;
    a->sampling.temperature = (float)temperature;
    a->sampling.top_p = (float)top_p;
    a->sampling.top_k = (int32_t)top_k;
    a->sampling.repetition_penalty = (float)penalty;
    a->sampling.seed = has_seed ? (uint64_t)seed : (uint64_t)time(NULL) ^ (uint64_t)c->serial;
    return true;
}

bool srv_req_get_vllm_output(srv_conn *c, const cJSON *root, srv_req_ask *a)
{
    bool skip = true;
    if (!srv_req_get_bool(c, root, "skip_special_tokens", &skip) ||
        !srv_req_get_bool(c, root, "include_stop_str_in_output", &a->include_stop_str))
        return false;
    a->keep_special = !skip;
    return true;
}

bool srv_req_get_speculative(srv_conn *c, const cJSON *obj, srv_req_ask *a)
{
    int64_t n_max = 0, n_min = 0;
    bool has_max = false;
    if (!srv_req_get_int(c, obj, "speculative.n_max", 0, ENG_SPEC_MAX_DRAFT, &n_max, &has_max) ||
        !srv_req_get_int(c, obj, "speculative.n_min", 0, ENG_SPEC_MAX_DRAFT, &n_min, NULL))
        return false;
    if (!srv_req_is_null(cJSON_GetObjectItemCaseSensitive(obj, "speculative.p_min"))) {
        /* llama.cpp's floor on a draft model's token probability: our drafters keep none */
        srv_req_fail(c, 400, "\"speculative.p_min\" is not supported by this server's drafters");
        return false;
    }
    if (has_max && n_min > n_max) {
        srv_req_fail(c, 400,
                     "\"speculative.n_min\" is %lld; it may not pass \"speculative.n_max\" (%lld)",
                     (long long)n_min, (long long)n_max);
        return false;
    }
    a->spec = (eng_spec_request){
        .off = has_max && n_max == 0, .draft_max = (int32_t)n_max, .draft_min = (int32_t)n_min};
    return true;
}

void srv_req_ask_free(srv_req_ask *a)
{
    free(a->token_store);
    free(a->grammar_text);
    if (a->answer_drop)
        a->answer_drop(a->answer);
    a->token_store = NULL;
    a->grammar_text = NULL;
    a->answer = NULL;
    a->answer_drop = NULL;
}

/* --- constrained answers ---------------------------------------------------------- */

bool srv_req_ask_grammar(srv_conn *c, srv_req_ask *a, gr_kind kind, const char *text, size_t len,
                         const char *where)
{
    if (a->grammar_text) {
        srv_req_fail(c, 400, "%s and %s both constrain the answer: give one", a->grammar_where,
                     where);
        return false;
    }
    char *copy = malloc(len + 1);
    if (!copy) {
        srv_req_fail(c, 503, "out of memory");
        return false;
    }
    memcpy(copy, text, len);
    copy[len] = 0;
    a->grammar_text = copy;
    a->grammar_kind = kind;
    snprintf(a->grammar_where, sizeof a->grammar_where, "%s", where);
    return true;
}

/* A JSON Schema given as a value (an object, or true/false) or, as TGI
 * allows, as a JSON string holding one: its text into a, where naming
 * it. */
static bool schema_grammar(srv_conn *c, const cJSON *schema, const char *where, srv_req_ask *a)
{
    if (cJSON_IsString(schema))
        return srv_req_ask_grammar(c, a, GR_JSON_SCHEMA, schema->valuestring,
                                   strlen(schema->valuestring), where);
    if (!cJSON_IsObject(schema) && !cJSON_IsBool(schema)) {
        srv_req_fail(c, 400, "%s must be a JSON Schema (an object)", where);
        return false;
    }
    return srv_req_ask_schema(c, a, schema, where);
}

bool srv_req_ask_schema(srv_conn *c, srv_req_ask *a, const cJSON *schema, const char *where)
{
    char *text = schema ? cJSON_PrintUnformatted(schema) : NULL;
    if (!text) {
        srv_req_fail(c, 503, "out of memory");
        return false;
    }
    bool ok = srv_req_ask_grammar(c, a, GR_JSON_SCHEMA, text, strlen(text), where);
    free(text);
    return ok;
}

/* A regular expression given as a string value, as a's grammar. */
static bool regex_grammar(srv_conn *c, const cJSON *re, const char *where, srv_req_ask *a)
{
    if (!cJSON_IsString(re)) {
        srv_req_fail(c, 400, "%s must be a string (the regular expression)", where);
        return false;
    }
    return srv_req_ask_grammar(c, a, GR_REGEX, re->valuestring, strlen(re->valuestring), where);
}

/* {"type": "json_schema", "json_schema": {"name", "schema", "strict",
 * "description"}} (OpenAI), or TGI's {"type": "json_schema", "value":
 * {"name", "schema"}}: the schema, or any JSON value when none is given
 * (OpenAI's reading of a json_schema without one). */
static bool json_schema_grammar(srv_conn *c, const cJSON *spec, const char *name, srv_req_ask *a)
{
    static const char *const fields[] = {"name", "schema", "strict", "description", NULL};
    const cJSON *js = cJSON_GetObjectItemCaseSensitive(spec, "json_schema");
    const char *key = "json_schema";
    if (srv_req_is_null(js)) {
        js = cJSON_GetObjectItemCaseSensitive(spec, "value");
        key = "value";
    }
    char where[96];
    snprintf(where, sizeof where, "%s.%s", name, key);
    if (!cJSON_IsObject(js)) {
        srv_req_fail(c, 400, "%s must be an object with the schema", where);
        return false;
    }
    bool strict = false;
    if (!srv_req_only_known(c, js, where, fields) || !srv_req_get_bool(c, js, "strict", &strict))
        return false;
    const cJSON *schema = cJSON_GetObjectItemCaseSensitive(js, "schema");
    snprintf(where, sizeof where, "%s.%s.schema", name, key);
    if (srv_req_is_null(schema))
        return srv_req_ask_grammar(c, a, GR_JSON_SCHEMA, "{}", 2, where);
    return schema_grammar(c, schema, where, a);
}

bool srv_req_get_grammar(srv_conn *c, const cJSON *obj, const char *name, const char *label,
                         srv_req_ask *a)
{
    static const char *const fields[] = {"type", "value", "json_schema", NULL};
    const cJSON *spec = cJSON_GetObjectItemCaseSensitive(obj, name);
    name = label; /* what the messages call it */
    if (srv_req_is_null(spec))
        return true;
    const char *type = cJSON_IsObject(spec) ? mf_json_str(spec, "type") : NULL;
    if (!type) {
        srv_req_fail(c, 400, "\"%s\" must be an object with a \"type\"", name);
        return false;
    }
    if (!srv_req_only_known(c, spec, name, fields))
        return false;
    const cJSON *value = cJSON_GetObjectItemCaseSensitive(spec, "value");
    char where[96];
    snprintf(where, sizeof where, "%s.value", name);
    if (strcmp(type, "text") == 0 && srv_req_is_null(value))
        return true;
    if (strcmp(type, "json_object") == 0 && srv_req_is_null(value))
        return srv_req_ask_grammar(c, a, GR_JSON_SCHEMA, "{\"type\":\"object\"}", 17, name);
    if (strcmp(type, "json_schema") == 0)
        return json_schema_grammar(c, spec, name, a);
    if (strcmp(type, "json") == 0 || strcmp(type, "json_object") == 0) {
        if (srv_req_is_null(value)) {
            srv_req_fail(c, 400, "%s: a grammar of type %s needs the schema in \"value\"", name,
                         type);
            return false;
        }
        return schema_grammar(c, value, where, a);
    }
    if (strcmp(type, "regex") == 0)
        return regex_grammar(c, value, where, a);
    srv_req_fail(c, 400,
                 "%s.type must be text, json_object, json_schema, json or regex, not %s (with no "
                 "\"value\" for text)",
                 name, type);
    return false;
}

/* guided_choice's strings as one regular expression: each string's
 * characters literal (a metacharacter escaped), the strings alternated. */
static char *choice_regex(srv_conn *c, const cJSON *list, const char *where)
{
    size_t cap = 3, n = 0;
    const cJSON *x;
    cJSON_ArrayForEach (x, list) {
        if (!cJSON_IsString(x) || !x->valuestring[0]) {
            srv_req_fail(c, 400, "%s must be a non-empty list of non-empty strings", where);
            return NULL;
        }
        cap += 2 * strlen(x->valuestring) + 1;
        n++;
    }
    if (n == 0) {
        srv_req_fail(c, 400, "%s must be a non-empty list of non-empty strings", where);
        return NULL;
    }
    char *re = malloc(cap), *o = re;
    if (!re) {
        srv_req_fail(c, 503, "out of memory");
        return NULL;
    }
    *o++ = '(';
    cJSON_ArrayForEach (x, list) {
        if (x != list->child)
            *o++ = '|';
        for (const char *p = x->valuestring; *p; p++) {
            if (strchr("\\.^$|?*+()[]{}/-", *p))
                *o++ = '\\';
            *o++ = *p;
        }
    }
    *o++ = ')';
    *o = 0;
    return re;
}

bool srv_req_get_guided(srv_conn *c, const cJSON *root, srv_req_ask *a)
{
    static const char *const so_fields[] = {"json", "regex", "choice", "grammar", NULL};
    const cJSON *so = cJSON_GetObjectItemCaseSensitive(root, "structured_outputs");
    if (!srv_req_is_null(so) && !cJSON_IsObject(so)) {
        srv_req_fail(c, 400, "\"structured_outputs\" must be an object");
        return false;
    }
    if (!srv_req_is_null(so) && !srv_req_only_known(c, so, "structured_outputs", so_fields))
        return false;
    /* each way of asking, vLLM's older name first */
    static const struct {
        const char *key, *so_key;
    } ways[] = {{"guided_json", "json"},
                {"guided_regex", "regex"},
                {"guided_choice", "choice"},
                {"guided_grammar", "grammar"}};
    const cJSON *value = NULL;
    int way = -1;
    char where[64] = "";
    for (int i = 0; i < 4; i++) {
        const cJSON *v = cJSON_GetObjectItemCaseSensitive(root, ways[i].key);
        const char *name = ways[i].key;
        char so_name[48];
        if (srv_req_is_null(v) && !srv_req_is_null(so)) {
            v = cJSON_GetObjectItemCaseSensitive(so, ways[i].so_key);
            snprintf(so_name, sizeof so_name, "structured_outputs.%s", ways[i].so_key);
            name = so_name;
        }
        if (srv_req_is_null(v))
            continue;
        if (way >= 0) {
            srv_req_fail(c, 400, "%s and %s both constrain the answer: give one", where, name);
            return false;
        }
        way = i;
        value = v;
        snprintf(where, sizeof where, "%s", name);
    }
    if (way < 0)
        return true;
    if (way == 0)
        return schema_grammar(c, value, where, a);
    if (way == 1)
        return regex_grammar(c, value, where, a);
    if (way == 3) {
        srv_req_fail(c, 400,
                     "%s (a context-free grammar in EBNF) is not supported: use a JSON Schema "
                     "(guided_json) or a regular expression (guided_regex)",
                     where);
        return false;
    }
    if (!cJSON_IsArray(value)) {
        srv_req_fail(c, 400, "%s must be a non-empty list of non-empty strings", where);
        return false;
    }
    char *re = choice_regex(c, value, where);
    bool ok = re && srv_req_ask_grammar(c, a, GR_REGEX, re, strlen(re), where);
    free(re);
    return ok;
}

const char *srv_req_adapter_named(const srv_conn *c, const char *model)
{
    if (!model || strcmp(model, c->s->model_id) == 0)
        return NULL;
    /* the names TGI's own clients send when they point at one server's
     * URL: TGI's documented placeholder, and huggingface_hub's */
    static const char *const placeholders[] = {"tgi", "dummy", NULL};
    for (size_t i = 0; placeholders[i]; i++)
        if (strcmp(model, placeholders[i]) == 0)
            return NULL;
    return model;
}

/* --- which weights serve --------------------------------------------------------- */

void srv_req_add_weights_identity(cJSON *o, const lora_state *st)
{
    cJSON_AddNumberToObject(o, "weights_version", (double)st->version);
    char digest[20];
    snprintf(digest, sizeof digest, "%016llx", (unsigned long long)st->digest);
    cJSON_AddStringToObject(o, "weights_digest", digest);
    cJSON *merged = cJSON_AddArrayToObject(o, "merged");
    for (size_t i = 0; i < st->n_merged && i < ENG_MAX_MERGED; i++) {
        cJSON *m = cJSON_CreateObject();
        cJSON_AddStringToObject(m, "name", st->merged[i].name);
        cJSON_AddNumberToObject(m, "scale", st->merged[i].scale);
        cJSON_AddItemToArray(merged, m);
    }
}

bool srv_req_is_adapter_name(const char *name)
{
    return lora_name_valid(name); /* the one check, shared with the journal's replay */
}

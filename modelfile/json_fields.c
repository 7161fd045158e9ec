/*
 * json_fields.c - the JSON field readers every loader shares (config.json,
 * tokenizer.json and tokenizer_config.json, quant states, adapter
 * configs): one definition of "an integer", "a number", "a string", "a
 * bool" in a file we did not write, so the loaders agree on what they
 * accept.
 *
 * It owns nothing: every string it returns is borrowed from the caller's
 * cJSON tree, and it touches nothing but that tree and the caller's
 * message buffer.
 */
#include "modelfile.h"

#include <cjson/cJSON.h>
#include <inttypes.h>
#include <math.h>

const char *mf_json_str(const cJSON *j, const char *key)
{
    const cJSON *v = cJSON_GetObjectItemCaseSensitive(j, key);
    return cJSON_IsString(v) ? v->valuestring : NULL;
}

bool mf_json_bool(const cJSON *j, const char *key, bool def)
{
    const cJSON *v = cJSON_GetObjectItemCaseSensitive(j, key);
    return cJSON_IsBool(v) ? cJSON_IsTrue(v) : def;
}

bool mf_json_number(const cJSON *v, double *out)
{
    if (!cJSON_IsNumber(v) || !isfinite(v->valuedouble))
        return false;
    *out = v->valuedouble;
    return true;
}

bool mf_json_integer(const cJSON *v, int64_t lo, int64_t hi, int64_t *out)
{
    /* a double holds every integer up to 2^53 exactly; past that a bound
     * compare in double is still right for the values JSON files hold */
    double x;
    if (!mf_json_number(v, &x) || x != floor(x) || x < (double)lo || x > (double)hi)
        return false;
    *out = (int64_t)x;
    return true;
}

int mf_json_int_field(const char *path, const cJSON *j, const char *key, int64_t def, bool required,
                      int64_t lo, int64_t hi, int64_t *out, char *msg, size_t msg_len)
{
    const cJSON *v = cJSON_GetObjectItemCaseSensitive(j, key);
    if (!v || cJSON_IsNull(v)) {
        if (required)
            return ql_fail(msg, msg_len, QL_EFORMAT, "%s: \"%s\" is missing", path, key);
        *out = def;
        return QL_OK;
    }
    if (!mf_json_integer(v, lo, hi, out))
        return ql_fail(msg, msg_len, QL_EFORMAT,
                       "%s: \"%s\" must be an integer in [%" PRId64 ", %" PRId64 "]", path, key, lo,
                       hi);
    return QL_OK;
}

int mf_json_positive_field(const char *path, const cJSON *j, const char *key, double def,
                           double *out, char *msg, size_t msg_len)
{
    const cJSON *v = cJSON_GetObjectItemCaseSensitive(j, key);
    if (!v || cJSON_IsNull(v)) {
        *out = def;
        return QL_OK;
    }
    double x;
    if (!mf_json_number(v, &x) || x <= 0)
        return ql_fail(msg, msg_len, QL_EFORMAT, "%s: \"%s\" must be a positive number", path, key);
    *out = x;
    return QL_OK;
}

int32_t mf_json_token_id(const cJSON *j, const char *key)
{
    const cJSON *v = cJSON_GetObjectItemCaseSensitive(j, key);
    if (cJSON_IsArray(v))
        v = cJSON_GetArrayItem(v, 0);
    /* a fraction is dropped, as the loaders always have; 1e9 is past any
     * vocabulary (and keeps the id an int32) */
    double x;
    if (mf_json_number(v, &x) && x >= 0 && x < 1e9)
        return (int32_t)x;
    return -1;
}

/*
 * json_fields.c - the JSON field readers every loader shares (config.json,
 * tokenizer.json and tokenizer_config.json, quant states, adapter
 * configs): one definition of "an integer", "a string", "a bool" in a file
 * we did not write, so the loaders agree on what they accept.
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

bool mf_json_integer(const cJSON *v, int64_t lo, int64_t hi, int64_t *out)
{
    /* a double holds every integer up to 2^53 exactly; past that a bound
     * compare in double is still right for the values JSON files hold */
    if (!cJSON_IsNumber(v) || !isfinite(v->valuedouble) ||
        v->valuedouble != floor(v->valuedouble) || v->valuedouble < (double)lo ||
        v->valuedouble > (double)hi)
        return false;
    *out = (int64_t)v->valuedouble;
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

/*
 * ql_names.c - the words a user types for a choice, one table per choice
 * (ql_base.h): config checks a flag's word against the table, and the
 * module that acts on the choice parses the same word with the same table,
 * so a word added or renamed is added or renamed once.
 */
#include "ql_base.h"

#include <stdio.h>
#include <string.h>

#define NAMES(rows)                                                                                \
    {                                                                                              \
        rows, sizeof rows / sizeof *rows                                                           \
    }

static const ql_name device_rows[] = {
    {"cpu", QL_DEVICE_CPU}, {"cuda", QL_DEVICE_CUDA}, {"auto", QL_DEVICE_AUTO}};
static const ql_name kv_dtype_rows[] = {
    {"f32", QL_KV_DTYPE_F32}, {"f16", QL_KV_DTYPE_F16}, {"q8_0", QL_KV_DTYPE_Q8_0}};
static const ql_name into_rows[] = {{"int8", QL_INTO_INT8}, {"bf16", QL_INTO_BF16}};
static const ql_name adapter_dtype_rows[] = {{"bf16", QL_ADAPTER_DTYPE_BF16},
                                             {"f32", QL_ADAPTER_DTYPE_F32}};
static const ql_name activations_rows[] = {{"f32", QL_ACTIVATIONS_F32}, {"q8", QL_ACTIVATIONS_Q8}};
static const ql_name speculative_rows[] = {
    {"off", QL_SPEC_OFF}, {"ngram", QL_SPEC_NGRAM}, {"draft", QL_SPEC_DRAFT}, {"mtp", QL_SPEC_MTP}};

const ql_names ql_device_names = NAMES(device_rows);
const ql_names ql_kv_dtype_names = NAMES(kv_dtype_rows);
const ql_names ql_into_names = NAMES(into_rows);
const ql_names ql_adapter_dtype_names = NAMES(adapter_dtype_rows);
const ql_names ql_activations_names = NAMES(activations_rows);
const ql_names ql_speculative_names = NAMES(speculative_rows);

int ql_name_parse(const ql_names *t, const char *word)
{
    for (size_t i = 0; word && i < t->n; i++)
        if (strcmp(word, t->rows[i].word) == 0)
            return t->rows[i].value;
    return -1;
}

const char *ql_name_of(const ql_names *t, int value)
{
    for (size_t i = 0; i < t->n; i++)
        if (t->rows[i].value == value)
            return t->rows[i].word;
    return NULL;
}

const char *ql_name_list(const ql_names *t, char *out, size_t out_len)
{
    size_t at = 0;
    if (out_len)
        out[0] = 0;
    for (size_t i = 0; i < t->n && at < out_len; i++) {
        int n = snprintf(out + at, out_len - at, "%s%s", i ? ", " : "", t->rows[i].word);
        at += n > 0 ? (size_t)n : 0;
    }
    return out;
}

int ql_name_expect(const ql_names *t, const char *what, const char *word, char *msg, size_t msg_len)
{
    int value = ql_name_parse(t, word);
    if (value >= 0)
        return value;
    char list[64];
    return ql_fail(msg, msg_len, QL_EINVAL, "%s \"%s\": one of %s", what, word ? word : "(null)",
                   ql_name_list(t, list, sizeof list));
}

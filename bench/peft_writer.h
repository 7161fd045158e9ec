/*
 * peft_writer.h - writes a random PEFT LoRA adapter folder for a loaded
 * model (adapter_config.json and adapter_model.safetensors, bf16, all seven
 * projections of every layer), for the benchmarks and the README's
 * examples. Not a trained adapter: A is drawn like PEFT's Kaiming-uniform
 * init, B so that each module's delta scale * B @ A has a Frobenius norm
 * of `ratio` times its weight's, the size that decides what a merge keeps.
 */
#ifndef QL_PEFT_WRITER_H
#define QL_PEFT_WRITER_H

#include <cjson/cJSON.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>

#include "model.h"
#include "modelfile.h"

static inline uint64_t peft_rng_next(uint64_t *s)
{
    /* splitmix64 */
    uint64_t z = (*s += 0x9E3779B97F4A7C15ull);
    z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
    z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
    return z ^ (z >> 31);
}

/* Uniform in [-1, 1). */
static inline float peft_uniform(uint64_t *s)
{
    return (float)((double)(peft_rng_next(s) >> 11) * 0x1.0p-53) * 2.0f - 1.0f;
}

/* One module's A and B (bf16) into w; the buffers go to keep[]. */
static inline int peft_write_module(st_writer *w, const eng_model *m, int32_t l, eng_proj p,
                                    int rank, float alpha, double ratio, uint64_t *rng, void **keep,
                                    char *msg, size_t msg_len)
{
    const qtensor *wt = eng_model_proj(m, l, p);
    int64_t in = wt->cols, out = wt->rows;
    float *A = malloc((size_t)(rank * in) * sizeof *A);
    float *B = malloc((size_t)(out * rank) * sizeof *B);
    float *W = malloc((size_t)(out * in) * sizeof *W);
    uint16_t *a16 = malloc((size_t)(rank * in) * 2), *b16 = malloc((size_t)(out * rank) * 2);
    keep[0] = a16;
    keep[1] = b16;
    int rc = A && B && W && a16 && b16 ? QL_OK : ql_fail(msg, msg_len, QL_ENOMEM, "out of memory");
    if (rc == QL_OK) {
        /* Kaiming-uniform(a = sqrt(5)) as nn.Linear and PEFT: bound 1/sqrt(in) */
        double bound = 1.0 / sqrt((double)in), scale = (double)alpha / rank;
        for (int64_t i = 0; i < rank * in; i++)
            A[i] = (float)(bound * peft_uniform(rng));
        for (int64_t i = 0; i < out * rank; i++)
            B[i] = peft_uniform(rng);
        /* the delta's norm, then B rescaled so it is ratio * |W| */
        qt_dequantize_rows(wt, 0, out, W);
        double wn = 0, dn2 = 0;
        for (int64_t i = 0; i < out * in; i++)
            wn += (double)W[i] * W[i];
        for (int64_t r = 0; r < out; r++)
            for (int64_t c = 0; c < in; c++) {
                double d = 0;
                for (int k = 0; k < rank; k++)
                    d += (double)B[r * rank + k] * A[k * in + c];
                dn2 += d * d * scale * scale;
            }
        double k = ratio * sqrt(wn) / sqrt(dn2);
        for (int64_t i = 0; i < rank * in; i++)
            a16[i] = qt_f32_to_bf16(A[i]);
        for (int64_t i = 0; i < out * rank; i++)
            b16[i] = qt_f32_to_bf16((float)(B[i] * k));
        char name[256];
        int64_t sa[2] = {rank, in}, sb[2] = {out, rank};
        snprintf(name, sizeof name, "base_model.model.model.layers.%d.%s.%s.lora_A.weight", l,
                 eng_proj_parent(p), eng_proj_name(p));
        rc = st_writer_add(w, name, ST_BF16, 2, sa, a16, (size_t)(rank * in) * 2, false, msg,
                           msg_len);
        snprintf(name, sizeof name, "base_model.model.model.layers.%d.%s.%s.lora_B.weight", l,
                 eng_proj_parent(p), eng_proj_name(p));
        if (rc == QL_OK)
            rc = st_writer_add(w, name, ST_BF16, 2, sb, b16, (size_t)(out * rank) * 2, false, msg,
                               msg_len);
    }
    free(A);
    free(B);
    free(W);
    return rc;
}

/* Write the folder dir (created when missing) for m. */
static inline int peft_write_random(const eng_model *m, const char *dir, int rank, float alpha,
                                    double ratio, uint64_t seed, char *msg, size_t msg_len)
{
    char path[8192];
    mkdir(dir, 0755);
    cJSON *cfg = cJSON_CreateObject();
    cJSON_AddStringToObject(cfg, "peft_type", "LORA");
    cJSON_AddNumberToObject(cfg, "r", rank);
    cJSON_AddNumberToObject(cfg, "lora_alpha", alpha);
    cJSON_AddNumberToObject(cfg, "lora_dropout", 0.0);
    cJSON *targets = cJSON_AddArrayToObject(cfg, "target_modules");
    for (int p = 0; p < ENG_N_PROJ; p++)
        cJSON_AddItemToArray(targets, cJSON_CreateString(eng_proj_name((eng_proj)p)));
    cJSON_AddStringToObject(cfg, "bias", "none");
    cJSON_AddFalseToObject(cfg, "use_rslora");
    cJSON_AddFalseToObject(cfg, "fan_in_fan_out");
    cJSON_AddStringToObject(cfg, "base_model_name_or_path", m->name);
    cJSON_AddStringToObject(cfg, "task_type", "CAUSAL_LM");
    char *text = cJSON_Print(cfg);
    cJSON_Delete(cfg);
    snprintf(path, sizeof path, "%s/adapter_config.json", dir);
    FILE *f = fopen(path, "w");
    if (!f || !text) {
        free(text);
        if (f)
            fclose(f);
        return ql_fail(msg, msg_len, QL_EIO, "cannot write %s", path);
    }
    fputs(text, f);
    fputc('\n', f);
    free(text);
    fclose(f);
    st_writer *w = st_writer_new();
    size_t n = (size_t)m->cfg.n_layers * ENG_N_PROJ;
    void **keep = calloc(2 * n, sizeof *keep);
    int rc = keep ? QL_OK : ql_fail(msg, msg_len, QL_ENOMEM, "out of memory");
    for (size_t i = 0; rc == QL_OK && i < n; i++)
        rc = peft_write_module(w, m, (int32_t)(i / ENG_N_PROJ), (eng_proj)(i % ENG_N_PROJ), rank,
                               alpha, ratio, &seed, keep + 2 * i, msg, msg_len);
    snprintf(path, sizeof path, "%s/adapter_model.safetensors", dir);
    if (rc == QL_OK)
        rc = st_writer_write(w, path, msg, msg_len);
    st_writer_free(w);
    for (size_t i = 0; keep && i < 2 * n; i++)
        free(keep[i]);
    free(keep);
    return rc;
}

#endif

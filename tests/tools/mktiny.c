/*
 * mktiny.c - write a tiny Llama-shaped safetensors file of random weights
 * (bf16, N(0, 0.02); norms at 1), the kind of model the tests and the
 * README's demo build for themselves instead of downloading one.
 *
 * Usage: mktiny OUT.safetensors [--layers N] [--hidden N] [--seed N]
 */
#include "engine.h"

#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

static uint64_t rng = 1;

static float normal(void)
{
    double u[2];
    for (int i = 0; i < 2; i++) {
        uint64_t z = (rng += 0x9e3779b97f4a7c15ull);
        z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
        z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
        u[i] = (double)((z ^ (z >> 31)) >> 11) * 0x1.0p-53;
    }
    return (float)(sqrt(-2.0 * log(u[0] + 1e-300)) * cos(6.283185307179586 * u[1]));
}

static int add(st_writer *w, const char *name, int64_t rows, int64_t cols, bool norm)
{
    int64_t n = rows * cols;
    uint16_t *v = malloc((size_t)n * sizeof *v);
    if (!v)
        return -1;
    for (int64_t i = 0; i < n; i++)
        v[i] = qt_f32_to_bf16(norm ? 1.0f : 0.02f * normal());
    int64_t shape[2] = {rows, cols};
    char msg[256];
    int rc = st_writer_add(w, name, ST_BF16, norm ? 1 : 2, norm ? shape + 1 : shape, v,
                           (size_t)n * sizeof *v, true, msg, sizeof msg);
    free(v);
    if (rc)
        fprintf(stderr, "mktiny: %s\n", msg);
    return rc;
}

int main(int argc, char **argv)
{
    if (argc < 2) {
        fprintf(stderr, "usage: mktiny OUT.safetensors [--layers N] [--hidden N] [--seed N]\n");
        return 2;
    }
    int64_t layers = 2, hidden = 64, vocab = 256;
    for (int i = 2; i + 1 < argc; i += 2) {
        if (!strcmp(argv[i], "--layers"))
            layers = atoll(argv[i + 1]);
        else if (!strcmp(argv[i], "--hidden"))
            hidden = atoll(argv[i + 1]);
        else if (!strcmp(argv[i], "--seed"))
            rng = (uint64_t)atoll(argv[i + 1]);
    }
    if (layers < 1 || hidden < 32 || hidden % 32) {
        fprintf(stderr, "mktiny: --layers >= 1, --hidden a multiple of 32\n");
        return 2;
    }
    int64_t inter = 2 * hidden, kv = hidden / 2;
    st_writer *w = st_writer_new();
    int rc = add(w, "model.embed_tokens.weight", vocab, hidden, false);
    char name[128];
    static const struct {
        const char *name;
        int out, in; /* 0 hidden, 1 kv, 2 intermediate */
    } linears[] = {
        {"self_attn.q_proj", 0, 0}, {"self_attn.k_proj", 1, 0}, {"self_attn.v_proj", 1, 0},
        {"self_attn.o_proj", 0, 0}, {"mlp.gate_proj", 2, 0},    {"mlp.up_proj", 2, 0},
        {"mlp.down_proj", 0, 2},
    };
    int64_t dims[3] = {hidden, kv, inter};
    for (int64_t l = 0; l < layers && !rc; l++) {
        for (size_t k = 0; k < sizeof linears / sizeof *linears && !rc; k++) {
            snprintf(name, sizeof name, "model.layers.%lld.%s.weight", (long long)l,
                     linears[k].name);
            rc = add(w, name, dims[linears[k].out], dims[linears[k].in], false);
        }
        snprintf(name, sizeof name, "model.layers.%lld.input_layernorm.weight", (long long)l);
        rc = rc ? rc : add(w, name, 1, hidden, true);
        snprintf(name, sizeof name, "model.layers.%lld.post_attention_layernorm.weight",
                 (long long)l);
        rc = rc ? rc : add(w, name, 1, hidden, true);
    }
    rc = rc ? rc : add(w, "model.norm.weight", 1, hidden, true);
    rc = rc ? rc : add(w, "lm_head.weight", vocab, hidden, false);
    char msg[512];
    if (!rc)
        st_writer_set_metadata(w, "format", "pt");
    if (!rc && (rc = st_writer_write(w, argv[1], msg, sizeof msg)))
        fprintf(stderr, "mktiny: %s\n", msg);
    st_writer_free(w);
    return rc ? 1 : 0;
}

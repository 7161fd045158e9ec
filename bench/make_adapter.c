/*
 * make_adapter.c - writes a random PEFT LoRA adapter for a model
 * (bench/peft_writer.h): something to load, merge and serve when no
 * trained adapter is at hand, as the README's examples do. Its deltas are
 * random, so it changes the model's answers without improving them.
 *
 * Usage: make_adapter --model PATH --out DIR [--rank 16] [--alpha 32]
 *                     [--delta-ratio 0.02] [--seed 1]
 */
#include "peft_writer.h"

int main(int argc, char **argv)
{
    const char *model = NULL, *out = NULL;
    int rank = 16;
    float alpha = 32.0f;
    double ratio = 0.02;
    uint64_t seed = 1;
    for (int i = 1; i < argc; i++) {
        if (i + 1 < argc && strcmp(argv[i], "--model") == 0)
            model = argv[++i];
        else if (i + 1 < argc && strcmp(argv[i], "--out") == 0)
            out = argv[++i];
        else if (i + 1 < argc && strcmp(argv[i], "--rank") == 0)
            rank = atoi(argv[++i]);
        else if (i + 1 < argc && strcmp(argv[i], "--alpha") == 0)
            alpha = (float)atof(argv[++i]);
        else if (i + 1 < argc && strcmp(argv[i], "--delta-ratio") == 0)
            ratio = atof(argv[++i]);
        else if (i + 1 < argc && strcmp(argv[i], "--seed") == 0)
            seed = strtoull(argv[++i], NULL, 10);
        else
            model = NULL, i = argc;
    }
    if (!model || !out || rank < 1 || rank > 1024 || !(ratio > 0)) {
        fprintf(stderr, "usage: make_adapter --model PATH --out DIR [--rank 1..1024] [--alpha A] "
                        "[--delta-ratio R > 0] [--seed N]\n");
        return 2;
    }
    char msg[1024];
    eng_model m;
    eng_load_opts lo = {.path = model};
    if (eng_model_load(&m, &lo, msg, sizeof msg) != QL_OK ||
        peft_write_random(&m, out, rank, alpha, ratio, seed, msg, sizeof msg) != QL_OK) {
        fprintf(stderr, "make_adapter: %s\n", msg);
        return 1;
    }
    printf("%s: rank %d, alpha %g, %d modules, delta %.3g of each weight\n", out, rank,
           (double)alpha, m.cfg.n_layers * ENG_N_PROJ, ratio);
    eng_model_free(&m);
    return 0;
}

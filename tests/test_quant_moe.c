/*
 * test_quant_moe.c - MoE experts in the integer checkpoint formats, one
 * weight per expert as Qwen3-30B-A3B's quantized checkpoints hold them:
 * GPTQ (mlp.experts.N.gate_proj.qweight / qzeros / scales / g_idx, v1
 * zeros, 4 bits, group 16, symmetric), AutoAWQ GEMM (qweight / qzeros /
 * scales, group 32) and compressed-tensors pack-quantized (weight_packed /
 * weight_scale / weight_zero_point, int4, group 16, asymmetric, bf16
 * scales, ignore ["lm_head", "re:.*mlp.gate$"]):
 *
 *   - every expert loads in its kind in place (codes borrowed from the
 *     mapping), the routers stay dense, and layer 1's attention and expert
 *     weights dequantize to the fixture writer's float32, bit for bit;
 *   - logits within 1e-5 of transformers' float64 forward over the
 *     dequantized weights, and 12 greedy ids equal;
 *   - a --dtype bf16 load leaves the experts in their kind (the routers
 *     cast), and inspect counts them;
 *   - PEFT's target_parameters adapter (peft/qwen3moe_experts) unmerged
 *     against the float64 pass with it, and merged into each expert's own
 *     kind against the float64 pass over the merged weights;
 *   - fused 3-D experts in these formats are refused by name.
 *
 * Fixtures: make_quant_moe_reference.py (gptqmoe_tiny/, awqmoe_tiny/,
 * ctmoe_int4_tiny/, quant_moe_reference.h) over make_moe_reference.py's
 * qwen3moe_tiny/.
 */
#include <criterion/criterion.h>
#include <stdlib.h>
#include <string.h>

#include "cli.h"
#include "fixtures/quant_moe_reference.h"
#include "quant_checkpoint.h"
#include "tiny_model.h"

/* One fixture: its folder, the kind its experts load as, its references. */
typedef struct qmoe_case {
    const char *folder, *format;
    qt_kind kind;
    const qmoe_digest *digests; /* layer 1's attention and experts */
    size_t n_digests;
    const double *logits;
    const int *greedy;
} qmoe_case;

#define QMOE_CASE(folder, format, kind, SYM)                                                       \
    {                                                                                              \
        folder, format, kind, QMOE_##SYM##_DIGESTS,                                                \
            sizeof QMOE_##SYM##_DIGESTS / sizeof *QMOE_##SYM##_DIGESTS,                            \
            &QMOE_##SYM##_LOGITS[0][0], QMOE_##SYM##_GREEDY                                        \
    }

static const qmoe_case cases[3] = {
    QMOE_CASE("gptqmoe_tiny", "gptq", QT_GPTQ, GPTQ),
    QMOE_CASE("awqmoe_tiny", "awq", QT_AWQ, AWQ),
    QMOE_CASE("ctmoe_int4_tiny", "compressed-tensors", QT_CT_INT, CT),
};

/* The case's fixture folder (a tokenizer beside it) in a temporary dir
 * (*dir, to test_rmtree), loaded into *m. */
static void load_fixture(const qmoe_case *c, eng_model *m, char *dir, size_t cap)
{
    char msg[1024];
    test_tmpdir(dir, cap);
    cr_assert(dir[0]);
    tiny_fixture_folder(c->folder, dir);
    cr_assert_eq(eng_model_load(m, &(eng_load_opts){.path = dir}, msg, sizeof msg), 0, "%s: %s",
                 c->folder, msg);
}

/* Every expert of m in the case's kind with its codes borrowed from the
 * mapping; every router dense. */
static void experts_in_their_kind(const eng_model *m, const qmoe_case *c)
{
    static const eng_proj parts[3] = {ENG_PROJ_GATE, ENG_PROJ_UP, ENG_PROJ_DOWN};
    for (int32_t l = 0; l < m->cfg.n_layers; l++) {
        cr_assert_eq(m->layers[l].router.kind, QT_F32, "%s: layer %d's router", c->folder, l);
        for (int32_t e = 0; e < m->cfg.n_experts; e++)
            for (int k = 0; k < 3; k++) {
                const qtensor *t = eng_model_proj(m, l, eng_expert_proj(e, parts[k]));
                cr_assert_eq(t->kind, c->kind, "%s: layer %d expert %d part %d: %s", c->folder, l,
                             e, k, qt_kind_name(t->kind));
                cr_assert(t->data_borrowed, "%s: layer %d expert %d: codes copied", c->folder, l,
                          e);
            }
    }
}

Test(quant_moe, experts_load_in_their_kind_and_dequantize_bit_for_bit)
{
    for (int k = 0; k < 3; k++) {
        const qmoe_case *c = &cases[k];
        char dir[512];
        eng_model m;
        load_fixture(c, &m, dir, sizeof dir);
        cr_assert_eq(m.cfg.n_experts, 8);
        experts_in_their_kind(&m, c);
        size_t experts = 0;
        for (size_t i = 0; i < c->n_digests; i++) {
            const qtensor *t = qcp_projection(&m, c->digests[i].name);
            cr_assert_eq(t->kind, c->kind, "%s", c->digests[i].name);
            size_t n = (size_t)(t->rows * t->cols);
            float *ref = malloc(n * sizeof *ref), *fast = malloc(n * sizeof *fast);
            qt_dequantize_rows_ref(t, 0, t->rows, ref);
            qt_dequantize_rows(t, 0, t->rows, fast);
            cr_assert_eq(qcp_fnv1a64(ref, n * sizeof *ref), c->digests[i].fnv,
                         "%s %s: not the writer's dequantization, bit for bit", c->folder,
                         c->digests[i].name);
            cr_assert_eq(memcmp(ref, fast, n * sizeof *ref), 0, "%s", c->digests[i].name);
            experts += strstr(c->digests[i].name, ".experts.") != NULL;
            free(ref);
            free(fast);
        }
        cr_assert_eq(experts, 24, "%s: every expert part of layer 1 pinned", c->folder);
        eng_model_free(&m);
        test_rmtree(dir);
    }
}

Test(quant_moe, logits_and_greedy_ids_match_float64)
{
    for (int k = 0; k < 3; k++) {
        const qmoe_case *c = &cases[k];
        char dir[512];
        eng_model m;
        load_fixture(c, &m, dir, sizeof dir);
        qcp_logits_and_greedy(&m, c->folder,
                              &(qcp_reference){QMOE_TOKENS, QMOE_N_TOKENS, c->logits, QMOE_VOCAB,
                                               QMOE_PROMPT, 6, c->greedy, QMOE_N_GREEDY});
        eng_model_free(&m);
        test_rmtree(dir);
    }
}

/* --dtype bf16 casts what the checkpoint left dense (routers among them)
 * and leaves every expert in its kind; inspect counts the 84 quantized
 * linears (12 attention, 72 expert parts) by kind and scale dtype. */
Test(quant_moe, a_bf16_load_leaves_the_experts_and_inspect_counts_them)
{
    static const char *counts[3] = {"gptq (f16 scales) x84", "awq (f16 scales) x84",
                                    "ct_int (bf16 scales) x84"};
    for (int k = 0; k < 3; k++) {
        const qmoe_case *c = &cases[k];
        char dir[512], msg[1024];
        test_tmpdir(dir, sizeof dir);
        tiny_fixture_folder(c->folder, dir);
        eng_model m;
        cr_assert_eq(
            eng_model_load(&m, &(eng_load_opts){.path = dir, .dtype = "bf16"}, msg, sizeof msg), 0,
            "%s: %s", c->folder, msg);
        for (int32_t l = 0; l < m.cfg.n_layers; l++) {
            cr_assert_eq(m.layers[l].router.kind, QT_BF16, "%s", c->folder);
            for (int32_t e = 0; e < m.cfg.n_experts; e++)
                cr_assert_eq(eng_model_proj(&m, l, eng_expert_proj(e, ENG_PROJ_UP))->kind, c->kind,
                             "%s: layer %d expert %d", c->folder, l, e);
        }
        eng_model_free(&m);
        qcp_inspect_has(dir, counts[k]);
        test_rmtree(dir);
    }
}

/* PEFT's target_parameters adapter (qcp_experts_adapter) on each fixture:
 * unmerged, and merged into each expert's own kind, expert 6's down_proj
 * keeping its layout. */
static void merged_in_kind(const qtensor *merged, const qtensor *own, const void *ctx)
{
    const qmoe_case *c = ctx;
    cr_assert_eq(merged->kind, c->kind, "%s: merged into %s", c->folder,
                 qt_kind_name(merged->kind));
    cr_assert_eq(merged->bits, own->bits);
    cr_assert_eq(merged->group_size, own->group_size);
    cr_assert_eq(merged->scale_dtype, own->scale_dtype);
}

Test(quant_moe, a_peft_adapter_on_quantized_experts_unmerged_and_merged)
{
    for (int k = 0; k < 3; k++) {
        char dir[512];
        eng_model m;
        load_fixture(&cases[k], &m, dir, sizeof dir);
        qcp_experts_adapter(&m, cases[k].folder, QMOE_TOKENS, QMOE_N_TOKENS, merged_in_kind,
                            &cases[k]);
        eng_model_free(&m);
        test_rmtree(dir);
    }
}

/* dir/model.safetensors with every per-expert tensor replaced by a fused
 * 3-D one per layer and part (mlp.experts.gate_up_proj.<suffix> [experts,
 * ...] of expert 0's bytes, and down_proj's), as no writer of these
 * formats makes them. */
static void fuse_experts(const char *dir)
{
    char path[1024], msg[1024];
    snprintf(path, sizeof path, "%s/model.safetensors", dir);
    st_file f;
    cr_assert_eq(st_open(&f, path, msg, sizeof msg), 0, "%s", msg);
    st_writer *w = st_writer_new();
    size_t fused = 0;
    for (size_t i = 0; i < f.n_tensors; i++) {
        const st_tensor *t = &f.tensors[i];
        int layer, used = 0;
        char part[32], suffix[64];
        if (sscanf(t->name, "model.layers.%d.mlp.experts.0.%31[a-z_].%63s%n", &layer, part, suffix,
                   &used) != 3 ||
            (strcmp(part, "gate_proj") != 0 && strcmp(part, "down_proj") != 0)) {
            if (!strstr(t->name, ".mlp.experts."))
                cr_assert_eq(st_writer_add(w, t->name, t->dtype, t->ndim, t->shape, t->data,
                                           t->nbytes, false, msg, sizeof msg),
                             0, "%s", msg);
            continue;
        }
        char name[256];
        snprintf(name, sizeof name, "model.layers.%d.mlp.experts.%s.%s", layer,
                 part[0] == 'g' ? "gate_up_proj" : "down_proj", suffix);
        int64_t shape[3] = {8, t->shape[0], t->ndim > 1 ? t->shape[1] : 1};
        uint8_t *all = malloc(8 * t->nbytes);
        for (int e = 0; e < 8; e++)
            memcpy(all + (size_t)e * t->nbytes, t->data, t->nbytes);
        cr_assert_eq(
            st_writer_add(w, name, t->dtype, 3, shape, all, 8 * t->nbytes, true, msg, sizeof msg),
            0, "%s", msg);
        free(all);
        fused++;
    }
    cr_assert_geq(fused, 12);
    cr_assert_eq(st_writer_write(w, path, msg, sizeof msg), 0, "%s", msg);
    st_writer_free(w);
    st_close(&f);
}

Test(quant_moe, fused_experts_in_these_formats_are_refused_by_name)
{
    for (int k = 0; k < 3; k++) {
        const qmoe_case *c = &cases[k];
        char dir[512], msg[1024], want[160];
        test_tmpdir(dir, sizeof dir);
        tiny_fixture_folder(c->folder, dir);
        fuse_experts(dir);
        eng_model m;
        cr_assert_neq(eng_model_load(&m, &(eng_load_opts){.path = dir}, msg, sizeof msg), 0,
                      "%s: fused experts loaded", c->folder);
        snprintf(want, sizeof want, "fused 3-D experts in a %s checkpoint are not supported",
                 c->format);
        cr_assert(strstr(msg, want), "%s: %s", c->folder, msg);
        test_rmtree(dir);
    }
}

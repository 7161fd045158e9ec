/*
 * weights.c - what the engine knows of adapters: LoRA modules as plain
 * data (A, B, scale per layer and projection), the signed difference
 * between two adapter configurations, and weight versions.
 *
 * A weight version names, for every projection of every layer, the tensor
 * it serves with: the model's pristine one, or a merged copy it owns. The
 * model itself is never written; a merge builds a new version beside the
 * serving one, and the engine switches between two steps. Versions and
 * adapters are shared by reference count (atomic, so the last reference
 * may drop on any thread), never by locks: once published nothing in them
 * changes.
 *
 * The digest hashes every weight byte a version serves, so anyone can
 * check that an unmerge gave back the pristine bits.
 *
 * It offers the eng_proj names, eng_lora_* and eng_weights_* (model.h).
 * A version owns its proj table, its merged tensors and a reference on
 * each merged adapter, released by the last eng_weights_unref; it borrows
 * the model, which must outlive it. It touches the model's tensors only to
 * read them.
 */
#include "model.h"

#ifdef __GLIBC__
#include <malloc.h>
#endif
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

static const struct {
    const char *name, *parent;
    size_t field; /* offsetof(eng_layer, ...) */
} proj_table[ENG_PROJ_FIRST_EXPERT] = {
    [ENG_PROJ_Q] = {"q_proj", "self_attn", offsetof(eng_layer, wq)},
    [ENG_PROJ_K] = {"k_proj", "self_attn", offsetof(eng_layer, wk)},
    [ENG_PROJ_V] = {"v_proj", "self_attn", offsetof(eng_layer, wv)},
    [ENG_PROJ_O] = {"o_proj", "self_attn", offsetof(eng_layer, wo)},
    [ENG_PROJ_GATE] = {"gate_proj", "mlp", offsetof(eng_layer, w_gate)},
    [ENG_PROJ_UP] = {"up_proj", "mlp", offsetof(eng_layer, w_up)},
    [ENG_PROJ_DOWN] = {"down_proj", "mlp", offsetof(eng_layer, w_down)},
    [ENG_PROJ_PLE_GATE] = {"per_layer_input_gate", "", offsetof(eng_layer, g4.ple_gate)},
    [ENG_PROJ_PLE_PROJ] = {"per_layer_projection", "", offsetof(eng_layer, g4.ple_proj)},
};

const char *eng_proj_name(eng_proj p)
{
    if ((int)p < 0)
        return "unknown";
    eng_proj part;
    eng_proj_expert(p, &part);
    return proj_table[part].name;
}

const char *eng_proj_parent(eng_proj p)
{
    if ((int)p < 0)
        return "unknown";
    return eng_proj_expert(p, NULL) >= 0 ? "mlp.experts" : proj_table[p].parent;
}

const char *eng_proj_path(eng_proj p, char *buf, size_t len)
{
    int32_t e = (int)p < 0 ? -1 : eng_proj_expert(p, NULL);
    const char *parent = eng_proj_parent(p);
    if (e >= 0)
        snprintf(buf, len, "mlp.experts.%d.%s", e, eng_proj_name(p));
    else
        snprintf(buf, len, "%s%s%s", parent, *parent ? "." : "", eng_proj_name(p));
    return buf;
}

const qtensor *eng_model_proj(const eng_model *m, int32_t layer, eng_proj p)
{
    static const qtensor none;
    int32_t e = eng_proj_expert(p, NULL);
    if (e < 0)
        return (const qtensor *)((const char *)&m->layers[layer] + proj_table[p].field);
    const eng_layer *ly = &m->layers[layer];
    return ly->experts && e < m->cfg.n_experts ? &ly->experts[(int)p - ENG_PROJ_FIRST_EXPERT]
                                               : &none;
}

/* --- adapters ------------------------------------------------------------------ */

void eng_lora_ref(eng_lora *l)
{
    __atomic_add_fetch(&l->refs, 1, __ATOMIC_RELAXED);
}

void eng_lora_unref(eng_lora *l)
{
    if (l && __atomic_sub_fetch(&l->refs, 1, __ATOMIC_ACQ_REL) == 0)
        l->destroy(l);
}

uint64_t eng_lora_uid(eng_lora *l)
{
    static uint64_t last;
    uint64_t id = __atomic_load_n(&l->uid, __ATOMIC_ACQUIRE);
    if (id)
        return id;
    uint64_t mine = __atomic_add_fetch(&last, 1, __ATOMIC_RELAXED);
    /* two threads naming it at once: the first name stands */
    if (__atomic_compare_exchange_n(&l->uid, &id, mine, false, __ATOMIC_ACQ_REL, __ATOMIC_ACQUIRE))
        return mine;
    return id;
}

const eng_lora_module *eng_lora_module_at(const eng_lora *lora, int32_t layer, eng_proj p)
{
    if (layer < 0 || layer >= lora->n_layers)
        return NULL;
    if ((int)p < 0 || (int)p >= lora->n_proj)
        return NULL;
    const eng_lora_module *mod = &lora->modules[(size_t)layer * (size_t)lora->n_proj + p];
    return mod->a.rows ? mod : NULL;
}

int eng_lora_difference(const eng_lora_term *want, size_t n_want, const eng_lora_term *merged,
                        size_t n_merged, eng_lora_term **out, size_t *n_out)
{
    *out = NULL;
    *n_out = 0;
    if (n_want + n_merged == 0)
        return QL_OK;
    eng_lora_term *d = malloc((n_want + n_merged) * sizeof *d);
    if (!d)
        return QL_ENOMEM;
    size_t n = 0;
    for (size_t i = 0; i < n_want; i++) {
        float s = want[i].scale;
        for (size_t j = 0; j < n_merged; j++)
            if (merged[j].lora == want[i].lora)
                s -= merged[j].scale;
        if (s != 0.0f)
            d[n++] = (eng_lora_term){want[i].lora, s};
    }
    for (size_t j = 0; j < n_merged; j++) {
        bool wanted = false;
        for (size_t i = 0; i < n_want; i++)
            wanted |= want[i].lora == merged[j].lora;
        if (!wanted)
            d[n++] = (eng_lora_term){merged[j].lora, -merged[j].scale};
    }
    if (n == 0) {
        free(d);
        d = NULL;
    }
    *out = d;
    *n_out = n;
    return QL_OK;
}

/* --- weight versions ------------------------------------------------------------ */

int eng_weights_new(eng_weights **out, const eng_model *m, uint64_t version, char *msg,
                    size_t msg_len)
{
    *out = NULL;
    int32_t np = eng_n_proj(&m->cfg);
    size_t n = (size_t)m->cfg.n_layers * (size_t)np;
    eng_weights *w = calloc(1, sizeof *w);
    if (w) {
        w->proj = calloc(n, sizeof *w->proj);
        w->owned = calloc(n, sizeof *w->owned);
    }
    if (!w || !w->proj || !w->owned) {
        if (w) {
            free(w->proj);
            free(w->owned);
        }
        free(w);
        return ql_fail(msg, msg_len, QL_ENOMEM, "out of memory for a weight version");
    }
    w->version = version;
    w->m = m;
    w->n_proj = np;
    for (int32_t l = 0; l < m->cfg.n_layers; l++)
        for (int p = 0; p < np; p++)
            w->proj[(size_t)l * (size_t)np + (size_t)p] = eng_model_proj(m, l, (eng_proj)p);
    w->refs = 1;
    *out = w;
    return QL_OK;
}

void eng_weights_set(eng_weights *w, int32_t layer, eng_proj p, qtensor *t)
{
    size_t i = (size_t)layer * (size_t)w->n_proj + p;
    qt_free(&w->owned[i]);
    w->owned[i] = *t;
    memset(t, 0, sizeof *t);
    w->proj[i] = &w->owned[i];
}

int eng_weights_set_merged(eng_weights *w, const eng_lora_term *terms, size_t n, char *msg,
                           size_t msg_len)
{
    eng_lora_term *copy = n ? malloc(n * sizeof *copy) : NULL;
    if (n && !copy)
        return ql_fail(msg, msg_len, QL_ENOMEM, "out of memory");
    for (size_t i = 0; i < n; i++) {
        copy[i] = terms[i];
        eng_lora_ref(copy[i].lora);
    }
    for (size_t i = 0; i < w->n_merged; i++)
        eng_lora_unref(w->merged[i].lora);
    free(w->merged);
    w->merged = copy;
    w->n_merged = n;
    return QL_OK;
}

const qtensor *eng_weights_proj(const eng_weights *w, int32_t layer, eng_proj p)
{
    return w->proj[(size_t)layer * (size_t)w->n_proj + p];
}

void eng_weights_ref(eng_weights *w)
{
    __atomic_add_fetch(&w->refs, 1, __ATOMIC_RELAXED);
}

void eng_weights_unref(eng_weights *w)
{
    if (!w || __atomic_sub_fetch(&w->refs, 1, __ATOMIC_ACQ_REL) != 0)
        return;
    size_t n = (size_t)w->m->cfg.n_layers * (size_t)w->n_proj;
    for (size_t i = 0; i < n; i++)
        qt_free(&w->owned[i]);
    for (size_t i = 0; i < w->n_merged; i++)
        eng_lora_unref(w->merged[i].lora);
    free(w->merged);
    free(w->owned);
    free(w->proj);
    free(w);
#ifdef __GLIBC__
    /* a merged version is the size of the modules it merged, in many
     * blocks under glibc's mmap threshold, spread over the arenas of the
     * threads that built it: without a trim glibc keeps the freed pages
     * (the soak's growth itself was the KV arena, see kv_cache.c); rare,
     * so the heap walk is cheap beside the free itself, though it runs on
     * whichever thread drops the last reference (the engine's, at the end
     * of the last sequence on an unmerged version) */
    malloc_trim(0);
#endif
}

/* --- the digest ------------------------------------------------------------------ */

/*
 * Four independent 64-bit lanes over 32-byte stripes, each a multiply-
 * rotate round with the constants of xxHash64 (Collet's published primes),
 * then folded with the length: several GB/s, so hashing a model's weights
 * costs milliseconds. Not cryptographic; it tells an accidental change.
 */
#define DG_P1 0x9E3779B185EBCA87ull
#define DG_P2 0xC2B2AE3D27D4EB4Full
#define DG_P3 0x165667B19E3779F9ull

typedef struct digest {
    uint64_t lane[4];
    uint64_t total;
} digest;

static uint64_t rotl64(uint64_t x, int r)
{
    return (x << r) | (x >> (64 - r));
}

static uint64_t dg_round(uint64_t acc, uint64_t v)
{
    return rotl64(acc + v * DG_P2, 31) * DG_P1;
}

static void dg_bytes(digest *d, const void *p, size_t n)
{
    const uint8_t *b = p;
    size_t i = 0;
    for (; i + 32 <= n; i += 32) {
        for (int k = 0; k < 4; k++) {
            uint64_t v;
            memcpy(&v, b + i + 8 * k, 8);
            d->lane[k] = dg_round(d->lane[k], v);
        }
    }
    /* the tail, zero-padded into one more stripe, and its length */
    if (i < n) {
        uint8_t tail[32] = {0};
        memcpy(tail, b + i, n - i);
        for (int k = 0; k < 4; k++) {
            uint64_t v;
            memcpy(&v, tail + 8 * k, 8);
            d->lane[k] = dg_round(d->lane[k], v);
        }
    }
    d->lane[0] = dg_round(d->lane[0], (uint64_t)n);
    d->total += n;
}

static void dg_u64(digest *d, uint64_t v)
{
    dg_bytes(d, &v, sizeof v);
}

/* Everything that decides t's values: kind, shape, codes, quant state. */
static void dg_tensor(digest *d, const qtensor *t)
{
    dg_u64(d, (uint64_t)t->kind);
    dg_u64(d, (uint64_t)t->rows);
    dg_u64(d, (uint64_t)t->cols);
    if (t->data)
        dg_bytes(d, t->data, t->data_bytes);
    if (t->kind == QT_NF4 || t->kind == QT_FP4) {
        dg_u64(d, (uint64_t)t->blocksize);
        dg_bytes(d, t->codebook, sizeof t->codebook);
        if (t->nested) {
            dg_bytes(d, t->absmax_codes, (size_t)t->n_blocks);
            dg_bytes(d, t->nested_absmax, (size_t)t->n_nested_blocks * sizeof(float));
            dg_bytes(d, &t->nested_offset, sizeof t->nested_offset);
            dg_bytes(d, t->nested_code, sizeof t->nested_code);
        } else if (t->absmax) {
            dg_bytes(d, t->absmax, (size_t)t->n_blocks * sizeof(float));
        }
    } else if (t->kind == QT_AFFINE) {
        size_t groups = (size_t)t->rows * (size_t)t->groups_per_row;
        dg_u64(d, (uint64_t)t->bits << 32 | (uint64_t)(uint32_t)t->group_size);
        dg_u64(d, (uint64_t)(uint32_t)t->qmin << 32 | (uint64_t)(uint32_t)t->qmax);
        dg_u64(d, (uint64_t)t->zero_domain);
        if (t->scales)
            dg_bytes(d, t->scales, groups * sizeof(float));
        if (t->zeros)
            dg_bytes(d, t->zeros, groups * sizeof(float));
    }
}

typedef struct digest_walk {
    digest d;
    const eng_model *m;
    const eng_weights *w;
} digest_walk;

/* The tensor that serves in t's place: a version's projection replaces
 * the model's own (found by where t lies: a layer's fields, or its
 * experts' array). */
static void digest_one(const qtensor *t, void *ctx)
{
    digest_walk *dw = ctx;
    const eng_model *m = dw->m;
    for (int32_t l = 0; dw->w && l < m->cfg.n_layers; l++) {
        const eng_layer *ly = &m->layers[l];
        const qtensor *ex = ly->experts;
        if (ex && t >= ex && t < ex + 3 * (size_t)m->cfg.n_experts) {
            dg_tensor(&dw->d,
                      eng_weights_proj(dw->w, l, (eng_proj)(ENG_PROJ_FIRST_EXPERT + (t - ex))));
            return;
        }
        for (int p = 0; p < eng_n_layer_proj(&m->cfg); p++)
            if (eng_model_proj(m, l, (eng_proj)p) == t) {
                dg_tensor(&dw->d, eng_weights_proj(dw->w, l, (eng_proj)p));
                return;
            }
    }
    dg_tensor(&dw->d, t);
}

uint64_t eng_weights_digest(const eng_model *m, const eng_weights *w)
{
    digest_walk dw = {.m = m, .w = w};
    dw.d.lane[0] = DG_P1 + DG_P2;
    dw.d.lane[1] = DG_P2;
    dw.d.lane[2] = 0;
    dw.d.lane[3] = (uint64_t)0 - DG_P1;
    eng_model_each_tensor(m, digest_one, &dw);
    uint64_t h = rotl64(dw.d.lane[0], 1) + rotl64(dw.d.lane[1], 7) + rotl64(dw.d.lane[2], 12) +
                 rotl64(dw.d.lane[3], 18);
    h ^= dw.d.total;
    /* final avalanche, so nearby inputs land far apart */
    h ^= h >> 33;
    h *= DG_P2;
    h ^= h >> 29;
    h *= DG_P3;
    h ^= h >> 32;
    return h;
}

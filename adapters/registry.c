/*
 * registry.c - the adapters loaded on an engine, by name, and the merged
 * configuration of its weights.
 *
 * Loading reads and checks the files on the caller's thread (never the
 * engine's). A merge or unmerge computes a whole new weight version from
 * the pristine weights on the caller's thread too, over the registry's own
 * merge threads, while the engine keeps decoding on the serving version;
 * only then is the version published, and the engine takes it between two
 * steps. Nothing is ever subtracted from a requantized weight, so rounding
 * never accumulates, and an unmerge serves the pristine tensors themselves.
 *
 * Every change (load, the evictions a load makes under the budget, unload,
 * merge, unmerge) ends by rewriting the journal (state.c) from the table
 * and the serving version, when the registry has one; a journal that
 * cannot be written leaves the change standing, is logged and reported
 * (lora_state.state_file_error), and is written again at the next change.
 * lora_registry_restore replays it at start.
 *
 * It offers lora.h's registry half; it owns the entries (each holding one
 * reference to its eng_lora), the merge threads, the digest of each
 * version it publishes, the journal's path and the replay's errors; it
 * touches the engine only by publishing versions (eng_engine_publish) and,
 * on a backend that merges on the device, eng_engine_prepare.
 *
 * Three locks: `mu` guards the table of entries, the digest and the
 * configuration's `into`, and is held only for quick look-ups (a version
 * is published under it, so that the serving version and its digest are
 * read together); `merge_mu` serializes merges and unmerges (and unloads,
 * which must see a settled merged configuration), which are slow;
 * `journal_mu` serializes journal writes, each of which snapshots the
 * state under `mu` after taking it, so the last write holds the latest
 * state. Order: merge_mu, then journal_mu, then mu.
 */
#include "lora.h"

#include <errno.h>
#include <limits.h>
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

typedef struct entry {
    char name[128];
    char path[512];
    eng_lora *lora; /* the registry's reference */
    lora_meta meta;
    float scale;        /* the default for requests that name it */
    bool safe_merge;    /* what its last merge asked, for the journal */
    uint64_t last_used; /* registry tick, for least-recently-used eviction */
    lora_cost last_merge;
    double last_merge_seconds;
} entry;

struct lora_registry {
    eng_engine *e;
    const eng_model *m;
    lora_registry_opts o;
    eng_pool *pool; /* merge threads */
    pthread_mutex_t mu;
    pthread_mutex_t merge_mu;
    /* names lora_registry_acquire is loading (under mu), and the signal
     * that one has finished */
    char loading[16][128];
    size_t n_loading;
    pthread_cond_t loaded_cv;
    entry *entries;
    size_t n, cap;
    uint64_t tick;
    qt_kind into; /* what merged modules are stored in, for the current configuration */
    uint64_t merges, unmerges;
    /* the digest of the serving version, computed where the version was
     * made (lora_registry_new on the initial one, publish_configuration on
     * each merge and unmerge) and only read after: hashing every weight
     * byte costs tens of milliseconds on the default model, too long for
     * the event loop that answers /admin/state and /metrics. Versions are
     * numbered once each and published under mu with their digest. */
    uint64_t digested_version;
    uint64_t digest;
    /* the journal: its path (owned; NULL: none), why its last write
     * failed (under mu; empty: current), and whether a replay is running
     * (under journal_mu: nothing is written until it ends) */
    char *state_file;
    pthread_mutex_t journal_mu;
    bool restoring;
    char journal_error[512];
    /* what lora_registry_restore could not bring back (under mu) */
    lora_restore_error *restore_errors;
    size_t n_restore_errors;
};

void lora_report_free(lora_report *rep)
{
    if (rep) {
        free(rep->modules);
        rep->modules = NULL;
        rep->n_modules = 0;
    }
}

int lora_registry_new(lora_registry **out, eng_engine *e, const eng_model *m,
                      const lora_registry_opts *o, char *msg, size_t msg_len)
{
    *out = NULL;
    lora_registry *r = calloc(1, sizeof *r);
    if (!r)
        return ql_fail(msg, msg_len, QL_ENOMEM, "out of memory");
    r->e = e;
    r->m = m;
    r->o = *o;
    r->into = QT_KIND_COUNT;
    /* one merge thread by default: a merge should not take the cores the
     * engine is decoding on */
    int rc = eng_pool_new(&r->pool, o->threads > 0 ? o->threads : 1, msg, msg_len);
    if (rc != QL_OK) {
        free(r);
        return rc;
    }
    if (o->state_file && !(r->state_file = strdup(o->state_file))) {
        eng_pool_free(r->pool);
        free(r);
        return ql_fail(msg, msg_len, QL_ENOMEM, "out of memory");
    }
    r->o.state_file = r->state_file;
    pthread_mutex_init(&r->mu, NULL);
    pthread_mutex_init(&r->merge_mu, NULL);
    pthread_cond_init(&r->loaded_cv, NULL);
    pthread_mutex_init(&r->journal_mu, NULL);
    /* the initial version's digest, here (the caller's thread: the
     * server's load thread) rather than at the first state query */
    eng_weights *serving = eng_engine_weights(e);
    r->digested_version = serving->version;
    r->digest = eng_weights_digest(m, serving);
    eng_weights_unref(serving);
    *out = r;
    return QL_OK;
}

void lora_registry_free(lora_registry *r)
{
    if (!r)
        return;
    for (size_t i = 0; i < r->n; i++)
        eng_lora_unref(r->entries[i].lora);
    free(r->entries);
    eng_pool_free(r->pool);
    pthread_mutex_destroy(&r->mu);
    pthread_mutex_destroy(&r->merge_mu);
    pthread_cond_destroy(&r->loaded_cv);
    pthread_mutex_destroy(&r->journal_mu);
    free(r->state_file);
    free(r->restore_errors);
    free(r);
}

/* The entry named `name`, under mu. */
static entry *find(lora_registry *r, const char *name)
{
    for (size_t i = 0; i < r->n; i++)
        if (strcmp(r->entries[i].name, name) == 0)
            return &r->entries[i];
    return NULL;
}

/* Whether the serving version has lora merged (and at which scale). */
static bool merged_in(const eng_weights *w, const eng_lora *lora, float *scale)
{
    for (size_t i = 0; i < w->n_merged; i++)
        if (w->merged[i].lora == lora) {
            if (scale)
                *scale = w->merged[i].scale;
            return true;
        }
    return false;
}

static size_t loaded_bytes(const lora_registry *r)
{
    size_t total = 0;
    for (size_t i = 0; i < r->n; i++)
        total += r->entries[i].lora->bytes;
    return total;
}

/* --- the journal ----------------------------------------------------------------- */

/* The state to journal, under mu: the table in load order and the serving
 * version's merged configuration. The version is read under mu, where it
 * is published together with `into`. */
static int journal_snapshot(lora_registry *r, lora_journal *j, char *msg, size_t msg_len)
{
    memset(j, 0, sizeof *j);
    pthread_mutex_lock(&r->mu);
    eng_weights *serving = eng_engine_weights(r->e);
    j->adapters = calloc(r->n ? r->n : 1, sizeof *j->adapters);
    if (j->adapters) {
        for (size_t i = 0; i < r->n; i++) {
            const entry *en = &r->entries[i];
            lora_journal_adapter *a = &j->adapters[j->n_adapters++];
            snprintf(a->name, sizeof a->name, "%s", en->name);
            snprintf(a->path, sizeof a->path, "%s", en->path);
            a->scale = en->scale;
        }
        for (size_t i = 0; i < serving->n_merged && i < ENG_MAX_MERGED; i++) {
            lora_journal_merge *m = &j->merged[j->n_merged++];
            const entry *en = find(r, serving->merged[i].lora->name);
            snprintf(m->name, sizeof m->name, "%s", serving->merged[i].lora->name);
            m->scale = serving->merged[i].scale;
            m->into = r->into;
            m->safe_merge = en ? en->safe_merge : true;
        }
    }
    pthread_mutex_unlock(&r->mu);
    eng_weights_unref(serving);
    return j->adapters ? QL_OK : ql_fail(msg, msg_len, QL_ENOMEM, "out of memory");
}

/*
 * After a change: rewrite the journal from the state now. Its failure is
 * not the change's (which has happened): it is logged, kept for
 * lora_registry_state, and the next change tries again.
 */
static void journal_save(lora_registry *r)
{
    if (!r->state_file)
        return;
    pthread_mutex_lock(&r->journal_mu);
    if (r->restoring) {
        pthread_mutex_unlock(&r->journal_mu);
        return;
    }
    lora_journal j;
    char msg[512];
    int rc = journal_snapshot(r, &j, msg, sizeof msg);
    if (rc == QL_OK)
        rc = lora_journal_write(r->state_file, &j, msg, sizeof msg);
    lora_journal_free(&j);
    pthread_mutex_lock(&r->mu);
    bool was_failing = r->journal_error[0] != 0;
    snprintf(r->journal_error, sizeof r->journal_error, "%s", rc == QL_OK ? "" : msg);
    pthread_mutex_unlock(&r->mu);
    pthread_mutex_unlock(&r->journal_mu);
    if (rc != QL_OK)
        fprintf(stderr,
                "qlserve: %s (the change was made; the state file is written again at the next "
                "change)\n",
                msg);
    else if (was_failing)
        fprintf(stderr, "qlserve: state file %s is written again\n", r->state_file);
}

/*
 * Make room for `bytes` more under the budget, under mu: drop unmerged
 * adapters that nothing else holds (no sequence, no version: the
 * registry's is the only reference), least recently used first.
 */
static int make_room(lora_registry *r, size_t bytes, const eng_weights *serving, char *msg,
                     size_t msg_len)
{
    if (r->o.budget_bytes == 0)
        return QL_OK;
    while (loaded_bytes(r) + bytes > r->o.budget_bytes) {
        entry *victim = NULL;
        for (size_t i = 0; i < r->n; i++) {
            entry *en = &r->entries[i];
            if (merged_in(serving, en->lora, NULL) ||
                __atomic_load_n(&en->lora->refs, __ATOMIC_ACQUIRE) > 1)
                continue;
            if (!victim || en->last_used < victim->last_used)
                victim = en;
        }
        if (!victim)
            return ql_fail(msg, msg_len, QL_ENOMEM,
                           "the adapter needs %zu bytes; the budget of %zu holds %zu in adapters "
                           "that are merged or in use",
                           bytes, r->o.budget_bytes, loaded_bytes(r));
        eng_lora_unref(victim->lora);
        *victim = r->entries[--r->n];
    }
    return QL_OK;
}

int lora_registry_load(lora_registry *r, const char *name, const char *dir, float scale,
                       lora_meta *meta, char *msg, size_t msg_len)
{
    if (!name || !*name || strlen(name) >= sizeof r->entries->name)
        return ql_fail(msg, msg_len, QL_EINVAL, "an adapter name must have 1 to %zu bytes",
                       sizeof r->entries->name - 1);
    pthread_mutex_lock(&r->mu);
    bool taken = find(r, name) != NULL;
    pthread_mutex_unlock(&r->mu);
    if (taken)
        return ql_fail(msg, msg_len, QL_ECONFLICT, "an adapter named %s is already loaded", name);

    /* the slow part, with no lock held */
    eng_lora *lora = NULL;
    lora_meta mt;
    int rc = lora_load_in(&lora, &mt, r->o.adapter_root, dir, name, r->m, r->o.dtype, msg, msg_len);
    if (rc != QL_OK)
        return rc;

    eng_weights *serving = eng_engine_weights(r->e);
    pthread_mutex_lock(&r->mu);
    if (find(r, name))
        rc = ql_fail(msg, msg_len, QL_ECONFLICT, "an adapter named %s is already loaded", name);
    if (rc == QL_OK)
        rc = make_room(r, lora->bytes, serving, msg, msg_len);
    if (rc == QL_OK && r->n == r->cap) {
        size_t cap = r->cap ? 2 * r->cap : 8;
        entry *grown = realloc(r->entries, cap * sizeof *grown);
        if (grown) {
            r->entries = grown;
            r->cap = cap;
        } else {
            rc = ql_fail(msg, msg_len, QL_ENOMEM, "out of memory");
        }
    }
    if (rc == QL_OK) {
        entry *en = &r->entries[r->n++];
        memset(en, 0, sizeof *en);
        snprintf(en->name, sizeof en->name, "%s", name);
        snprintf(en->path, sizeof en->path, "%s", dir);
        en->lora = lora;
        en->meta = mt;
        en->scale = scale;
        en->last_used = ++r->tick;
        lora = NULL;
    }
    pthread_mutex_unlock(&r->mu);
    eng_weights_unref(serving);
    eng_lora_unref(lora);
    if (rc != QL_OK)
        return rc;
    if (meta)
        *meta = mt;
    journal_save(r); /* the evictions that made room, too */
    return QL_OK;
}

int lora_registry_want(lora_registry *r, const char *name, eng_lora_term *out, char *msg,
                       size_t msg_len)
{
    *out = (eng_lora_term){NULL, 1.0f};
    pthread_mutex_lock(&r->mu);
    entry *en = find(r, name);
    if (en) {
        en->last_used = ++r->tick;
        eng_lora_ref(en->lora);
        *out = (eng_lora_term){en->lora, en->scale};
    }
    pthread_mutex_unlock(&r->mu);
    return en ? QL_OK : ql_fail(msg, msg_len, QL_ENOTFOUND, "no adapter named %s is loaded", name);
}

/* Whether name is being loaded by lora_registry_acquire, under mu. */
static bool loading(const lora_registry *r, const char *name)
{
    for (size_t i = 0; i < r->n_loading; i++)
        if (strcmp(r->loading[i], name) == 0)
            return true;
    return false;
}

int lora_registry_acquire(lora_registry *r, const char *name, const char *root, eng_lora_term *out,
                          char *msg, size_t msg_len)
{
    if (lora_registry_want(r, name, out, NULL, 0) == QL_OK)
        return QL_OK;
    char dir[4096];
    int rc = lora_resolve_dir(root, name, dir, sizeof dir, msg, msg_len);
    if (rc != QL_OK)
        return rc == QL_EIO ? rc : QL_ENOTFOUND; /* not a folder of the adapter folder */
    /* one load per name: later callers wait for the first one's */
    pthread_mutex_lock(&r->mu);
    while (loading(r, name))
        pthread_cond_wait(&r->loaded_cv, &r->mu);
    bool mine = find(r, name) == NULL;
    if (mine && r->n_loading == sizeof r->loading / sizeof r->loading[0]) {
        pthread_mutex_unlock(&r->mu);
        return ql_fail(msg, msg_len, QL_EBUSY,
                       "adapter %s: %zu adapters are being loaded already; try again later", name,
                       r->n_loading);
    }
    if (mine)
        snprintf(r->loading[r->n_loading++], sizeof r->loading[0], "%s", name);
    pthread_mutex_unlock(&r->mu);
    if (mine) {
        rc = lora_registry_load(r, name, dir, 1.0f, NULL, msg, msg_len);
        pthread_mutex_lock(&r->mu);
        for (size_t i = 0; i < r->n_loading; i++)
            if (strcmp(r->loading[i], name) == 0) {
                memcpy(r->loading[i], r->loading[--r->n_loading], sizeof r->loading[0]);
                break;
            }
        pthread_cond_broadcast(&r->loaded_cv);
        pthread_mutex_unlock(&r->mu);
        if (rc != QL_OK && rc != QL_ECONFLICT) /* loaded meanwhile by an admin: served */
            return rc;
    }
    return lora_registry_want(r, name, out, msg, msg_len);
}

int lora_registry_get(lora_registry *r, const char *name, eng_lora **out, char *msg, size_t msg_len)
{
    eng_lora_term t;
    int rc = lora_registry_want(r, name, &t, msg, msg_len);
    *out = t.lora;
    return rc;
}

int lora_registry_unload(lora_registry *r, const char *name, char *msg, size_t msg_len)
{
    pthread_mutex_lock(&r->merge_mu); /* the merged configuration holds still */
    eng_weights *serving = eng_engine_weights(r->e);
    pthread_mutex_lock(&r->mu);
    entry *en = find(r, name);
    int rc = QL_OK;
    eng_lora *dropped = NULL;
    if (!en) {
        rc = ql_fail(msg, msg_len, QL_ENOTFOUND, "no adapter named %s is loaded", name);
    } else if (merged_in(serving, en->lora, NULL)) {
        rc = ql_fail(msg, msg_len, QL_ECONFLICT,
                     "adapter %s is merged into the serving weights; unmerge it first", name);
    } else {
        dropped = en->lora;
        *en = r->entries[--r->n];
    }
    pthread_mutex_unlock(&r->mu);
    eng_weights_unref(serving);
    pthread_mutex_unlock(&r->merge_mu);
    eng_lora_unref(dropped); /* sequences still using it keep it until they end */
    if (rc == QL_OK)
        journal_save(r);
    return rc;
}

int lora_registry_list(lora_registry *r, lora_info **out, size_t *n)
{
    eng_weights *serving = eng_engine_weights(r->e);
    pthread_mutex_lock(&r->mu);
    lora_info *list = calloc(r->n ? r->n : 1, sizeof *list);
    if (list) {
        for (size_t i = 0; i < r->n; i++) {
            const entry *en = &r->entries[i];
            lora_info *info = &list[i];
            snprintf(info->name, sizeof info->name, "%s", en->name);
            snprintf(info->path, sizeof info->path, "%s", en->path);
            info->meta = en->meta;
            info->scale = en->scale;
            info->bytes = en->lora->bytes;
            info->merged = merged_in(serving, en->lora, &info->merged_scale);
            info->requests = __atomic_load_n(&en->lora->requests, __ATOMIC_RELAXED);
            info->last_used = __atomic_load_n(&en->lora->last_used, __ATOMIC_RELAXED);
            info->last_merge = en->last_merge;
            info->last_merge_seconds = en->last_merge_seconds;
        }
        *n = r->n;
    }
    pthread_mutex_unlock(&r->mu);
    eng_weights_unref(serving);
    *out = list;
    return list ? QL_OK : QL_ENOMEM;
}

/* --- merging ------------------------------------------------------------------ */

/* One module of the new version: its pristine weight and what merges into it. */
typedef struct module_job {
    int32_t layer;
    eng_proj proj;
    lora_part parts[ENG_MAX_MERGED]; /* one per merged adapter that targets it */
    size_t n_parts;
    qtensor merged;
    lora_cost cost;
    int rc;
    char msg[256];
} module_job;

typedef struct rebuild {
    const eng_model *m;
    const lora_merge_opts *o;
    module_job *jobs;
} rebuild;

static void merge_modules(void *ctx, int64_t begin, int64_t end)
{
    rebuild *b = ctx;
    for (int64_t i = begin; i < end; i++) {
        module_job *j = &b->jobs[i];
        const qtensor *pristine = eng_model_proj(b->m, j->layer, j->proj);
        const lora_ops *ops = NULL;
        char module[96], path[64];
        snprintf(module, sizeof module, "model.layers.%d.%s", j->layer,
                 eng_proj_path(j->proj, path, sizeof path));
        j->rc = lora_dispatch(pristine, &ops, j->msg, sizeof j->msg);
        if (j->rc == QL_OK)
            j->rc = ops->merge(pristine, j->parts, j->n_parts, b->o, module, &j->merged, &j->cost,
                               j->msg, sizeof j->msg);
    }
}

/*
 * Build the version that serves `terms` merged (recomputed from the
 * pristine weights), hash it, publish it with into_after as the
 * configuration's `into`, and report. Under merge_mu. On failure nothing
 * is published and msg names the adapter and module.
 */
static int publish_configuration(lora_registry *r, const eng_lora_term *terms, size_t n_terms,
                                 const lora_merge_opts *o, qt_kind into_after, lora_report *rep,
                                 char *msg, size_t msg_len)
{
    double t0 = ql_now_s();
    const eng_model *m = r->m;
    eng_weights *serving = eng_engine_weights(r->e);
    eng_weights *v = NULL;
    int rc = eng_weights_new(&v, m, serving->version + 1, msg, msg_len);
    int32_t np = eng_n_proj(&m->cfg);
    size_t n_modules = (size_t)m->cfg.n_layers * (size_t)np;
    module_job *jobs = NULL;
    size_t n_jobs = 0;
    if (rc == QL_OK) {
        jobs = calloc(n_modules, sizeof *jobs);
        if (!jobs)
            rc = ql_fail(msg, msg_len, QL_ENOMEM, "out of memory");
    }
    for (int32_t l = 0; rc == QL_OK && l < m->cfg.n_layers; l++) {
        for (int p = 0; p < np; p++) {
            module_job *j = &jobs[n_jobs];
            j->layer = l;
            j->proj = (eng_proj)p;
            for (size_t t = 0; t < n_terms; t++) {
                const eng_lora_module *mod = eng_lora_module_at(terms[t].lora, l, (eng_proj)p);
                if (mod && j->n_parts < sizeof j->parts / sizeof *j->parts)
                    j->parts[j->n_parts++] = (lora_part){terms[t].lora->name, mod, terms[t].scale};
            }
            if (j->n_parts) {
                n_jobs++;
            } else if (eng_weights_proj(serving, l, (eng_proj)p) !=
                       eng_model_proj(m, l, (eng_proj)p)) {
                /* merged before, merged no more: the pristine tensor serves,
                 * bit for bit by construction, whatever its kind */
                v->proj[(size_t)l * (size_t)np + (size_t)p] = eng_model_proj(m, l, (eng_proj)p);
            }
        }
    }
    /* a backend that merges on the device (CUDA) needs only the
     * configuration: the merged tensors are made there, not here */
    bool on_device = eng_engine_merges_on_device(r->e) && o->into == QT_KIND_COUNT;
    eng_merge_cost *device_costs = NULL;
    uint64_t device_digest = 0;
    if (rc == QL_OK && on_device) {
        device_costs = calloc(n_modules, sizeof *device_costs);
        rc = device_costs ? eng_weights_set_merged(v, terms, n_terms, msg, msg_len)
                          : ql_fail(msg, msg_len, QL_ENOMEM, "out of memory");
        if (rc == QL_OK)
            rc = eng_engine_prepare(r->e, v, device_costs, &device_digest, msg, msg_len);
        for (size_t i = 0; rc == QL_OK && i < n_jobs; i++) {
            module_job *j = &jobs[i];
            lora_cost_add(&j->cost, &device_costs[(size_t)j->layer * (size_t)np + j->proj]);
        }
    } else if (rc == QL_OK) {
        rebuild b = {m, o, jobs};
        eng_pool_run(r->pool, merge_modules, &b, (int64_t)n_jobs, 1);
        for (size_t i = 0; i < n_jobs && rc == QL_OK; i++)
            if (jobs[i].rc != QL_OK)
                rc = ql_fail(msg, msg_len, jobs[i].rc, "%s", jobs[i].msg);
    }
    lora_report rp = {0};
    if (rc == QL_OK && n_jobs) {
        rp.modules = calloc(n_jobs, sizeof *rp.modules);
        if (!rp.modules)
            rc = ql_fail(msg, msg_len, QL_ENOMEM, "out of memory");
    }
    if (rc == QL_OK && !on_device)
        rc = eng_weights_set_merged(v, terms, n_terms, msg, msg_len);
    if (rc == QL_OK) {
        for (size_t i = 0; i < n_jobs; i++) {
            module_job *j = &jobs[i];
            qt_kind kind = on_device ? eng_model_proj(m, j->layer, j->proj)->kind : j->merged.kind;
            rp.modules[i] = (struct lora_module_cost){j->layer, j->proj, kind, j->cost};
            lora_cost_add(&rp.overall, &j->cost);
            if (!on_device)
                eng_weights_set(v, j->layer, j->proj, &j->merged);
        }
        rp.n_modules = n_jobs;
        rp.into = o->into;
        rp.version = v->version;
        rp.digest = on_device ? device_digest : eng_weights_digest(m, v);
        /* the version, its digest and its `into` together: a state query
         * or a journal snapshot (both under mu) sees all or none */
        pthread_mutex_lock(&r->mu);
        r->digested_version = v->version;
        r->digest = rp.digest;
        r->into = into_after;
        eng_engine_publish(r->e, v); /* the engine takes our reference */
        pthread_mutex_unlock(&r->mu);
        v = NULL;
        rp.seconds = ql_now_s() - t0;
    }
    for (size_t i = 0; jobs && i < n_jobs; i++)
        qt_free(&jobs[i].merged);
    free(jobs);
    free(device_costs);
    eng_weights_unref(v);
    eng_weights_unref(serving);
    if (rc != QL_OK) {
        free(rp.modules);
        return rc;
    }
    if (rep)
        *rep = rp;
    else
        free(rp.modules);
    return QL_OK;
}

/*
 * Change the merged configuration: the serving one with `lora` set to
 * `scale` (merge), or without it (unmerge); recompute from the pristine
 * weights and publish. Under merge_mu; on failure nothing changes.
 */
static int change_configuration(lora_registry *r, const char *name, bool merge, float scale,
                                const lora_merge_opts *o, lora_report *rep, char *msg,
                                size_t msg_len)
{
    eng_lora *lora = NULL;
    int rc = lora_registry_get(r, name, &lora, msg, msg_len);
    if (rc != QL_OK)
        return rc;
    pthread_mutex_lock(&r->merge_mu);
    eng_weights *serving = eng_engine_weights(r->e);
    eng_lora_term terms[ENG_MAX_MERGED];
    size_t n = 0;
    bool present = false;
    for (size_t i = 0; i < serving->n_merged && n < ENG_MAX_MERGED; i++) {
        bool it = serving->merged[i].lora == lora;
        present |= it;
        if (it && !merge)
            continue; /* unmerge: the rest stay merged */
        terms[n] = serving->merged[i];
        if (it)
            terms[n].scale = scale;
        n++;
    }
    if (merge && !present && n == ENG_MAX_MERGED)
        rc = ql_fail(msg, msg_len, QL_ECONFLICT, "%d adapters are merged already", ENG_MAX_MERGED);
    else if (merge && !present)
        terms[n++] = (eng_lora_term){lora, scale};
    else if (!merge && !present)
        rc = ql_fail(msg, msg_len, QL_ECONFLICT, "adapter %s is not merged", name);
    /* an unmerge stores what stays merged as it was stored */
    lora_merge_opts keep = {.safe_merge = true, .into = r->into};
    lora_report rp = {0};
    qt_kind into_after = merge ? o->into : n == 0 ? QT_KIND_COUNT : r->into;
    if (rc == QL_OK)
        rc = publish_configuration(r, terms, n, merge ? o : &keep, into_after, &rp, msg, msg_len);
    eng_weights_unref(serving);
    if (rc == QL_OK) {
        snprintf(rp.adapter, sizeof rp.adapter, "%s", name);
        rp.scale = merge ? scale : 0.0f;
        pthread_mutex_lock(&r->mu);
        if (merge) {
            r->merges++;
            entry *en = find(r, name);
            if (en) {
                en->last_merge = rp.overall;
                en->last_merge_seconds = rp.seconds;
                en->safe_merge = o->safe_merge;
            }
        } else {
            r->unmerges++;
        }
        pthread_mutex_unlock(&r->mu);
    }
    pthread_mutex_unlock(&r->merge_mu);
    eng_lora_unref(lora);
    if (rc == QL_OK)
        journal_save(r);
    if (rc == QL_OK && rep)
        *rep = rp;
    else
        lora_report_free(&rp);
    return rc;
}

int lora_registry_merge(lora_registry *r, const char *name, float scale, const lora_merge_opts *o,
                        lora_report *rep, char *msg, size_t msg_len)
{
    if (!(scale == scale) || scale > 1e6f || scale < -1e6f)
        return ql_fail(msg, msg_len, QL_EINVAL, "merge scale %g is not a usable number",
                       (double)scale);
    if (o->into != QT_KIND_COUNT && o->into != QT_AFFINE && o->into != QT_BF16)
        return ql_fail(msg, msg_len, QL_EINVAL,
                       "merge into %s: one of the weight's own kind, int8 or bf16",
                       qt_kind_name(o->into));
    return change_configuration(r, name, true, scale, o, rep, msg, msg_len);
}

int lora_registry_unmerge(lora_registry *r, const char *name, lora_report *rep, char *msg,
                          size_t msg_len)
{
    return change_configuration(r, name, false, 0.0f, NULL, rep, msg, msg_len);
}

void lora_registry_state(lora_registry *r, lora_state *out)
{
    memset(out, 0, sizeof *out);
    /* every version is published by this registry under mu with its
     * digest, so the serving version's is the one kept */
    pthread_mutex_lock(&r->mu);
    eng_weights *serving = eng_engine_weights(r->e);
    out->version = serving->version;
    out->digest = r->digest;
    pthread_mutex_unlock(&r->mu);
    out->n_merged = serving->n_merged;
    for (size_t i = 0; i < serving->n_merged && i < ENG_MAX_MERGED; i++) {
        snprintf(out->merged[i].name, sizeof out->merged[i].name, "%s",
                 serving->merged[i].lora->name);
        out->merged[i].scale = serving->merged[i].scale;
    }
    pthread_mutex_lock(&r->mu);
    out->merges = r->merges;
    out->unmerges = r->unmerges;
    out->bytes = loaded_bytes(r);
    out->n_loaded = r->n;
    snprintf(out->state_file, sizeof out->state_file, "%s", r->state_file ? r->state_file : "");
    snprintf(out->state_file_error, sizeof out->state_file_error, "%s", r->journal_error);
    pthread_mutex_unlock(&r->mu);
    eng_weights_unref(serving);
}

/* --- the replay at start ---------------------------------------------------------- */

/* A control byte in s becomes '?': a path or message from a journal (which need not be
 * ours) is printed one line per error in the log. */
static void blank_controls(char *s)
{
    for (; *s; s++)
        if ((unsigned char)*s < 0x20 || *s == 0x7f)
            *s = '?';
}

/* Record what did not come back (name NULL: the state file itself). */
static void restore_failed(lora_registry *r, const char *name, const char *path, const char *why)
{
    pthread_mutex_lock(&r->mu);
    lora_restore_error *grown =
        realloc(r->restore_errors, (r->n_restore_errors + 1) * sizeof *grown);
    if (grown) {
        r->restore_errors = grown;
        lora_restore_error *e = &grown[r->n_restore_errors++];
        snprintf(e->name, sizeof e->name, "%.127s", name ? name : "");
        snprintf(e->path, sizeof e->path, "%.511s", path);
        snprintf(e->error, sizeof e->error, "%.1023s", why);
        blank_controls(e->path);
        blank_controls(e->error);
    }
    pthread_mutex_unlock(&r->mu);
}

/* Whether the adapter named `name` is loaded now. */
static bool is_loaded(lora_registry *r, const char *name)
{
    pthread_mutex_lock(&r->mu);
    bool loaded = find(r, name) != NULL;
    pthread_mutex_unlock(&r->mu);
    return loaded;
}

bool lora_name_valid(const char *name)
{
    size_t n = strlen(name);
    if (n == 0 || n >= 128)
        return false;
    for (size_t i = 0; i < n; i++) {
        char ch = name[i];
        if (!((ch >= 'a' && ch <= 'z') || (ch >= 'A' && ch <= 'Z') || (ch >= '0' && ch <= '9') ||
              ch == '-' || ch == '_' || ch == '.'))
            return false;
    }
    return true;
}

/* A journal entry's name and scale as the admin API would take them, or
 * QL_EINVAL naming what is wrong (the name shown escaped: it may hold
 * anything). */
static int replayable(const char *name, float scale, char *msg, size_t msg_len)
{
    if (!lora_name_valid(name)) {
        char shown[160];
        size_t k = 0;
        for (const char *c = name; *c && k + 5 < sizeof shown; c++)
            k +=
                (size_t)(*c >= ' ' && *c < 0x7f && *c != '"' && *c != '\\'
                             ? snprintf(shown + k, sizeof shown - k, "%c", *c)
                             : snprintf(shown + k, sizeof shown - k, "\\x%02x", (unsigned char)*c));
        shown[k] = 0;
        return ql_fail(msg, msg_len, QL_EINVAL,
                       "the state file names an adapter \"%s\": not a name the admin API takes "
                       "(1 to 127 letters, digits, '-', '_' and '.'); skipped",
                       shown);
    }
    if (!(scale >= -LORA_SCALE_MAX && scale <= LORA_SCALE_MAX))
        return ql_fail(msg, msg_len, QL_EINVAL,
                       "the state file gives adapter %s scale %g, past the admin API's bound of "
                       "%g; skipped",
                       name, (double)scale, LORA_SCALE_MAX);
    return QL_OK;
}

/* Replay j: every adapter, then every merge in order. Nothing in it is
 * taken on trust: each name and scale passes the admin API's checks
 * (replayable), each path lora_resolve_dir's. */
static void replay(lora_registry *r, const lora_journal *j, const char *root)
{
    char msg[512], resolved[512];
    for (size_t i = 0; i < j->n_adapters; i++) {
        const lora_journal_adapter *a = &j->adapters[i];
        int rc = replayable(a->name, a->scale, msg, sizeof msg);
        if (rc == QL_OK)
            rc = root ? lora_resolve_dir(root, a->path, resolved, sizeof resolved, msg, sizeof msg)
                      : ql_fail(msg, sizeof msg, QL_EINVAL,
                                "adapter loading is off (no adapter directory)");
        if (rc == QL_OK)
            rc = lora_registry_load(r, a->name, resolved, a->scale, NULL, msg, sizeof msg);
        if (rc != QL_OK)
            restore_failed(r, lora_name_valid(a->name) ? a->name : NULL, a->path, msg);
    }
    for (size_t i = 0; i < j->n_merged; i++) {
        const lora_journal_merge *m = &j->merged[i];
        const char *path = "";
        for (size_t k = 0; k < j->n_adapters; k++)
            if (strcmp(j->adapters[k].name, m->name) == 0)
                path = j->adapters[k].path;
        if (replayable(m->name, m->scale, msg, sizeof msg) != QL_OK) {
            restore_failed(r, lora_name_valid(m->name) ? m->name : NULL, path, msg);
            continue;
        }
        if (!is_loaded(r, m->name)) {
            snprintf(msg, sizeof msg, "merge skipped: adapter %s did not come back", m->name);
            restore_failed(r, m->name, path, msg);
            continue;
        }
        lora_merge_opts o = {.safe_merge = m->safe_merge, .into = m->into};
        if (lora_registry_merge(r, m->name, m->scale, &o, NULL, msg, sizeof msg) != QL_OK) {
            char why[600];
            snprintf(why, sizeof why, "merge failed: %s", msg);
            restore_failed(r, m->name, path, why);
        }
    }
}

size_t lora_registry_restore(lora_registry *r, const char *root)
{
    if (!r->state_file)
        return 0;
    lora_journal j;
    char msg[600];
    int rc = lora_journal_read(r->state_file, &j, msg, sizeof msg);
    if (rc == QL_ENOTFOUND)
        return 0; /* the first start with this state file */
    if (rc == QL_EFORMAT) {
        /* kept aside, or the next change would write over what the
         * operator may want to read or repair */
        char aside[PATH_MAX + 8], why[1024];
        snprintf(aside, sizeof aside, "%s.bad", r->state_file);
        if (rename(r->state_file, aside) == 0)
            snprintf(why, sizeof why, "%.600s; kept as %.300s, starting with no adapters", msg,
                     aside);
        else
            snprintf(why, sizeof why, "%.600s; and it cannot be kept as %.300s (%s)", msg, aside,
                     strerror(errno));
        restore_failed(r, NULL, r->state_file, why);
        return r->n_restore_errors;
    }
    if (rc != QL_OK) {
        restore_failed(r, NULL, r->state_file, msg);
        return r->n_restore_errors;
    }
    pthread_mutex_lock(&r->journal_mu);
    r->restoring = true;
    pthread_mutex_unlock(&r->journal_mu);
    replay(r, &j, root);
    pthread_mutex_lock(&r->journal_mu);
    r->restoring = false;
    pthread_mutex_unlock(&r->journal_mu);
    lora_journal_free(&j);
    pthread_mutex_lock(&r->mu);
    size_t n = r->n_restore_errors;
    pthread_mutex_unlock(&r->mu);
    return n;
}

int lora_registry_restore_errors(lora_registry *r, lora_restore_error **out, size_t *n)
{
    *out = NULL;
    *n = 0;
    pthread_mutex_lock(&r->mu);
    int rc = QL_OK;
    if (r->n_restore_errors) {
        *out = malloc(r->n_restore_errors * sizeof **out);
        if (*out) {
            memcpy(*out, r->restore_errors, r->n_restore_errors * sizeof **out);
            *n = r->n_restore_errors;
        } else {
            rc = QL_ENOMEM;
        }
    }
    pthread_mutex_unlock(&r->mu);
    return rc;
}

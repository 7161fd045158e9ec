/*
 * generate.c - `qlserve generate`: its flags (cli_generate) and its jobs.
 * eng_generate loads a model, starts an engine and runs one request;
 * eng_generate_on runs one request on an engine already running, streaming
 * the completion to a stream and ending with a line of counts and speeds.
 * With --adapter the subcommand builds the model, an engine and a LoRA
 * registry (adapters/) itself, loads the adapter, merges it into the
 * weights when --merge asks (printing the merge report on stderr), and runs
 * the request wanting it. --activations is set for the process before the
 * model loads (server.h's srv_activations_set, shared with serve), and the
 * end line names what the run computed with. Everything it builds it frees
 * before returning.
 */
#include "cli.h"
#include "lora.h"
#include "model.h"
#include "server.h"

#include <pthread.h>
#include <string.h>

/* --- one request on an engine -------------------------------------------- */

/* One request in flight: the engine thread writes the tokens to out and,
 * under mu, the finish; the caller waits on done_cv for done. */
typedef struct generation {
    FILE *out;
    pthread_mutex_t mu;
    pthread_cond_t done_cv;
    bool done;
    eng_finish why;
    eng_usage usage;
} generation;

static void gen_token(void *user, const eng_token_event *ev)
{
    generation *g = user;
    fwrite(ev->text, 1, ev->len, g->out);
    fflush(g->out);
}

static void gen_done(void *user, eng_finish why, const eng_usage *usage)
{
    generation *g = user;
    pthread_mutex_lock(&g->mu);
    g->done = true;
    g->why = why;
    g->usage = *usage;
    pthread_cond_signal(&g->done_cv);
    pthread_mutex_unlock(&g->mu);
}

/* The line that ends a generation: token counts, speeds, finish, backend. */
static void print_speeds(FILE *info, const generation *g, eng_engine *e)
{
    const eng_usage *u = &g->usage;
    eng_engine_stats es;
    eng_engine_stats_get(e, &es);
    fprintf(info,
            "prompt %d tokens, %.1f tok/s prefill; generated %d tokens, %.1f tok/s decode; "
            "finish %s; on %s; activations %s; KV %s\n",
            u->prompt_tokens, u->prefill_s > 0 ? u->prompt_tokens / u->prefill_s : 0.0,
            u->generated_tokens,
            u->decode_s > 0 && u->generated_tokens > 1 ? (u->generated_tokens - 1) / u->decode_s
                                                       : 0.0,
            eng_finish_name(g->why), eng_engine_backend(e),
            ql_name_of(&ql_activations_names, qt_get_activations()), qt_kind_name(es.kv_dtype));
    const eng_spec_stats *sp = &es.spec;
    if (sp->drafter != ENG_SPEC_OFF) /* a line of its own: what speculation took */
        fprintf(info,
                "speculative %s: %llu drafts, %llu tokens drafted, %llu verified, %llu accepted\n",
                ql_name_of(&ql_speculative_names, (int)sp->drafter), (unsigned long long)sp->drafts,
                (unsigned long long)sp->drafted, (unsigned long long)sp->verified,
                (unsigned long long)sp->accepted);
}

int eng_generate_on(eng_engine *e, const eng_generate_opts *o, FILE *out, FILE *info, char *msg,
                    size_t msg_len)
{
    generation g = {.out = out};
    pthread_mutex_init(&g.mu, NULL);
    pthread_cond_init(&g.done_cv, NULL);
    const char *stops[1] = {o->stop};
    eng_request r = {.prompt = o->prompt,
                     .prompt_len = strlen(o->prompt),
                     .max_new_tokens = o->max_new_tokens,
                     .sampling = o->sampling,
                     .stop = stops,
                     .n_stop = o->stop ? 1 : 0,
                     .adapters = o->adapters,
                     .n_adapters = o->n_adapters,
                     .on_token = gen_token,
                     .on_done = gen_done,
                     .user = &g};
    uint64_t id;
    int rc = eng_engine_submit(e, &r, &id, msg, msg_len);
    if (rc == QL_OK) {
        pthread_mutex_lock(&g.mu);
        while (!g.done)
            pthread_cond_wait(&g.done_cv, &g.mu);
        pthread_mutex_unlock(&g.mu);
        fputc('\n', out);
        fflush(out);
        print_speeds(info, &g, e);
        if (g.why == ENG_FINISH_ERROR)
            rc = ql_fail(msg, msg_len, QL_EINVAL, "generation failed in the engine");
    }
    pthread_mutex_destroy(&g.mu);
    pthread_cond_destroy(&g.done_cv);
    return rc;
}

int eng_generate(const eng_load_opts *load, const eng_generate_opts *o, FILE *out, FILE *info,
                 char *msg, size_t msg_len)
{
    eng_model m;
    int rc = eng_model_load(&m, load, msg, msg_len);
    if (rc != QL_OK)
        return rc;
    eng_engine_opts eo = {.threads = o->threads,
                          .device = o->device,
                          .kv_bytes = o->kv_bytes,
                          .kv_dtype = o->kv_dtype,
                          .max_running = 8,
                          .spec = o->spec};
    eng_engine *e;
    rc = eng_engine_start(&e, &m, &eo, msg, msg_len);
    if (rc == QL_OK) {
        srv_activations_settle(e, info, "qlserve generate");
        rc = eng_generate_on(e, o, out, info, msg, msg_len);
        eng_engine_stop(e);
    }
    eng_model_free(&m);
    return rc;
}

/* --- the subcommand, and its adapter variant ---------------------------------- */

/* The merge report, one line per module and the whole, to f. */
static void print_merge_report(FILE *f, const lora_report *rep)
{
    for (size_t i = 0; i < rep->n_modules; i++) {
        const struct lora_module_cost *mc = &rep->modules[i];
        char path[64];
        fprintf(f, "merge: layer %d %-9s %-6s delta_retained %.4f relative_error %.4f\n", mc->layer,
                eng_proj_expert(mc->proj, NULL) >= 0 ? eng_proj_path(mc->proj, path, sizeof path)
                                                     : eng_proj_name(mc->proj),
                qt_kind_name(mc->kind), mc->cost.delta_retained, mc->cost.relative_error);
    }
    fprintf(f,
            "merge: %s x%g into %zu modules (%s): delta_retained %.4f, relative_error %.4f, "
            "%.3f s, weights version %llu digest %016llx\n",
            rep->adapter, (double)rep->scale, rep->n_modules,
            rep->into == QT_KIND_COUNT ? "each weight's own kind" : qt_kind_name(rep->into),
            rep->overall.delta_retained, rep->overall.relative_error, rep->seconds,
            (unsigned long long)rep->version, (unsigned long long)rep->digest);
}

/* The adapter at c->adapter into reg as "adapter", described on stderr,
 * and merged into the weights at c->adapter_scale when --merge asks (the
 * merge report on stderr). */
static int load_adapter(lora_registry *reg, const cfg_generate *c, char *msg, size_t msg_len)
{
    lora_meta meta;
    int rc = lora_registry_load(reg, "adapter", c->adapter, 1.0f, &meta, msg, msg_len);
    if (rc != QL_OK)
        return rc;
    fprintf(stderr, "adapter %s: rank %d, alpha %g, %d modules (%s)\n", c->adapter, meta.r,
            (double)meta.alpha, meta.n_modules, meta.targets);
    if (meta.warning[0])
        fprintf(stderr, "adapter %s: warning: %s\n", c->adapter, meta.warning);
    if (!c->merge)
        return QL_OK;
    /* config checked the word (cfg_parse_generate) */
    int into = c->into ? ql_name_parse(&ql_into_names, c->into) : QL_INTO_OWN;
    lora_merge_opts mo = {.safe_merge = true,
                          .into = lora_into_kind(into < 0 ? QL_INTO_OWN : (ql_into)into)};
    lora_report rep;
    rc = lora_registry_merge(reg, "adapter", c->adapter_scale, &mo, &rep, msg, msg_len);
    if (rc == QL_OK) {
        print_merge_report(stderr, &rep);
        lora_report_free(&rep);
    }
    return rc;
}

/* generate with --adapter: the model, an engine, a registry holding the
 * adapter (merged when asked), and one request wanting it. */
static int generate_with_adapter(const cfg_generate *c, const eng_load_opts *load,
                                 const eng_generate_opts *g, char *msg, size_t msg_len)
{
    eng_model m;
    int rc = eng_model_load(&m, load, msg, msg_len);
    if (rc != QL_OK)
        return rc;
    eng_engine_opts eo = {.threads = c->threads,
                          .device = g->device,
                          .kv_bytes = (size_t)c->kv_mib << 20,
                          .kv_dtype = g->kv_dtype,
                          .spec = g->spec};
    eng_engine *e = NULL;
    lora_registry *reg = NULL;
    eng_lora *lora = NULL;
    rc = eng_engine_start(&e, &m, &eo, msg, msg_len);
    if (rc == QL_OK) {
        srv_activations_settle(e, stderr, "qlserve generate");
        lora_registry_opts ro = {
            .dtype = c->adapter_dtype && lora_dtype_from_name(c->adapter_dtype) == LORA_DTYPE_BF16
                         ? LORA_DTYPE_BF16
                         : LORA_DTYPE_F32};
        rc = lora_registry_new(&reg, e, &m, &ro, msg, msg_len);
    }
    if (rc == QL_OK)
        rc = load_adapter(reg, c, msg, msg_len);
    if (rc == QL_OK)
        rc = lora_registry_get(reg, "adapter", &lora, msg, msg_len);
    if (rc == QL_OK) {
        eng_lora_term want = {lora, c->adapter_scale};
        eng_generate_opts go = *g;
        go.adapters = &want;
        go.n_adapters = 1;
        rc = eng_generate_on(e, &go, stdout, stderr, msg, msg_len);
    }
    eng_lora_unref(lora);
    eng_engine_stop(e); /* before the registry: no sequence holds an adapter after */
    lora_registry_free(reg);
    eng_model_free(&m);
    return rc;
}

int cli_generate(int argc, char **argv)
{
    char msg[1024];
    cfg_generate c;
    int rc = cfg_parse_generate(argc, argv, &c, msg, sizeof msg);
    if (rc != QL_OK)
        return cli_usage_failure("generate", rc, msg);
    eng_load_opts load = cli_load_opts(&c.model);
    eng_generate_opts g = {
        .prompt = c.prompt,
        .max_new_tokens = c.max_new_tokens,
        .sampling = {.temperature = c.temperature,
                     .top_k = c.top_k,
                     .top_p = c.top_p,
                     .repetition_penalty = c.repetition_penalty,
                     .seed = c.seed},
        .stop = c.stop,
        .threads = c.threads,
        .kv_bytes = (size_t)c.kv_mib << 20,
    };
    if (eng_device_parse(c.device, &g.device, msg, sizeof msg) != QL_OK ||
        srv_spec_opts(&c.spec, &g.spec, msg, sizeof msg) != QL_OK ||
        eng_kv_dtype_resolve(c.kv_dtype, g.device, &g.kv_dtype, msg, sizeof msg) != QL_OK) {
        fprintf(stderr, "qlserve generate: %s\n", msg);
        return 2;
    }
    srv_activations_set(c.activations); /* before the weights load: process-wide */
    eng_model draft;
    if (srv_draft_load(&c.spec, &load, &draft, &g.spec, msg, sizeof msg) != QL_OK) {
        fprintf(stderr, "qlserve generate: %s\n", msg);
        return 1;
    }
    if (c.adapter)
        rc = generate_with_adapter(&c, &load, &g, msg, sizeof msg);
    else
        rc = eng_generate(&load, &g, stdout, stderr, msg, sizeof msg);
    if (g.spec.draft_model) /* the engine that borrowed it has stopped */
        eng_model_free(&draft);
    if (rc != QL_OK) {
        fprintf(stderr, "qlserve generate: %s\n", msg);
        return 1;
    }
    return 0;
}

/*
 * bench_grammar.c - what constrained decoding costs, and what it gives,
 * on a real model through the engine, as JSON.
 *
 * For each batch B (default 1 and 32): rounds of B chat requests (the
 * model's own template, a user turn asking for a JSON record) submitted
 * together, sampled at --temperature with distinct seeds, once under the
 * JSON Schema's grammar and once without, alternating. Reported per
 * batch: the engine's steps, tokens and wall time of each, the time the
 * grammar's masks took (eng_engine_stats.grammar_seconds, measured around
 * every mask inside the sampler) per constrained draw and per step, and
 * the step time with and without the grammar. With --answers FILE every
 * constrained answer is written as a JSON line ({"batch", "seed",
 * "finish", "text"}) for bench/grammar.sh, which validates each against
 * the schema with the reference validator (Python's jsonschema).
 *
 * Usage: bench_grammar --model PATH [--schema FILE] [--batches 1,32]
 *                      [--rounds R] [--new-tokens N] [--temperature T]
 *                      [--threads N] [--answers FILE]
 */
#include "bench_server.h"
#include "grammar.h"
#include "model.h"
#include "scheduler.h"
#include "template.h"

#include <cjson/cJSON.h>
#include <pthread.h>

/* A record with what the supported keywords cover: required and optional
 * properties, bounded strings, an enum, a format, an array with bounds. */
static const char default_schema[] =
    "{\"type\": \"object\", \"properties\": {"
    "\"name\": {\"type\": \"string\", \"minLength\": 1, \"maxLength\": 40},"
    "\"age\": {\"type\": \"integer\"},"
    "\"role\": {\"enum\": [\"admin\", \"user\", \"guest\"]},"
    "\"joined\": {\"type\": \"string\", \"format\": \"date\"},"
    "\"tags\": {\"type\": \"array\", \"items\": {\"type\": \"string\", \"maxLength\": 20}, "
    "\"maxItems\": 4},"
    "\"active\": {\"type\": \"boolean\"}},"
    "\"required\": [\"name\", \"age\", \"role\", \"active\"], \"additionalProperties\": false}";

typedef struct run_figures {
    int answers, eos, length, errors;
    uint64_t steps, tokens, masks;
    double wall_s, mask_s;
} run_figures;

typedef struct pending {
    pthread_mutex_t *mu;
    pthread_cond_t *cv;
    int *left;
    char *text;
    size_t len, cap;
    eng_finish why;
} pending;

static void on_token(void *user, const eng_token_event *ev)
{
    pending *p = user;
    if (p->len + ev->len + 1 > p->cap) {
        p->cap = (p->len + ev->len + 1) * 2;
        p->text = realloc(p->text, p->cap);
        if (!p->text)
            die("out of memory", NULL);
    }
    memcpy(p->text + p->len, ev->text, ev->len);
    p->len += ev->len;
    p->text[p->len] = 0;
}

static void on_done(void *user, eng_finish why, const eng_usage *u)
{
    (void)u;
    pending *p = user;
    pthread_mutex_lock(p->mu);
    p->why = why;
    (*p->left)--;
    pthread_cond_signal(p->cv);
    pthread_mutex_unlock(p->mu);
}

/* A file's text (malloc'd), or NULL. */
static char *read_text(const char *path)
{
    FILE *f = fopen(path, "rb");
    if (!f)
        return NULL;
    fseek(f, 0, SEEK_END);
    long n = ftell(f);
    fseek(f, 0, SEEK_SET);
    char *s = n >= 0 ? malloc((size_t)n + 1) : NULL;
    if (s && fread(s, 1, (size_t)n, f) != (size_t)n) {
        free(s);
        s = NULL;
    }
    if (s)
        s[n] = 0;
    fclose(f);
    return s;
}

/* The chat prompt: the model's template over one user turn. */
static char *chat_prompt(const eng_model *m)
{
    if (!m->chat_template)
        die("the model has no chat template", NULL);
    tpl_template *t;
    char msg[512];
    if (tpl_compile(&t, m->chat_template, strlen(m->chat_template), msg, sizeof msg) != QL_OK)
        die("chat template", msg);
    cJSON *ctx = cJSON_CreateObject(), *msgs = cJSON_AddArrayToObject(ctx, "messages");
    cJSON *turn = cJSON_CreateObject();
    cJSON_AddStringToObject(turn, "role", "user");
    cJSON_AddStringToObject(turn, "content",
                            "Make up a user record for a web application, as JSON: name, age, "
                            "role, join date, a few tags, and whether the account is active.");
    cJSON_AddItemToArray(msgs, turn);
    cJSON_AddBoolToObject(ctx, "add_generation_prompt", true);
    cJSON_AddStringToObject(ctx, "bos_token", "");
    cJSON_AddStringToObject(ctx, "eos_token", "");
    char *out;
    size_t len;
    if (tpl_render(t, ctx, 0, &out, &len, msg, sizeof msg) != QL_OK)
        die("chat template", msg);
    cJSON_Delete(ctx);
    tpl_free(t);
    return out;
}

/* B requests together, under g or not; their figures added to f, their
 * answers written to answers when g and answers are set. */
static void run_round(eng_engine *e, const char *prompt, gr_grammar *g, int B, int new_tokens,
                      float temperature, uint64_t seed0, run_figures *f, FILE *answers)
{
    pthread_mutex_t mu = PTHREAD_MUTEX_INITIALIZER;
    pthread_cond_t cv = PTHREAD_COND_INITIALIZER;
    int left = B;
    pending *p = calloc((size_t)B, sizeof *p);
    eng_engine_stats before, after;
    eng_engine_stats_get(e, &before);
    double t0 = now();
    char msg[512];
    for (int i = 0; i < B; i++) {
        p[i] = (pending){.mu = &mu, .cv = &cv, .left = &left};
        eng_request r = {.prompt = prompt,
                         .prompt_len = strlen(prompt),
                         .templated = true,
                         .max_new_tokens = new_tokens,
                         .grammar = g,
                         .sampling = {.temperature = temperature, .seed = seed0 + (uint64_t)i},
                         .skip_special_tokens = true,
                         .on_token = on_token,
                         .on_done = on_done,
                         .user = &p[i]};
        if (eng_engine_submit(e, &r, NULL, msg, sizeof msg) != QL_OK)
            die("submit", msg);
    }
    pthread_mutex_lock(&mu);
    while (left > 0)
        pthread_cond_wait(&cv, &mu);
    pthread_mutex_unlock(&mu);
    f->wall_s += now() - t0;
    eng_engine_stats_get(e, &after);
    f->steps += after.steps - before.steps;
    f->tokens += after.tokens_generated - before.tokens_generated;
    f->masks += after.grammar_masks - before.grammar_masks;
    f->mask_s += after.grammar_seconds - before.grammar_seconds;
    for (int i = 0; i < B; i++) {
        f->answers++;
        f->eos += p[i].why == ENG_FINISH_EOS;
        f->length += p[i].why == ENG_FINISH_LENGTH;
        f->errors += p[i].why == ENG_FINISH_ERROR || p[i].why == ENG_FINISH_GRAMMAR;
        if (g && answers) {
            cJSON *line = cJSON_CreateObject();
            cJSON_AddNumberToObject(line, "batch", B);
            cJSON_AddNumberToObject(line, "seed", (double)(seed0 + (uint64_t)i));
            cJSON_AddStringToObject(line, "finish", eng_finish_name(p[i].why));
            cJSON_AddStringToObject(line, "text", p[i].text ? p[i].text : "");
            char *s = cJSON_PrintUnformatted(line);
            fprintf(answers, "%s\n", s);
            free(s);
            cJSON_Delete(line);
        }
        free(p[i].text);
    }
    free(p);
}

static void print_run(FILE *out, const char *name, const run_figures *f, bool last)
{
    fprintf(out,
            "      \"%s\": {\"answers\": %d, \"finished_eos\": %d, \"finished_length\": %d, "
            "\"errors\": %d, \"steps\": %llu, \"tokens\": %llu, \"wall_s\": %.3f, "
            "\"tok_s\": %.2f, \"step_ms\": %.3f, \"masks\": %llu, \"mask_s\": %.4f}%s\n",
            name, f->answers, f->eos, f->length, f->errors, (unsigned long long)f->steps,
            (unsigned long long)f->tokens, f->wall_s,
            f->wall_s > 0 ? (double)f->tokens / f->wall_s : 0,
            f->steps ? 1e3 * f->wall_s / (double)f->steps : 0, (unsigned long long)f->masks,
            f->mask_s, last ? "" : ",");
}

int main(int argc, char **argv)
{
    const char *model = NULL, *schema_path = NULL, *answers_path = NULL;
    int batches[8] = {1, 32}, n_batches = 2, rounds = 2, new_tokens = 160, threads = 2;
    float temperature = 0.8f;
    for (int i = 1; i + 1 < argc; i += 2) {
        if (!strcmp(argv[i], "--model"))
            model = argv[i + 1];
        else if (!strcmp(argv[i], "--schema"))
            schema_path = argv[i + 1];
        else if (!strcmp(argv[i], "--answers"))
            answers_path = argv[i + 1];
        else if (!strcmp(argv[i], "--rounds"))
            rounds = atoi(argv[i + 1]);
        else if (!strcmp(argv[i], "--new-tokens"))
            new_tokens = atoi(argv[i + 1]);
        else if (!strcmp(argv[i], "--threads"))
            threads = atoi(argv[i + 1]);
        else if (!strcmp(argv[i], "--temperature"))
            temperature = (float)atof(argv[i + 1]);
        else if (!strcmp(argv[i], "--batches")) {
            n_batches = 0;
            for (char *s = argv[i + 1]; *s && n_batches < 8; s += strspn(s, ","))
                batches[n_batches++] = (int)strtol(s, &s, 10);
        } else
            die("unknown option", argv[i]);
    }
    char default_model[1024];
    if (!model && test_default_model_path(default_model, sizeof default_model))
        model = default_model;
    if (!model)
        die("usage", "bench_grammar [--model PATH] [--schema FILE] [--batches 1,32] [--rounds R] "
                     "[--new-tokens N] [--temperature T] [--threads N] [--answers FILE]");
    char *schema = schema_path ? read_text(schema_path) : strdup(default_schema);
    if (!schema)
        die("cannot read the schema", schema_path);
    char msg[1024];
    eng_model m;
    eng_load_opts lo = {.path = model};
    if (eng_model_load(&m, &lo, msg, sizeof msg) != QL_OK)
        die("engine", msg);
    gr_grammar *g;
    double t = now();
    if (gr_compile(GR_JSON_SCHEMA, schema, strlen(schema), 0, &g, msg, sizeof msg) != QL_OK)
        die("schema", msg);
    double compile_s = now() - t;
    char *prompt = chat_prompt(&m);
    int most = 1;
    for (int i = 0; i < n_batches; i++)
        most = batches[i] > most ? batches[i] : most;
    eng_engine_opts eo = {.threads = threads, .max_running = most, .kv_bytes = (size_t)512 << 20};
    eng_engine *e;
    if (eng_engine_start(&e, &m, &eo, msg, sizeof msg) != QL_OK)
        die("engine", msg);
    FILE *answers = answers_path ? fopen(answers_path, "w") : NULL;
    if (answers_path && !answers)
        die("cannot write", answers_path);
    bench_machine mc = machine_now();
    printf("{\n  \"bench\": \"bench_grammar\",\n  \"model\": ");
    print_json_string(stdout, model);
    printf(",\n  \"machine\": {\"cpu\": ");
    print_json_string(stdout, mc.cpu);
    printf(", \"date\": \"%s\", \"threads\": %d},\n", mc.date, threads);
    printf("  \"temperature\": %g, \"new_tokens\": %d, \"rounds\": %d,\n", (double)temperature,
           new_tokens, rounds);
    printf("  \"grammar\": {\"elements\": %zu, \"compile_ms\": %.2f},\n  \"schema\": ",
           gr_grammar_size(g), 1e3 * compile_s);
    print_json_string(stdout, schema);
    printf(",\n  \"batches\": [\n");
    uint64_t seed = 1;
    for (int b = 0; b < n_batches; b++) {
        run_figures with = {0}, without = {0};
        for (int r = 0; r < rounds; r++) { /* alternating, the same seeds */
            run_round(e, prompt, g, batches[b], new_tokens, temperature, seed, &with, answers);
            run_round(e, prompt, NULL, batches[b], new_tokens, temperature, seed, &without, NULL);
            seed += (uint64_t)batches[b];
        }
        printf("    {\"batch\": %d,\n", batches[b]);
        print_run(stdout, "constrained", &with, false);
        print_run(stdout, "unconstrained", &without, false);
        printf("      \"mask_ms_per_draw\": %.4f, \"mask_ms_per_step\": %.4f, "
               "\"mask_share_of_step\": %.4f}%s\n",
               with.masks ? 1e3 * with.mask_s / (double)with.masks : 0,
               with.steps ? 1e3 * with.mask_s / (double)with.steps : 0,
               with.wall_s > 0 ? with.mask_s / with.wall_s : 0, b + 1 < n_batches ? "," : "");
    }
    printf("  ]\n}\n");
    if (answers)
        fclose(answers);
    eng_engine_stop(e);
    gr_grammar_unref(g);
    free(prompt);
    free(schema);
    eng_model_free(&m);
    return 0;
}

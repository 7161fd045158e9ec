/*
 * test_cuda_speculative.c - speculative decoding on the CUDA backend: a
 * drafting sequence's k + 1 verification rows go through the device's step
 * beside the other sequences' rows (decodes, prompt chunks), every row's
 * logits come back to the host sampler, and the KV positions of rejected
 * drafts are rolled back in the host's block bookkeeping the device reads
 * each step. On the tiny Qwen3 (tests/fixtures/qwen3_tiny.gguf), over
 * prompts with runs that come back (so the n-gram drafter finds matches,
 * some taken and some not), answered four at a time with EOS kept as a
 * token (every answer is max_new tokens long):
 *   - greedy answers with `--speculative ngram` on the device are the
 *     device's answers without it, and both are the CPU engine's; drafts
 *     were verified, accepted and rejected (so the check fails when
 *     speculation is off on the device);
 *   - the same with `--speculative draft`, the model drafting for itself
 *     (the draft model always runs on its own CPU backend, beside a CUDA
 *     target);
 *   - a next turn whose prompt is a first answer after rejections starts
 *     from the prefix cache's blocks (only accepted positions were kept)
 *     and gives the CPU's tokens.
 * The device and the CPU sum in other orders (and a step of more rows than
 * the fused matvec takes goes through cuBLASLt), so where the CPU's best
 * logit leads the runner-up by no more than CLOSE_CALL an answer is
 * compared only up to that token (counted and printed: no two summation
 * orders can promise such a call); at least half of all tokens must be
 * compared, so the check cannot pass on close calls alone.
 *
 * Plain C, no Criterion (the GPU machine has only CUDA and cJSON): prints
 * `PASS name` or `FAIL name: detail` per check; exit 0 when all passed, 1
 * when one failed, 77 when there is no usable device.
 */
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "gpu_model_util.h"
#include "model.h"
#include "qt_cuda.h"
#include "scheduler.h"

/* a logit lead the two backends' summation orders cannot flip: test_cuda_engine's 1e-3 of the
 * largest logit, with the tiny model's logits of order 1 */
#define CLOSE_CALL 1e-3
#define MAX_NEW    32
#define N_PROMPTS  6

/* What one request produced: its tokens, and with logprobs the lead of each token's logprob
 * over the runner-up's (the CPU reference's). */
typedef struct answer {
    gpu_pending pending; /* first: the engine's user */
    int32_t tokens[MAX_NEW];
    float lead[MAX_NEW];
    int n;
    eng_usage usage;
} answer;

static void answer_token(void *user, const eng_token_event *ev)
{
    answer *a = user;
    if (ev->token < 0 || a->n >= MAX_NEW)
        return;
    a->lead[a->n] = ev->n_top >= 2 ? ev->top[0].logprob - ev->top[1].logprob : 0.0f;
    a->tokens[a->n++] = ev->token;
}

static void answer_done(void *user, eng_finish why, const eng_usage *u)
{
    (void)why;
    answer *a = user;
    a->usage = *u;
    gpu_pending_done(&a->pending);
}

/* A request for prompt's ids: greedy, max_new tokens, EOS a token like another (answers of one
 * length), with two top logprobs when scored (the reference's leads). */
static eng_request greedy(const int32_t *prompt, size_t n, int32_t max_new, bool scored)
{
    return (eng_request){.prompt_tokens = prompt,
                         .n_prompt_tokens = n,
                         .max_new_tokens = max_new,
                         .sampling = {.ignore_eos = true},
                         .logprobs = scored,
                         .top_logprobs = scored ? 2 : 0};
}

/* reqs[0..n) (at most N_PROMPTS) submitted together to e, answers into a once all are done. */
static int run(eng_engine *e, const eng_request *reqs, answer *a, int n, char *msg, size_t msg_len)
{
    eng_request r[N_PROMPTS];
    gpu_pending *pending[N_PROMPTS];
    for (int i = 0; i < n; i++) {
        a[i] = (answer){0};
        r[i] = reqs[i];
        r[i].on_token = answer_token;
        r[i].on_done = answer_done;
        pending[i] = &a[i].pending;
    }
    return gpu_submit_wait(e, r, pending, n, msg, msg_len);
}

static int start(eng_engine **e, const eng_model *m, eng_device d, const eng_spec_opts *spec,
                 char *msg, size_t msg_len)
{
    eng_engine_opts o = {.device = d,
                         .threads = 2,
                         .kv_bytes = (size_t)8 << 20,
                         .max_running = 4,
                         .spec = spec ? *spec : (eng_spec_opts){0}};
    return eng_engine_start(e, m, &o, msg, msg_len);
}

/* How got's answers stand against the reference's (ref, scored). */
typedef struct agreement {
    int compared, close_calls, tokens;
    int bad_answer, bad_token; /* the first clear difference; -1: none */
} agreement;

/* Each answer token by token up to the reference's first close call: a difference before it
 * is a clear one. */
static agreement agree(const answer *ref, const answer *got, int n)
{
    agreement g = {.bad_answer = -1, .bad_token = -1};
    for (int i = 0; i < n; i++) {
        g.tokens += ref[i].n;
        int t = 0;
        for (; t < ref[i].n && ref[i].lead[t] > CLOSE_CALL; t++, g.compared++)
            if (t >= got[i].n || got[i].tokens[t] != ref[i].tokens[t])
                break;
        if (t < ref[i].n && ref[i].lead[t] <= CLOSE_CALL)
            g.close_calls++;
        else if ((t < ref[i].n || got[i].n != ref[i].n) && g.bad_answer < 0) {
            g.bad_answer = i;
            g.bad_token = t;
        }
    }
    return g;
}

/* PASS when got agrees with ref (agree) on at least half of all tokens. */
static void report_agreement(const char *name, const answer *ref, const answer *got, int n)
{
    agreement g = agree(ref, got, n);
    gpu_report(g.bad_answer < 0 && 2 * g.compared >= g.tokens, name,
               "answer %d differs at token %d where the CPU's lead was clear; %d of %d tokens "
               "compared",
               g.bad_answer, g.bad_token, g.compared, g.tokens);
    printf("  %s: %d of %d tokens compared, %d close calls\n", name, g.compared, g.tokens,
           g.close_calls);
}

/* Drafts verified, some accepted, and (when rejected) some rejected: the rollback ran. */
static void report_drafts(const char *name, const eng_spec_stats *s, bool rejected)
{
    gpu_report(s->drafter != ENG_SPEC_OFF && s->drafts > 0 && s->accepted > 0 &&
                   (!rejected || s->verified > s->accepted),
               name, "drafter %d (%s): %llu drafts, %llu verified, %llu accepted", (int)s->drafter,
               s->off_reason, (unsigned long long)s->drafts, (unsigned long long)s->verified,
               (unsigned long long)s->accepted);
    printf("  %s: %llu drafts, %llu drafted tokens verified, %llu accepted\n", name,
           (unsigned long long)s->drafts, (unsigned long long)s->verified,
           (unsigned long long)s->accepted);
}

/* Runs that come back (and one token alone), in the tiny vocabulary of 260. */
static const int32_t p0[] = {10, 11, 12, 13, 10, 11, 12, 13, 10, 11, 12};
static const int32_t p1[] = {40, 41, 42, 43, 44, 40, 41, 42, 43, 44, 40, 41};
static const int32_t p2[] = {7, 7, 7, 7, 7};
static const int32_t p3[] = {100, 101, 102, 100, 101, 102, 100};
static const int32_t p4[] = {200, 17, 93, 5, 61, 200, 17, 93};
static const int32_t p5[] = {3};
static const int32_t *const prompts[N_PROMPTS] = {p0, p1, p2, p3, p4, p5};
static const size_t prompt_lens[N_PROMPTS] = {11, 12, 5, 7, 8, 1};

/* The device's greedy answers with drafter spec (NULL: none) into a, the engine's figures into
 * *st; with next (not NULL), then on the same engine the next turn of answer 0 (its prompt and
 * answer as the prompt) into *next. */
static int device_answers(const eng_model *m, const eng_spec_opts *spec, answer *a,
                          eng_engine_stats *st, answer *next, char *msg, size_t msg_len)
{
    eng_request reqs[N_PROMPTS];
    for (int i = 0; i < N_PROMPTS; i++)
        reqs[i] = greedy(prompts[i], prompt_lens[i], MAX_NEW, false);
    eng_engine *e = NULL;
    int rc = start(&e, m, ENG_DEVICE_CUDA, spec, msg, msg_len);
    if (rc == QL_OK)
        rc = run(e, reqs, a, N_PROMPTS, msg, msg_len);
    int32_t turn[64];
    memcpy(turn, p0, sizeof p0);
    memcpy(turn + prompt_lens[0], a[0].tokens, sizeof a[0].tokens);
    eng_request again = greedy(turn, prompt_lens[0] + MAX_NEW, MAX_NEW / 2, false);
    if (rc == QL_OK && next)
        rc = run(e, &again, next, 1, msg, msg_len);
    if (rc == QL_OK && !eng_engine_settle(e, 60))
        rc = ql_fail(msg, msg_len, QL_EINVAL, "the engine did not settle in 60 s");
    if (rc == QL_OK)
        eng_engine_stats_get(e, st);
    if (e)
        eng_engine_stop(e);
    return rc;
}

/* The CPU engine's scored answers (no speculation): the prompts' into a, and the next turn of
 * device answer first's into *next. */
static int cpu_answers(const eng_model *m, answer *a, const answer *first, answer *next, char *msg,
                       size_t msg_len)
{
    eng_request reqs[N_PROMPTS];
    for (int i = 0; i < N_PROMPTS; i++)
        reqs[i] = greedy(prompts[i], prompt_lens[i], MAX_NEW, true);
    int32_t turn[64];
    memcpy(turn, p0, sizeof p0);
    memcpy(turn + prompt_lens[0], first->tokens, sizeof first->tokens);
    eng_request again = greedy(turn, prompt_lens[0] + MAX_NEW, MAX_NEW / 2, true);
    eng_engine *e = NULL;
    int rc = start(&e, m, ENG_DEVICE_CPU, NULL, msg, msg_len);
    if (rc == QL_OK)
        rc = run(e, reqs, a, N_PROMPTS, msg, msg_len);
    if (rc == QL_OK)
        rc = run(e, &again, next, 1, msg, msg_len);
    if (e)
        eng_engine_stop(e);
    return rc;
}

static void speculative_on_device(const eng_model *m)
{
    static answer cpu[N_PROMPTS], plain[N_PROMPTS], ngram[N_PROMPTS], draft[N_PROMPTS];
    answer cpu_next, ngram_next;
    eng_engine_stats st_plain, st_ngram, st_draft;
    eng_spec_opts by_ngram = {.drafter = ENG_SPEC_NGRAM},
                  by_draft = {.drafter = ENG_SPEC_DRAFT, .draft_model = m};
    char msg[512] = "";
    int rc = device_answers(m, NULL, plain, &st_plain, NULL, msg, sizeof msg);
    if (rc == QL_OK)
        rc = device_answers(m, &by_ngram, ngram, &st_ngram, &ngram_next, msg, sizeof msg);
    if (rc == QL_OK)
        rc = device_answers(m, &by_draft, draft, &st_draft, NULL, msg, sizeof msg);
    if (rc == QL_OK)
        rc = cpu_answers(m, cpu, &ngram[0], &cpu_next, msg, sizeof msg);
    if (rc != QL_OK) {
        gpu_report(false, "speculative_engines_run_on_the_device", "%s", msg);
        return;
    }
    report_agreement("device_greedy_answers_equal_the_cpus", cpu, plain, N_PROMPTS);
    report_agreement("device_ngram_speculation_keeps_the_greedy_answers", cpu, ngram, N_PROMPTS);
    report_drafts("device_ngram_drafts_are_accepted_and_rejected", &st_ngram.spec, true);
    report_agreement("device_draft_model_speculation_keeps_the_greedy_answers", cpu, draft,
                     N_PROMPTS);
    report_drafts("device_draft_model_drafts_are_accepted", &st_draft.spec, false);
    /* the answers to the same prompts on the device, with and without drafts, token for token
     * up to the CPU's first close call (agree, with the plain run as the one compared against) */
    for (int i = 0; i < N_PROMPTS; i++)
        memcpy(plain[i].lead, cpu[i].lead, sizeof plain[i].lead);
    report_agreement("device_ngram_answers_equal_the_device_plain_ones", plain, ngram, N_PROMPTS);
    gpu_report(
        st_plain.spec.drafts == 0 && st_ngram.kv_blocks_used == 0 && st_draft.kv_blocks_used == 0,
        "device_speculation_returns_every_kv_block",
        "drafts without speculation %llu; blocks in use after ngram %d, after draft %d",
        (unsigned long long)st_plain.spec.drafts, st_ngram.kv_blocks_used, st_draft.kv_blocks_used);
    gpu_report(ngram_next.usage.cached_tokens > (int32_t)prompt_lens[0], "device_next_turn_cached",
               "the next turn found %d cached tokens of its %d (prompt %zu)",
               ngram_next.usage.cached_tokens, ngram_next.usage.prompt_tokens, prompt_lens[0]);
    printf("  next turn: %d of its %d prompt tokens from the prefix cache\n",
           ngram_next.usage.cached_tokens, ngram_next.usage.prompt_tokens);
    report_agreement("device_next_turn_after_rejected_drafts_equals_the_cpus", &cpu_next,
                     &ngram_next, 1);
}

int main(void)
{
    int n = 0;
    char msg[512];
    if (qt_cuda_device_count(&n, msg, sizeof msg) != QL_OK || n < 1) {
        printf("SKIP test_cuda_speculative: no CUDA device (%s)\n", msg);
        return 77;
    }
    eng_model m;
    eng_load_opts lo = {.path = QL_FIXTURES "/qwen3_tiny.gguf"};
    if (eng_model_load(&m, &lo, msg, sizeof msg) != QL_OK) {
        gpu_report(false, "load_qwen3_tiny", "%s", msg);
        return gpu_summary();
    }
    speculative_on_device(&m);
    eng_model_free(&m);
    return gpu_summary();
}

/*
 * scheduler.h - the public header of engine/scheduler/: requests in, tokens out, continuously
 * batched on one thread.
 *
 * It offers sampling (eng_sampling, each sequence's own seeded eng_sampler), stop strings matched
 * across token boundaries (eng_stop), and the engine (eng_engine_*): a thread that owns the run
 * state (the running set, the samplers, the backend and its KV cache), admits requests first come
 * first served, runs one step after another and publishes weight versions between two steps.
 * Other threads submit, cancel and read statistics through a small inbox guarded by a mutex. It
 * touches engine/runtime/ (through runtime.h alone) and engine/model/, nothing above. Inside the
 * folder: sampler.c (eng_sampling, eng_sampler, eng_stop), scheduler.c (eng_engine_*), drafter.c,
 * draft_model.c and mtp_drafter.c (speculative.h's drafters).
 */
#ifndef QL_SCHEDULER_H
#define QL_SCHEDULER_H

#include "grammar.h"
#include "runtime.h"
#include "speculative.h"

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

/* One entry of a logit bias: bias is added to token's logit (OpenAI's
 * logit_bias; -100 effectively bans the token). */
typedef struct eng_logit_bias {
    int32_t token; /* >= 0; ids past the vocabulary are ignored */
    float bias;    /* in [-100, 100] */
} eng_logit_bias;

#define ENG_MAX_LOGIT_BIAS 300 /* logit_bias entries at most (OpenAI's limit) */

/* How a request samples (sampler.c). Zero-initialised: greedy. */
typedef struct eng_sampling {
    float temperature; /* 0: greedy; > 0 */
    int32_t top_k;     /* 0: off */
    float top_p;       /* 0 or 1: off; else in (0, 1) */
    /* locally typical sampling (TGI's typical_p, transformers' warper, after
     * top-p as theirs): 0 or 1: off; else in (0, 1) */
    float typical_p;
    float repetition_penalty; /* 0 or 1: off; else > 0 (CTRL / HF semantics) */
    /* OpenAI's, over the tokens generated so far (not the prompt), c(t)
     * times generated: logit[t] -= frequency * c(t) + presence * (c(t) > 0).
     * Each in [-2, 2]; 0 is off */
    float presence_penalty, frequency_penalty;
    /* added to the logits first; borrowed (the sampler copies them); at
     * most ENG_MAX_LOGIT_BIAS; a token named twice gets both */
    const eng_logit_bias *logit_bias;
    size_t n_logit_bias;
    /* vLLM's: the end-of-sequence token cannot be chosen (and stop strings
     * do not end the sequence) before this many tokens; >= 0 */
    int32_t min_tokens;
    /* vLLM's: the EOS token is kept as a token and ends nothing (the
     * engine's concern, not the sampler's) */
    bool ignore_eos;
    uint64_t seed; /* the same seed and inputs give the same tokens */
} eng_sampling;

int eng_sampling_check(const eng_sampling *p, char *msg, size_t msg_len);

typedef struct eng_token_count { /* the frequency penalty's c(t) */
    int32_t token, count;
} eng_token_count;

/* A sequence's sampler: its parameters, its own random stream (what else
 * is in the batch never changes its tokens), the tokens seen (repetition
 * penalty) and generated (presence, frequency penalties, min_tokens). */
typedef struct eng_sampler {
    eng_sampling p; /* p.logit_bias points at the sampler's own copy */
    uint64_t rng[4];
    int32_t *seen; /* distinct token ids seen, prompt and generated, sorted (owned) */
    size_t n_seen, cap_seen;
    /* distinct generated ids with their counts, sorted by id (owned; kept
     * only when a presence or frequency penalty is on): at most one entry
     * per generated token */
    eng_token_count *counts;
    size_t n_counts, cap_counts;
    eng_logit_bias *bias;  /* the copy of p.logit_bias (owned) */
    gr_matcher *grammar;   /* eng_sampler_constrain's (owned); NULL: none */
    int64_t grammar_ns;    /* the last draw's time in its mask */
    int64_t n_generated;   /* tokens recorded since init */
    int32_t eos[8], n_eos; /* the tokens that end an answer, min_tokens holds back */
} eng_sampler;

/* Copies p (its logit bias too) and the prompt's distinct ids; knows no
 * end-of-sequence token until eng_sampler_set_eos. */
int eng_sampler_init(eng_sampler *s, const eng_sampling *p, const int32_t *prompt, size_t n_prompt);
void eng_sampler_free(eng_sampler *s);
/* The model's tokens that end an answer (n <= 8), which min_tokens bans. */
void eng_sampler_set_eos(eng_sampler *s, const int32_t *eos, int32_t n);
/* Constrain s to grammar g over vocabulary v (gr_matcher_new's): each draw is masked first (-1
 * when the grammar fails or allows nothing); _done: the answer is whole, nothing may follow. */
int eng_sampler_constrain(eng_sampler *s, gr_grammar *g, const gr_vocab *v, char *msg,
                          size_t msg_len);
bool eng_sampler_grammar_done(const eng_sampler *s);
/* Whether the end-of-sequence token may end the sequence now: min_tokens
 * tokens have been recorded before the last one. */
bool eng_sampler_may_end(const eng_sampler *s);
/* Pick the next token from logits (vocab entries, modified in place);
 * scratch holds at least vocab floats + vocab int32s. Records the token. */
int32_t eng_sample(eng_sampler *s, float *logits, int32_t vocab, void *scratch);
/* Record a token chosen elsewhere (a backend's greedy choice) as eng_sample
 * records its own. */
void eng_sampler_record(eng_sampler *s, int32_t token);
/* Whether s's next token is the plain argmax of its logits (temperature 0,
 * nothing that could change the logits now): a backend can choose it. */
bool eng_sampler_greedy(const eng_sampler *s);
/* Whether s's next token is a plain temperature draw over the whole vocabulary (no top-k, top-p,
 * nor anything that could change the logits now), which a backend can make where the logits are
 * (kernels/math/sample_math.h); *inv_temperature gets eng_sample's 1 / T. */
bool eng_sampler_plain_draw(const eng_sampler *s, int32_t vocab, float *inv_temperature);
/* The uniform eng_sample would draw next (a backend's draw stands for it). */
double eng_sampler_uniform(eng_sampler *s);

/* Stop strings, matched on the decoded text across token boundaries, not emitted (text that may
 * begin one is held back until it can't). Bounds: stop strings in chat formats and code fences run
 * under 100 bytes; 4 KiB each, 8 KiB in all is far past any of them and keeps a request's tables (5
 * bytes per byte, once per request) and a choice's held text small. */
#define ENG_STOP_MAX_COUNT       16
#define ENG_STOP_MAX_BYTES       4096
#define ENG_STOP_MAX_TOTAL_BYTES 8192
typedef struct eng_stop eng_stop;
/* Copies the strings; refuses an empty one and the bounds (QL_EINVAL). */
int eng_stop_new(eng_stop **out, const char *const *stops, size_t n, char *msg, size_t msg_len);
/* A fresh matcher of s's strings sharing s's copy (a request's choices). */
int eng_stop_fork(const eng_stop *s, eng_stop **out, char *msg, size_t msg_len);
void eng_stop_free(eng_stop *s);
/* Feed decoded text. *emit (borrowed until the next call) and *emit_len receive what is safe to
 * show now. Returns true when a stop string has completed: the text before it has been emitted, the
 * rest is dropped, and generation should end. */
bool eng_stop_feed(eng_stop *s, const char *text, size_t len, const char **emit, size_t *emit_len);
/* vLLM's include_stop_str_in_output: a completed stop string is emitted (and still ends it). */
void eng_stop_include(eng_stop *s, bool include);
/* While held (min_tokens not yet reached), a stop string that completes
 * does not stop: its text is emitted as any other and matching goes on. */
void eng_stop_hold(eng_stop *s, bool held);
void eng_stop_flush(eng_stop *s, const char **emit, size_t *emit_len);

/* --- the engine: continuous batching on one thread (scheduler.c) ------------ */

typedef enum eng_finish {
    ENG_FINISH_EOS,       /* the model ended its answer */
    ENG_FINISH_LENGTH,    /* max_new_tokens, or the context is full */
    ENG_FINISH_STOP,      /* a stop string (not emitted) */
    ENG_FINISH_CANCELLED, /* eng_engine_cancel, or the engine stopped */
    ENG_FINISH_ERROR,     /* the step failed (out of memory); the engine goes on */
    ENG_FINISH_GRAMMAR,   /* its grammar took more than its budget (or bounds) for a token */
} eng_finish;

const char *eng_finish_name(eng_finish f); /* "eos", "length", ... */

typedef struct eng_usage {
    int32_t prompt_tokens;
    int32_t cached_tokens; /* of them, whose KV came from the prefix cache */
    int32_t generated_tokens;
    double queued_s;  /* submitted to admitted */
    double prefill_s; /* admitted to first token */
    double decode_s;  /* first token to the last */
    eng_spec_usage spec;
} eng_usage;

#define ENG_MAX_LOGPROBS 20 /* alternatives per token (OpenAI's top_logprobs limit) */

typedef struct eng_logprob {
    int32_t token;
    float logprob;
} eng_logprob;

/* What the engine reports of one token of one choice (eng_request.on_token).
 * Log-probabilities are of the model's own distribution at that step: the
 * log-softmax of the raw logits, before logit_bias, penalties, temperature
 * and top-k/top-p/typical_p (vLLM's "raw" logprobs), summed in float64. */
typedef struct eng_token_event {
    int32_t choice; /* 0 .. n_choices - 1 */
    /* the token that completed text; -1: text the stop filter held back,
     * released at the end (no logprobs then) */
    int32_t token;
    const char *text; /* UTF-8, whole characters; may be empty */
    size_t len;
    /* only when the request asked for logprobs and token >= 0: token's
     * log-probability, and the top_logprobs most likely tokens, most likely
     * first (ties: the lower id first); top is NULL when none were asked */
    float logprob;
    const eng_logprob *top;
    int32_t n_top;
} eng_token_event;

/* The prompt as the model saw it (eng_request.on_prompt), borrowed for the
 * call: its tokens, each one's log-probability given those before (the
 * first's NaN) and the n_top likeliest there (row 0 filled with -1). */
typedef struct eng_prompt_info {
    const int32_t *tokens;
    int32_t n;
    const float *logprobs;  /* n entries, or NULL when not asked */
    const eng_logprob *top; /* n x n_top, or NULL */
    int32_t n_top;
} eng_prompt_info;

/* How one choice ended (eng_request.on_choice_done). */
typedef struct eng_choice_end {
    int32_t choice;
    eng_finish why;
    int32_t generated_tokens;
    /* with logprobs: its tokens' logprobs summed in float64 (the ending EOS's too); else 0 */
    double logprob_sum;
} eng_choice_end;

#define ENG_MAX_CHOICES 64 /* choices one request may ask for (each needs a running slot) */

/* A generation request. The engine copies what it needs at submit. The
 * callbacks run on the engine thread between steps: they must be quick
 * and must not call back into the engine (the server hands them to its
 * loop through uv_async). */
typedef struct eng_request {
    const char *prompt;
    size_t prompt_len;
    /* or, when not NULL, the prompt as token ids, used as they are (no BOS
     * added; each must be in the vocabulary); prompt is then ignored */
    const int32_t *prompt_tokens;
    size_t n_prompt_tokens;
    /* TGI's truncate: > 0 keeps only the prompt's last truncate tokens
     * (after tokenization, BOS included); 0: the whole prompt */
    int32_t truncate;
    /* >= 1; 0 only with prompt_logprobs: the prompt is prefilled and
     * scored, nothing is generated and every choice ends with
     * ENG_FINISH_LENGTH (OpenAI's echo with max_tokens 0) */
    int32_t max_new_tokens;
    /* max_new_tokens is an upper bound: lower it to what the context (and
     * the whole KV cache) leaves after the prompt, as OpenAI's chat
     * completions do when max_tokens is not given */
    bool fill_context;
    /* a rendered chat template: it writes its own special tokens, so no
     * BOS is added (transformers' add_special_tokens=False) */
    bool templated;
    /* n_choices (0 or 1: one; at most ENG_MAX_CHOICES and max_running):
     * answers to one prompt prefilled once, choice i seeded sampling.seed
     * + i. The choices share the prompt's KV blocks (copied on write) and
     * their stop strings; blocks and slots are reserved at admission. */
    int32_t n_choices;
    /* logprobs: each token's log-probability, with top_logprobs
     * (0..ENG_MAX_LOGPROBS) alternatives (eng_token_event) */
    bool logprobs;
    int32_t top_logprobs;
    /* prompt_logprobs: on_prompt gets each prompt token's log-probability
     * and top_logprobs alternatives (OpenAI's echo with logprobs, TGI's
     * decoder_input_details); the prompt is prefilled all the same */
    bool prompt_logprobs;
    /* vLLM's skip_special_tokens: special tokens add no text (they are
     * still reported as tokens) */
    bool skip_special_tokens;
    /* vLLM's include_stop_str_in_output (eng_stop_include) */
    bool include_stop_str;
    eng_sampling sampling;
    eng_spec_request spec; /* speculative decoding for it (speculative.h); zero: the engine's */
    /* constrained decoding: each choice's tokens keep its answer inside this grammar
     * (grammar.h; the engine takes its own reference); NULL: none. A choice whose answer is
     * whole and can go no further ends so. The masks of all choices together take at most
     * gr_vocab_step_budget matcher steps per step: past it every choice ends, grammar */
    gr_grammar *grammar;
    const char *const *stop; /* stop strings, n_stop of them */
    size_t n_stop;
    /* the adapter configuration wanted (none: the base model); the engine
     * takes its own references at submit */
    const eng_lora_term *adapters;
    size_t n_adapters;
    /* once, before any token, when the prompt's tokens are known (after
     * its prefill when prompt_logprobs); may be NULL */
    void (*on_prompt)(void *user, const eng_prompt_info *p);
    /* each token of each choice, and text held back to a choice's end */
    void (*on_token)(void *user, const eng_token_event *ev);
    /* once per choice that began (a request cancelled while waiting or failed before its
     * first token has none), before on_done; may be NULL */
    void (*on_choice_done)(void *user, const eng_choice_end *end);
    /* exactly once per submitted request, after its choices' ends: why is the worst of
     * theirs (error, grammar, cancelled, then the first choice's); usage counts the prompt
     * once and the tokens of every choice */
    void (*on_done)(void *user, eng_finish reason, const eng_usage *usage);
    void *user;
} eng_request;

typedef struct eng_engine_opts {
    size_t kv_bytes;        /* KV cache size; 0: QL_KV_MIB_DEFAULT MiB */
    int32_t block_tokens;   /* KV block; 0: 16 */
    qt_kind kv_dtype;       /* KV values: QT_F32 (the zero value), QT_F16, QT_Q8_0 */
    int32_t step_tokens;    /* token budget of one step; 0: 256 */
    int32_t prefill_chunk;  /* most prompt tokens of one sequence per step; 0: 128 */
    int32_t max_running;    /* sequences decoding together; 0: 64 */
    int32_t max_queued;     /* waiting requests before submit refuses; 0: 256 */
    int32_t max_new_tokens; /* the largest max_new_tokens accepted; 0: 4096 */
    int32_t max_context;    /* prompt plus max_new_tokens at most; 0: the model's */
    int threads;            /* kernel threads; 0: the machine's cores */
    eng_device device;
    bool no_prefix_cache; /* keep no prompt's KV blocks for later requests */
    /* the step budget (step_budget.c), the prompt tokens a step carries beside decode tokens:
     * a target time (0: twice a decode step of the running set), or > 0 tokens; a floor (0: 16) */
    float step_budget_ms;
    int32_t max_prefill_per_step, min_prefill_per_step;
    eng_spec_opts spec; /* speculative decoding (speculative.h); zero: off */
} eng_engine_opts;

typedef struct eng_engine eng_engine;

/* Start the engine thread over a loaded model (borrowed: it must outlive
 * the engine). */
int eng_engine_start(eng_engine **out, const eng_model *m, const eng_engine_opts *o, char *msg,
                     size_t msg_len);
/* Check and queue a request: an empty prompt, invalid UTF-8, a prompt longer than the context or
 * the whole KV cache, prompt plus max_new_tokens past max_context (when set), max_new_tokens out of
 * range, bad sampling parameters, more choices than running slots, a prompt token outside the
 * vocabulary or a full queue (checked first) are refused with the reason (nothing is queued). *id
 * names it for eng_engine_cancel. */
int eng_engine_submit(eng_engine *e, const eng_request *r, uint64_t *id, char *msg, size_t msg_len);
/* Submit in two halves, so that a server prepares off its event loop: _build is the one
 * preparation, on any thread (it reads only fixed state): r checked as submit checks it (but for
 * the queue), its prompt tokenized with BOS or copied, truncated and fitted to the context, into
 * *out (the caller's: eng_built_free; _prompt_tokens says how many it kept); _queue checks only the
 * queue, then takes it (freed when the queue is full or the engine stops: QL_EBUSY). */
typedef struct eng_built eng_built;
int eng_engine_build(const eng_engine *e, const eng_request *r, eng_built **out, char *msg,
                     size_t msg_len);
int eng_engine_queue(eng_engine *e, eng_built *b, uint64_t *id, char *msg, size_t msg_len);
void eng_built_free(eng_built *b);
size_t eng_built_prompt_tokens(const eng_built *b);
/* g's first mask made on the caller's thread (kept in g's shared masks): QL_EINVAL naming the
 * budget when it, or the start each choice makes, takes more than a request may per step. */
int eng_engine_check_grammar(const eng_engine *e, gr_grammar *g, char *msg, size_t msg_len);
/* Publish a new weight version (the engine takes the caller's reference): the engine switches to it
 * between two steps; sequences admitted after run on it, those already running finish on the
 * version they started on. Returns at once; eng_engine_weights tells what serves. */
void eng_engine_publish(eng_engine *e, eng_weights *w);
/* The version new sequences get (the last published), referenced. */
eng_weights *eng_engine_weights(eng_engine *e);
/* Block until every version but the current one has been released (no
 * sequence still runs on an older one) or timeout_s passes; true when so. */
bool eng_engine_wait_versions(eng_engine *e, double timeout_s);

void eng_engine_cancel(eng_engine *e, uint64_t id); /* its on_done says cancelled */
void eng_engine_stop(eng_engine *e);                /* cancel everything, join, free */
/* The step gate: steps < 0 opens it (the start); steps >= 0 lets that many more steps run, then
 * holds the engine between two steps: it still takes in, admits and cancels requests and publishes
 * versions, but runs no step until the gate opens or gets more (the server's /admin/engine/pause;
 * how tests hold a request running or waiting without timing). _settle blocks until the engine has
 * taken in everything and waits, held or idle, its stats published for that state; false when
 * timeout_s passed first. */
void eng_engine_gate(eng_engine *e, int64_t steps);
bool eng_engine_settle(eng_engine *e, double timeout_s);

#define ENG_ADAPTER_LIST_MAX 1024
#define ENG_STEP_BUCKETS     12
extern const double eng_step_bounds[ENG_STEP_BUCKETS];
typedef struct eng_engine_stats {
    int32_t waiting, running;
    int32_t kv_blocks_used, kv_blocks_total, kv_block_tokens;
    qt_kind kv_dtype; /* what the KV cache stores values as (eng_kv_token_bytes) */
    /* a mixture of experts' experts run (per layer) and bytes of their
     * weights read, summed over the steps */
    uint64_t steps, tokens_generated, prompt_tokens, experts_run, expert_bytes;
    uint64_t weights_version;  /* the version new sequences get */
    int32_t weights_versions;  /* versions alive (the current one and older ones still running) */
    uint64_t adapter_requests; /* admitted sequences that applied an adapter unmerged */
    uint64_t kv_blocks_shared, kv_blocks_copied; /* further choices took, copied on write */
    /* the prefix cache: prompt tokens looked up and found; blocks kept */
    uint64_t prefix_queried_tokens, prefix_hit_tokens;
    int32_t states_used, states_total;     /* a hybrid model's recurrent states (0: none) */
    uint64_t grammar_masks, grammar_steps; /* draws under a grammar, their matcher steps, */
    double grammar_seconds;                /* and the time in their masks */
    int32_t prefix_blocks;
    /* the step budget: the last prompt-token budget beside decode tokens, the time it aimed
     * at (0: fixed), the steps' fitted s (fixed + per token), steps that held prompts back */
    int32_t prefill_budget;
    double step_target_s, step_fixed_s, step_token_s;
    uint64_t prefill_held_steps;
    /* steps by wall time: [i] took at most eng_step_bounds[i] s; sum */
    uint64_t step_counts[ENG_STEP_BUCKETS + 1];
    double step_seconds;
    /* the adapters running and waiting requests ask for, each once, comma-
     * separated (what the inference gateway routes on); whole names only:
     * one that does not fit is left out and the list ends with "..." */
    char running_adapters[ENG_ADAPTER_LIST_MAX];
    char waiting_adapters[ENG_ADAPTER_LIST_MAX];
    int64_t gate_steps; /* the step gate: -1 open, else the steps it still lets run */
    bool settled;       /* the engine waits with nothing it can do (eng_engine_settle) */
    eng_spec_stats spec;
} eng_engine_stats;
void eng_engine_stats_get(eng_engine *e, eng_engine_stats *out); /* a snapshot, any thread */
const char *eng_engine_backend(const eng_engine *e);             /* eng_backend_describe's */

/* Whether the backend merges adapters itself (CUDA): a version then needs
 * its merged configuration only, not host copies of the merged tensors. */
bool eng_engine_merges_on_device(const eng_engine *e);
/* Have the backend build its copy of version w now (merging on the device what w's configuration
 * merges), on the engine thread between two steps, and wait for it: costs (n_layers * ENG_N_PROJ
 * entries, or NULL) receives each module's merge figures and *digest eng_backend_digest's digest of
 * what the device will serve. Call before publishing w, so the first step on it does not stall.
 * QL_EINVAL when the backend does not merge. */
int eng_engine_prepare(eng_engine *e, const eng_weights *w, eng_merge_cost *costs, uint64_t *digest,
                       char *msg, size_t msg_len);

#endif

/*
 * gen.h - the generation room (bridge.c), prefix srv_gen_: a generation
 * submitted to the engine for a connection, its choices and parts as the
 * engine's tokens arrive, and srv_gen_shape, what an API sends as they do.
 * Included by the .c files of server/ only. Everything here runs on the loop thread.
 */
#ifndef QL_SERVER_GEN_H
#define QL_SERVER_GEN_H

#include <cjson/cJSON.h>

#include "reasoning.h"
#include "request.h"

/* An API's answer to a generation: what it sends as tokens arrive and when
 * the generation ends. One constant per API and framing, in its file. */
typedef struct srv_gen_shape {
    bool stream;           /* a text/event-stream response, begun at submit */
    const char *id_prefix; /* of the answer's id: "cmpl" when NULL */
    /* The 404 for an adapter that is not loaded: "<noun> NAME<unknown>". */
    const char *adapter_noun, *adapter_unknown;
    /* A token (token >= 0, its logprobs the last entry of the choice's),
     * or text the engine held back to the end (token < 0), has been added
     * to g->choices[choice]; send what this API sends for it. NULL:
     * nothing until the end. */
    void (*on_token)(srv_gen *g, srv_conn *c, int32_t choice, int32_t token, const char *text,
                     size_t len);
    /* A stream's end (every choice, every prompt): send what this API
     * sends last and end c's response. why is the worst of the prompts'
     * finishes; u sums them. */
    void (*on_done)(srv_gen *g, srv_conn *c, eng_finish why, const eng_usage *u);
    /* A whole answer's JSON (a new tree, the caller's; NULL when memory is
     * short) for g, whose every choice has ended; u sums the prompts' usage.
     * bridge.c answers with it (or a 500 when the engine failed), building
     * it on the loop or, when large, on a pool thread: so it reads only g
     * (its choices, parts and answer state), and of the server only what
     * does not change while it serves (the tokenizer, started_at), never
     * a connection, the metrics or anything else of the loop's. */
    cJSON *(*whole)(const srv_gen *g, const eng_usage *u);
} srv_gen_shape;

/* Check readiness, the adapter and the limits, then submit a for c, to be
 * answered in shape; or answer the refusal. Prompts given as text are
 * tokenized on the thread pool first (a megabyte of text must not hold the
 * loop), so the answer may begin after this returns; a is copied as
 * needed and is the caller's again on return, but for a->answer, which
 * it takes. */
void srv_gen_submit(srv_conn *c, srv_req_ask *a, const srv_gen_shape *shape);

/* A prompt made off the loop: make runs on a pool thread, handed the
 * request's adapter (NULL: the base model; borrowed for the call, already
 * acquired: make never looks it up), and sets *prompt (malloc'd, the
 * caller's) or returns a QL_E* code with the whole sentence in msg; drop
 * frees arg, on the loop, once, whether or not make ran. */
typedef struct srv_gen_prompt_maker {
    int (*make)(void *arg, const eng_lora *adapter, char **prompt, char *msg, size_t msg_len);
    void (*drop)(void *arg);
    void *arg;
} srv_gen_prompt_maker;
/* srv_gen_submit for the one prompt maker makes (a chat template rendered),
 * tokenized as a's templated says; a's prompt fields are not read. maker
 * is the callee's from here on. */
void srv_gen_submit_made(srv_conn *c, srv_req_ask *a, const srv_gen_shape *shape,
                         srv_gen_prompt_maker maker);
/* The loaded adapter called name, for work that is not a generation
 * (/chat_tokenize's template): a reference (eng_lora_unref), or NULL when
 * name is NULL or names none loaded. Any thread. */
eng_lora *srv_gen_adapter_loaded(const srv_server *s, const char *name);
/* Whether c may be answered with a generation now (not draining, the model
 * loaded); else the 503 has been answered. */
bool srv_gen_ready(srv_conn *c);

/* One choice of a generation: its text and tokens as they arrive, with
 * their logprobs when asked, and how it ended. */
typedef struct srv_gen_choice {
    char *text; /* everything generated so far, NUL-terminated */
    size_t text_len, text_cap;
    size_t tail_len;   /* of that, the text the engine held back to the end */
    int32_t *tokens;   /* token ids */
    char **pieces;     /* the text each token completed */
    size_t *offsets;   /* characters of text before each token's piece */
    size_t text_chars; /* characters of text */
    float *logprobs;   /* when asked: each token's */
    eng_logprob *top;  /* n_tokens x the gen's top_n */
    size_t n_tokens, cap_tokens;
    bool ended, opened; /* opened: an API's first event for it has gone out */
    eng_finish why;
    int32_t generated;
    double logprob_sum;
    uint64_t seed;
    /* with g->reasoning: where the text's reasoning and content lie, kept
     * up to date as it grows (final once done, or at its end), and how
     * much of each a stream has sent (bytes from reason.reason_from, and
     * from reason.content_from) */
    srv_reason_view reason;
    size_t reason_sent, content_sent;
} srv_gen_choice;

/* One prompt of a generation: one engine request, and the prompt as the
 * model saw it (from its on_prompt). */
typedef struct srv_gen_part {
    srv_gen *g;
    int32_t index;
    uint64_t id; /* the engine's */
    bool done;
    char *text; /* the prompt's text (kept for echo; decoded when given as ids) */
    int32_t *tokens;
    float *logprobs;  /* when asked: n_tokens, the first NaN */
    eng_logprob *top; /* n_tokens x the gen's top_n */
    int32_t n_tokens;
} srv_gen_part;

/* One generation request, from submit to its engines' on_done. Lives on the
 * loop; conn is NULL once the client has gone (the generation is then
 * cancelled and only waits for its on_done). */
struct srv_gen {
    srv_server *s;
    srv_conn *conn;
    const srv_gen_shape *shape;
    srv_gen_part *parts; /* one per prompt */
    int32_t n_parts, parts_done;
    srv_gen_choice *choices;           /* n_parts x per_part, prompt-major */
    int32_t n_choices, per_part, keep; /* keep: answered per prompt (n) */
    int32_t top_n;                     /* alternatives kept per token */
    bool logprobs, prompt_logprobs;
    bool details;
    bool include_usage;
    bool return_full_text;
    bool reasoning;    /* the text is split into reasoning and content (srv_req_ask's) */
    bool reason_opens; /* the model's text begins inside its reasoning */
    uint64_t seed;
    bool sampled;
    eng_finish why;  /* the worst so far */
    eng_usage usage; /* summed over the prompts */
    char model_id[160];
    char oai_id[48];
    char grammar_where[128]; /* the field its grammar came from (srv_req_ask's) */
    double t_start, t_last;
    bool first_seen;
    /* the API's own state for the answer (srv_req_ask.answer), dropped with g */
    void *answer;
    void (*answer_drop)(void *answer);
    size_t cost;        /* what it counts in s->held_bytes (bridge.c's request_cost) */
    srv_gen *next_live; /* the server's list of live generations */
    srv_gen *prev_live;
};

/* Cancel every request of g that has not ended (its connection still
 * hears the end, as cancelled). */
void srv_gen_cancel(srv_gen *g);
/* The choices to answer with, in order (prompt-major): for each prompt the
 * keep best of its per_part by summed logprob (all, in order, when
 * per_part == keep). Fills idx (n_parts x keep entries); returns the count. */
int32_t srv_gen_answer_order(const srv_gen *g, int32_t *idx);
/* The text to answer choice i with: the prompt first when
 * return_full_text (allocated, free(); *len bytes, NUL bytes possible). */
char *srv_gen_full_text(const srv_gen *g, int32_t i, size_t *len);
/* Choice i's content (its text less the reasoning, with g->reasoning; all
 * of it without): a pointer into its text, *len bytes (0 while a
 * stream's reasoning has not ended). And its reasoning (*len 0: none). */
const char *srv_gen_content(const srv_gen *g, int32_t i, size_t *len);
const char *srv_gen_reasoning(const srv_gen *g, int32_t i, size_t *len);
/* How many of choice i's tokens are its reasoning's (they begin before its
 * content does; 0 without g->reasoning). */
int32_t srv_gen_reasoning_tokens(const srv_gen *g, int32_t i);

/* The loop's side of the bridge (s->wake's callback): hand every event the
 * engine queued to its generation; a generation's last one frees it. */
void srv_gen_on_wake(uv_async_t *a);
/* The hooks' on_conn_end: c's generation is cancelled (a disconnect) and
 * forgets c; its admin work finishes unheard. */
void srv_gen_conn_gone(srv_conn *c);

#endif

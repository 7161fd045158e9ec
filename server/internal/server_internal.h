/*
 * server_internal.h - what the files of server/ share and nobody else may
 * use. Included as "internal/server_internal.h" by the .c files of server/
 * only.
 *
 * The files are layered, bottom up, and each calls only files below it:
 *   http.c       connections and responses; knows nothing above it
 *   metrics.c    counters, histograms, Prometheus text
 *   request.c    the request helpers: body, field readers, errors, statuses
 *   bridge.c     generations through the engine, work on the thread pool
 *   logprobs.c   a generation's logprobs in OpenAI's shapes, token texts
 *   tool_calls.c tool calls parsed out of a model's text (internal/tool_calls.h)
 *   chat_tools.c chat's tools and tool_choice, tool calls in OpenAI's shapes
 *   api_tgi.c, api_openai.c, admin.c    the route handlers
 *   routes.c     the route table (srv_route)
 *   serve.c      setup, model load, signals, drain; wires the hooks
 * Where a lower file must reach a higher one (a request is complete, a
 * connection ends, something ended that a drain waits on) it calls through
 * the server's srv_hooks, which serve.c sets, as libuv hands a handle its
 * callbacks.
 *
 * Every function here runs on the loop thread, except a srv_work's run.
 */
#ifndef QL_SERVER_INTERNAL_H
#define QL_SERVER_INTERNAL_H

#include <cjson/cJSON.h>

#include "server.h"

/* --- the hooks (set by serve.c, called from below) ------------------------------ */

/* What the lower files ask of the files above them. One constant table in
 * serve.c; s->hooks points at it from srv_serve or srv_conn_init_detached
 * on. */
typedef struct srv_hooks {
    /* c->req is complete: answer it (routes.c's srv_route). */
    void (*on_request)(srv_conn *c);
    /* c is ending (closed, aborted or released): whatever waits to answer
     * it lets go of it (bridge.c's srv_conn_gone). */
    void (*on_conn_end)(srv_conn *c);
    /* A connection, generation or piece of work has ended: when the server
     * drains and nothing is left, close everything (serve.c). */
    void (*check_drained)(srv_server *s);
} srv_hooks;

/* --- metrics (metrics.c) ----------------------------------------------------- */

void srv_hist_observe(srv_hist *h, double seconds);
/* The Prometheus text exposition of everything (allocated, free()). */
char *srv_metrics_render(const srv_server *s, size_t *len);

/* --- connections and responses (http.c) ------------------------------------- */

/* Start listening on host:port (port 0: any free one, *bound_port says). */
int srv_listen(srv_server *s, const char *host, int port, int *bound_port, char *msg,
               size_t msg_len);
/* Stop accepting; close idle connections (those between requests). */
void srv_stop_accepting(srv_server *s);

/* Responses. Each ends the request unless it begins a stream. */
void srv_respond(srv_conn *c, int status, const char *content_type, const char *body, size_t len,
                 const char *extra_headers);
void srv_respond_json(srv_conn *c, int status, const char *json);
/* The same, taking json (malloc'd; freed here, whatever happens): written
 * without a copy, for large answers. */
void srv_respond_json_owned(srv_conn *c, int status, char *json);
/* Hand the heap's free memory back to the system soon (malloc_trim, once,
 * on the pool): after a large answer is freed, written or not. */
void srv_trim_soon(srv_server *s);
/* A response without a body (a 204: no Content-Type, no Content-Length). */
void srv_respond_empty(srv_conn *c, int status, const char *extra_headers);
/* What Access-Control-Allow-Origin says to c's request: its Origin when
 * that is listed in --cors-allow-origin (exact match), "*" when the list
 * holds *, NULL when there is no Origin, no list, or the origin is not in
 * it. Every response to a non-NULL one carries it; while the list is set,
 * every response carries Vary: Origin. Points
 * into c->req or the config; lives until the response ends. */
const char *srv_cors_origin(const srv_conn *c);
/* {"error": {"type": ..., "message": ...}} with status. */
void srv_respond_error(srv_conn *c, int status, const char *type, const char *message,
                       const char *extra_headers);
/* Begin a text/event-stream response; srv_stream_event sends one event
 * (the data line), srv_stream_end ends the response. */
void srv_stream_begin(srv_conn *c);
void srv_stream_event(srv_conn *c, const char *data, size_t len);
void srv_stream_end(srv_conn *c);
/* How many bytes wait in c's write queue (slow clients). */
size_t srv_conn_backlog(const srv_conn *c);
/* Close c once what was written has gone out (after a response that
 * ends the connection). */
void srv_conn_close(srv_conn *c);
/* Close c at once, dropping unsent bytes (the client has gone, or does not
 * read). */
void srv_conn_abort(srv_conn *c);
/* Ready c, allocated by the caller with sink set, as a connection without
 * a socket; srv_conn_init_detached (serve.c) is this plus the hooks. */
void srv_conn_init_sink(srv_server *s, srv_conn *c);

/* --- request helpers (request.c) ---------------------------------------------- */

/* The HTTP status an error code of base/ql_base.h stands for. */
int srv_status_of(int rc);
/* Answer {"error"} with status (a 503 adds Retry-After) and the message. */
void srv_fail(srv_conn *c, int status, const char *fmt, ...) __attribute__((format(printf, 3, 4)));
/* Answer root (consumed) as JSON with status. */
void srv_respond_cjson(srv_conn *c, int status, cJSON *root);
/* A JSON string of text[0..len) (UTF-8), NUL bytes included (as \u0000:
 * a cJSON string alone would end at the first). */
cJSON *srv_json_text(const char *text, size_t len);
/* Send o (consumed) as one server-sent event. */
void srv_stream_cjson(srv_conn *c, cJSON *o);

/* The body as a JSON object (the caller's to cJSON_Delete), or a 400 and
 * NULL. */
cJSON *srv_body_object(srv_conn *c);
/* Refuse (400) members of obj not named in allowed (NULL-terminated);
 * where names obj in the message. */
bool srv_only_known(srv_conn *c, const cJSON *obj, const char *where, const char *const *allowed);
/* Absent or JSON null. */
bool srv_is_null(const cJSON *v);
/* The field readers: an absent or null field leaves *out as it is (and
 * *present false); a field of the wrong type or out of [lo, hi] is a 400
 * naming it, and false. Strings point into obj. */
bool srv_get_number(srv_conn *c, const cJSON *obj, const char *name, double lo, double hi,
                    double *out, bool *present);
bool srv_get_int(srv_conn *c, const cJSON *obj, const char *name, double lo, double hi,
                 int64_t *out, bool *present);
bool srv_get_bool(srv_conn *c, const cJSON *obj, const char *name, bool *out);
bool srv_get_string(srv_conn *c, const cJSON *obj, const char *name, const char **out);

/* Which weights serve, for /admin/state and /info: weights_version,
 * weights_digest (hex) and merged ([{"name", "scale"}]) added to o. Two
 * replicas of one model with equal digests answer alike. */
void srv_add_weights_identity(cJSON *o, const lora_state *st);
/* 1 to 127 letters, digits, '-', '_' and '.': what an adapter may be named
 * (so a name is a label value and a folder name as it stands). */
bool srv_is_adapter_name(const char *name);

/* --- generations: what an API asks (request.c reads it) ------------------------ */

/* Stop strings of one request (OpenAI allows 4; the engine's bounds,
 * ENG_STOP_MAX_*, hold besides: bytes per string and in all). */
#define SRV_MAX_STOPS 8
/* Prompt logprobs (echo with logprobs, decoder_input_details) score every
 * prompt token over the whole vocabulary: the engine's time grows with the
 * tokens scored (8 prompts of 1000 ids took 59 s of a CPU engine) and the
 * answer with tokens x (1 + alternatives) entries (about 40 bytes of JSON
 * each). Per request, summed over its prompts: at most 4096 tokens (a
 * 4k-context model's whole window), and 32768 entries (a 1.3 MB answer). */
#define SRV_MAX_PROMPT_LOGPROB_TOKENS  4096
#define SRV_MAX_PROMPT_LOGPROB_ENTRIES 32768
/* echo (TGI's return_full_text) repeats a prompt's text in each of its
 * choices' answers: at most 16 MiB of prompt text in one answer (64
 * choices of a 256 KiB prompt), where a megabyte prompt with n 64 made 64
 * MB before JSON's escapes. */
#define SRV_MAX_ECHO_BYTES ((size_t)16 << 20)
/* Tools of one chat request: OpenAI's documented limit. Each is rendered
 * by the template and, with tool_choice "required", joins the grammar. */
#define SRV_MAX_TOOLS 128
/* Prompts in one OpenAI completions request, and choices of one request
 * in all (prompts x best_of): each choice takes a running slot. */
#define SRV_MAX_PROMPTS 64
#define SRV_MAX_CHOICES 64
/* TGI's limits, as /info reports them: candidates of best_of, and
 * alternatives of top_n_tokens. */
#define SRV_TGI_MAX_BEST_OF 8
#define SRV_TGI_MAX_TOP_N   ENG_MAX_LOGPROBS

/* One prompt: text, or token ids (OpenAI's list forms). */
typedef struct srv_prompt_in {
    const char *text;
    const int32_t *tokens; /* when not NULL, n_tokens ids (no BOS added) */
    size_t n_tokens;
} srv_prompt_in;

/* What a generation request asks for, whatever its API. Strings point
 * into the parsed body, which outlives srv_generate; token ids into
 * token_store (srv_ask_free). */
typedef struct srv_ask {
    const char *prompt; /* the one prompt, when n_prompts is 0 */
    srv_prompt_in prompts[SRV_MAX_PROMPTS];
    size_t n_prompts;
    int32_t *token_store; /* owned */
    int64_t max_new_tokens;
    eng_sampling sampling;
    const char *stops[SRV_MAX_STOPS];
    size_t n_stops;
    /* what sampling.logit_bias points at (srv_get_sampling fills it) */
    eng_logit_bias logit_bias[ENG_MAX_LOGIT_BIAS];
    const char *adapter; /* NULL: the base model */
    double adapter_scale;
    bool has_scale;
    bool details, include_usage, return_full_text;
    bool fill_context; /* max_new_tokens is a bound: fit it to the context */
    bool templated;    /* prompt is a rendered chat template (no BOS added) */
    /* n answers per prompt, the best n of best_of by summed logprob (0:
     * n; best_of > n needs a whole answer) */
    int32_t n, best_of;
    /* each token's logprob with top_logprobs alternatives; the prompt's
     * too (echo with logprobs, decoder_input_details) */
    bool logprobs, prompt_logprobs;
    int32_t top_logprobs;
    /* the API's name for asking for prompt logprobs (a literal), for the
     * 400 past SRV_MAX_PROMPT_LOGPROB_*; NULL: "prompt logprobs" */
    const char *prompt_logprobs_field;
    int32_t truncate;      /* TGI's: keep the prompt's last tokens; 0: all */
    bool keep_special;     /* skip_special_tokens false */
    bool include_stop_str; /* vLLM's include_stop_str_in_output */
    /* constrained decoding: the answer kept inside a grammar of
     * grammar_kind written as grammar_text (malloc'd, owned:
     * srv_ask_free; NULL: none), compiled off the loop through the
     * server's cache; a compile error is a 400 that begins with
     * grammar_where (the field it came from) */
    char *grammar_text;
    gr_kind grammar_kind;
    char grammar_where[128];
    /* what the API keeps for its answer beyond its shape (chat's tool
     * calls), owned: srv_generate takes it (clearing these) and hands it
     * to the generation (g->answer), which calls answer_drop on it when
     * freed, or drops it at once when refused; srv_ask_free drops one
     * never handed over. */
    void *answer;
    void (*answer_drop)(void *answer);
} srv_ask;

/* Free what a owns (its token ids, its grammar's text, its answer state). */
void srv_ask_free(srv_ask *a);
/* Constrain a's answer to a grammar of kind from text[0..len) (copied),
 * where naming the field in a compile error; false after answering: a
 * 400 naming both fields when a already has one (one grammar per
 * request), 503 when memory is short. */
bool srv_ask_grammar(srv_conn *c, srv_ask *a, gr_kind kind, const char *text, size_t len,
                     const char *where);

/* "stop" (name): a string or an array of non-empty strings, into a. */
bool srv_get_stops(srv_conn *c, const cJSON *obj, const char *name, srv_ask *a);
/* The sampling fields both APIs share, from p (NULL: none given); TGI
 * samples greedily unless asked otherwise (greedy_default). Reads
 * frequency_penalty for both, and presence_penalty, logit_bias, min_tokens
 * and ignore_eos wherever the API's field list lets them through (OpenAI's
 * routes); a->max_new_tokens must be read first (min_tokens may not pass
 * it). */
bool srv_get_sampling(srv_conn *c, const cJSON *p, srv_ask *a, bool greedy_default);

/* A constrained answer asked by obj's field name (label: what messages
 * call it, "parameters.grammar"), into a (srv_ask_grammar):
 * OpenAI's response_format ({"type": "text"}: none; "json_object": any
 * object; "json_schema" with json_schema.schema, none meaning any JSON
 * value) and TGI's grammar ({"type": "json" or "json_object", "value": a
 * schema, as an object or a JSON string}, {"type": "regex", "value": RE},
 * {"type": "json_schema", "value": {"name", "schema"}}); each route
 * takes both. Absent or null: none. False after answering the 400. */
bool srv_get_grammar(srv_conn *c, const cJSON *obj, const char *name, const char *label,
                     srv_ask *a);
/* vLLM's guided decoding fields of a chat or completions body into a:
 * guided_json (a schema, or its JSON text), guided_regex, guided_choice
 * (the answer is one of the strings), or the same under newer vLLM's
 * structured_outputs {json, regex, choice}; guided_grammar (EBNF) is
 * refused by name, and so is a second grammar (response_format too). */
bool srv_get_guided(srv_conn *c, const cJSON *root, srv_ask *a);
/* The body fields srv_get_guided reads, for a route's list of known ones. */
#define SRV_GUIDED_FIELDS                                                                          \
    "guided_json", "guided_regex", "guided_choice", "guided_grammar", "structured_outputs"
/* A JSON Schema given as a value (NULL: out of memory) as a's grammar. */
bool srv_ask_schema(srv_conn *c, srv_ask *a, const cJSON *schema, const char *where);

/* vLLM's output fields both OpenAI routes take: skip_special_tokens
 * (default true) and include_stop_str_in_output (default false). */
bool srv_get_vllm_output(srv_conn *c, const cJSON *root, srv_ask *a);

/* An API's answer to a generation: what it sends as tokens arrive and when
 * the generation ends. One constant per API and framing, in its file. */
typedef struct srv_shape {
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
} srv_shape;

/* The adapter an OpenAI-shaped request's "model" names (request.c): NULL
 * for the base model (no name, the base model's id, or "tgi" or "dummy",
 * the placeholders TGI's clients send to a server's URL), else the name. */
const char *srv_adapter_named(const srv_conn *c, const char *model);
/* The 404's tail for a "model" that is neither (srv_shape.adapter_unknown). */
#define SRV_UNKNOWN_MODEL ": neither the base model nor a loaded adapter"

/* A whole (not streamed) answer (request.c): o (consumed), or a 500 when the engine
 * failed the request (o may then be NULL) or o is NULL (memory was short). */
void srv_respond_generation(srv_conn *c, cJSON *o, eng_finish why);
/* A stream's failure after its 200 was sent (request.c): one event with the body
 * srv_fail would have answered, {"error": {"type", "message", "code": status}}, which the
 * OpenAI SDK and huggingface_hub raise as an error; the caller then ends the stream. */
void srv_stream_error(srv_conn *c, int status, const char *message);

/* --- generations and work off the loop (bridge.c) ---------------------------- */

/* Check readiness, the adapter and the limits, then submit a for c, to be
 * answered in shape; or answer the refusal. Prompts given as text are
 * tokenized on the thread pool first (a megabyte of text must not hold the
 * loop), so the answer may begin after this returns; a is copied as
 * needed and is the caller's again on return, but for a->answer, which
 * it takes. */
void srv_generate(srv_conn *c, srv_ask *a, const srv_shape *shape);

/* A prompt made off the loop: make runs on a pool thread and sets *prompt
 * (malloc'd, the caller's) or returns a QL_E* code with the whole sentence
 * in msg; drop frees arg, on the loop, once, whether or not make ran. */
typedef struct srv_prompt_maker {
    int (*make)(void *arg, char **prompt, char *msg, size_t msg_len);
    void (*drop)(void *arg);
    void *arg;
} srv_prompt_maker;
/* srv_generate for the one prompt maker makes (a chat template rendered),
 * tokenized as a's templated says; a's prompt fields are not read. maker
 * is the callee's from here on. */
void srv_generate_made(srv_conn *c, srv_ask *a, const srv_shape *shape, srv_prompt_maker maker);
/* Whether c may be answered with a generation now (not draining, the model
 * loaded); else the 503 has been answered. */
bool srv_ready(srv_conn *c);

/* One choice of a generation: its text and tokens as they arrive, with
 * their logprobs when asked, and how it ended. */
typedef struct srv_choice {
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
} srv_choice;

/* One prompt of a generation: one engine request, and the prompt as the
 * model saw it (from its on_prompt). */
typedef struct srv_part {
    srv_gen *g;
    int32_t index;
    uint64_t id; /* the engine's */
    bool done;
    char *text; /* the prompt's text (kept for echo; decoded when given as ids) */
    int32_t *tokens;
    float *logprobs;  /* when asked: n_tokens, the first NaN */
    eng_logprob *top; /* n_tokens x the gen's top_n */
    int32_t n_tokens;
} srv_part;

/* One generation request, from submit to its engines' on_done. Lives on the
 * loop; conn is NULL once the client has gone (the generation is then
 * cancelled and only waits for its on_done). */
struct srv_gen {
    srv_server *s;
    srv_conn *conn;
    const srv_shape *shape;
    srv_part *parts; /* one per prompt */
    int32_t n_parts, parts_done;
    srv_choice *choices;               /* n_parts x per_part, prompt-major */
    int32_t n_choices, per_part, keep; /* keep: answered per prompt (n) */
    int32_t top_n;                     /* alternatives kept per token */
    bool logprobs, prompt_logprobs;
    bool details;
    bool include_usage;
    bool return_full_text;
    uint64_t seed;
    bool sampled;
    eng_finish why;  /* the worst so far */
    eng_usage usage; /* summed over the prompts */
    char model_id[160];
    char oai_id[48];
    char grammar_where[128]; /* the field its grammar came from (srv_ask's) */
    double t_start, t_last;
    bool first_seen;
    /* the API's own state for the answer (srv_ask.answer), dropped with g */
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

/* The loop's side of the bridge (s->wake's callback): hand every event the
 * engine queued to its generation; a generation's last one frees it. */
void srv_bridge_on_wake(uv_async_t *a);
/* The hooks' on_conn_end: c's generation is cancelled (a disconnect) and
 * forgets c; its admin work finishes unheard. */
void srv_conn_gone(srv_conn *c);

/* Work off the loop (uv thread pool) with a completion on the loop. */
typedef struct srv_work {
    uv_work_t req;
    srv_server *s;
    srv_conn *conn;                   /* NULL once the client has gone */
    void (*run)(struct srv_work *w);  /* on a pool thread */
    void (*done)(struct srv_work *w); /* on the loop */
    int rc;
    char msg[1024];
    char name[160];
    char path[4096];
    float scale;
    bool safe_merge;
    qt_kind into;
    bool has_report;
    lora_report report;
    lora_meta meta;
    /* the answer's status when not srv_status_of(rc) (0: that) */
    int status;
    /* what other work carries (its run and done know the type; done frees it) */
    void *job;
} srv_work;
/* Queue w (calloc'd by the caller) on the pool: 0, and w is freed after
 * its done has run; or uv_queue_work's error, and w is still the
 * caller's. */
int srv_work_start(srv_work *w);
/* A srv_work for c carrying job, started: 0; or -1 after answering c
 * (503), job still the caller's. done must free job. */
int srv_work_begin(srv_conn *c, void *job, void (*run)(srv_work *w), void (*done)(srv_work *w));

/* --- logprobs in the APIs' shapes (logprobs.c) --------------------------------- */

/* How a token shows in logprobs: its own decoding when whole UTF-8, else
 * "bytes:\xNN..." (allocated, free()); *bytes (when not NULL) a JSON list
 * of its raw bytes. */
char *srv_token_text(const tok_tokenizer *t, int32_t id, cJSON **bytes);
/* Completions' logprobs of choice i's tokens [from, to), the prompt's
 * first when echo. */
cJSON *srv_oai_logprobs(const srv_gen *g, int32_t i, size_t from, size_t to, bool echo);
/* Chat's logprobs ({"content", "refusal"}) of choice i's tokens [from, to). */
cJSON *srv_chat_logprobs(const srv_gen *g, int32_t i, size_t from, size_t to);

/* --- the route handlers (api_tgi.c, api_openai.c, admin.c) --------------------- */

/* What a route does with c's request. name is what the {name} in the
 * route's path matched (NULL for a path without one); it lives until the
 * handler returns. */
typedef void srv_handler(srv_conn *c, const char *name);

srv_handler srv_tgi_generate;        /* POST /generate */
srv_handler srv_tgi_generate_stream; /* POST /generate_stream */
srv_handler srv_tgi_info;            /* GET /info */
srv_handler srv_tgi_compat;          /* POST / (TGI's compat route) */
srv_handler srv_tgi_tokenize;        /* POST /tokenize */
/* What a token list answers (srv_tokenize_spans): BOS when add_special
 * and the tokenizer adds one; only the last keep_last tokens (0: all); and
 * at most max_tokens of them (the context length: srv_context_tokens), or
 * a 400 naming field (the request's field that holds the text) and the
 * bound, mentioning "truncate" when can_truncate. */
typedef struct srv_token_list {
    bool add_special;
    size_t keep_last, max_tokens;
    const char *field;
    bool can_truncate;
} srv_token_list;
/* text[0..len) tokenized as the engine tokenizes a prompt (special tokens
 * in the text parsed), as TGI's token list: [{"id", "text", "start",
 * "stop"}] with byte offsets into text (api_tgi.c says how they are
 * found), into *out (the caller's to cJSON_Delete). On error a QL_E*
 * code, msg, and *out NULL. For /tokenize, and for /chat_tokenize's
 * "tokenize_response". */
int srv_tokenize_spans(const tok_tokenizer *t, const char *text, size_t len,
                       const srv_token_list *want, cJSON **out, char *msg, size_t msg_len);
/* The most tokens a sequence may hold: the model's context length, or
 * --max-context when smaller (a loaded model's). */
int64_t srv_context_tokens(const srv_server *s);

srv_handler srv_oai_completions; /* POST /v1/completions */
srv_handler srv_oai_models;      /* GET /v1/models */
/* What OpenAI's two generation APIs share (api_openai.c, used by
 * api_chat.c): the finish_reason of an engine finish, the usage object
 * added to o, the stream's last usage chunk (chunk emptied of choices,
 * then sent), and stream_options.include_usage read into a. */
const char *srv_oai_finish(eng_finish f);
void srv_oai_add_usage(cJSON *o, const eng_usage *u);
void srv_oai_usage_chunk(srv_conn *c, cJSON *chunk, const eng_usage *u);
bool srv_oai_stream_options(srv_conn *c, const cJSON *root, srv_ask *a);

/* --- tools on chat completions (chat_tools.c) ---------------------------------- */

/* What a chat request's tools ask of its answer (chat_tools.c says how its
 * text becomes tool calls); held by the generation as g->answer. */
typedef struct srv_chat_tools srv_chat_tools;

/* Read root's "tools", "tool_choice" and "parallel_tool_calls": checked (a
 * 400 naming the field), and, when the answer may carry tool calls, a
 * srv_chat_tools put in a->answer; for "required" or a named function the
 * calls' grammar in a too (read response_format first: the two together
 * are refused). False after answering. */
bool srv_chat_tools_read(srv_conn *c, const cJSON *root, srv_ask *a);
/* copy, the template's copy of messages[i]: an assistant's tool_calls
 * checked and their arguments (JSON text) parsed into objects, as
 * templates read them. False after answering the 400. */
bool srv_chat_tools_message_in(srv_conn *c, cJSON *copy, int i);
/* Choice i of g (whose g->answer is a srv_chat_tools) as a whole message:
 * content and tool_calls added to message, *finish (srv_oai_finish's) set
 * to "tool_calls" when calls were made and the answer ended by itself. */
void srv_chat_tools_answer(const srv_gen *g, int32_t i, cJSON *message, const char **finish);
/* Choice i's stream: the deltas to send now (a new list of delta objects,
 * possibly empty, the caller's), content held back while it may be the
 * start of a call; at its end (end true), what is left and the calls,
 * and *finish as srv_chat_tools_answer sets it. */
cJSON *srv_chat_tools_stream(srv_gen *g, int32_t i, bool end, const char **finish);

/* --- chat completions (api_chat.c) ------------------------------------------- */

srv_handler srv_oai_chat;      /* POST /v1/chat/completions */
srv_handler srv_chat_tokenize; /* POST /chat_tokenize (TGI's) */
/* Compile the loaded model's chat templates (a refused one is logged and
 * answers chat requests with its reason) and keep its BOS/EOS text; free
 * them. Called by serve.c around the model's life. */
void srv_chat_templates_load(srv_server *s);
void srv_chat_templates_free(srv_server *s);

/* Whether c may use the admin routes (every path under /admin/, a route or
 * not): the bearer token in force (srv_admin_token), or without one a
 * loopback client whose request a web page cannot have sent (for a change:
 * no foreign Origin, Content-Type: application/json but for DELETE), and
 * a registry to work on; otherwise answered (401, 403 naming the reason,
 * 503). */
bool srv_admin_gate(srv_conn *c);
/* The admin token in force: the configured one, else the one serve.c
 * generated (s->generated_token); NULL: none. */
const char *srv_admin_token(const srv_server *s);
/* Whether the Host rule guards every route (routes.c): while --host is
 * loopback, no admin token is in force, or --allowed-hosts is set. */
bool srv_host_rule_applies(const srv_server *s);
/* Whether c's Host is the server's: absent (no browser omits it),
 * localhost, a 127.x.x.x literal or [::1] with the server's port or none,
 * or listed in --allowed-hosts; otherwise answered 403 naming the Host. */
bool srv_host_allowed(srv_conn *c);
/* Whether addr is an IP literal in 127.0.0.0/8 or ::1 (--host, a Host's
 * name). */
bool srv_is_loopback_address(const char *addr);
srv_handler srv_admin_state;   /* GET /admin/state */
srv_handler srv_admin_list;    /* GET /admin/adapters */
srv_handler srv_admin_load;    /* POST /admin/adapters */
srv_handler srv_admin_unload;  /* DELETE /admin/adapters/{name} */
srv_handler srv_admin_merge;   /* POST /admin/adapters/{name}/merge */
srv_handler srv_admin_unmerge; /* POST /admin/adapters/{name}/unmerge */
srv_handler srv_admin_engine;  /* GET /admin/engine: the step gate and what runs */
srv_handler srv_admin_pause;   /* POST /admin/engine/pause {"after_steps": N} */
srv_handler srv_admin_resume;  /* POST /admin/engine/resume */

/* --- routes (routes.c) ------------------------------------------------------- */

/* Answer c's complete request (c->req): a Host not the server's with 403
 * while the Host rule applies (srv_host_rule_applies; not the health
 * checks); a CORS preflight
 * from a listed origin with 204; without the API key (when one is configured; not for
 * /health, GET / or the admin routes, which have their own token) 401;
 * else the route table's row for its path and method, 405 when the path
 * has rows but not for the method, 404 when it has none. The hooks'
 * on_request. */
void srv_route(srv_conn *c);

#endif

/*
 * request.h - the request-reading room (request.c), prefix srv_req_: the
 * helpers every route shares (the body as JSON, field readers, errors and
 * the status each error code maps to), and srv_req_ask, what a generation
 * request asks for whatever its API, with the readers of the fields the
 * APIs share. Included by the .c files of server/ only. Runs on the loop thread.
 */
#ifndef QL_SERVER_REQUEST_H
#define QL_SERVER_REQUEST_H

#include <cjson/cJSON.h>

#include "server.h"

/* The HTTP status an error code of base/ql_base.h stands for. */
int srv_req_status_of(int rc);
/* Answer {"error"} with status (a 503 adds Retry-After) and the message. */
void srv_req_fail(srv_conn *c, int status, const char *fmt, ...)
    __attribute__((format(printf, 3, 4)));
/* Answer root (consumed) as JSON with status. */
void srv_req_respond_cjson(srv_conn *c, int status, cJSON *root);
/* A JSON string of text[0..len) (UTF-8), NUL bytes included (as \u0000:
 * a cJSON string alone would end at the first). */
cJSON *srv_req_json_text(const char *text, size_t len);
/* Send o (consumed) as one server-sent event. */
void srv_req_stream_cjson(srv_conn *c, cJSON *o);

/* The body as a JSON object (the caller's to cJSON_Delete), or a 400 and
 * NULL. */
cJSON *srv_req_body_object(srv_conn *c);
/* Refuse (400) members of obj not named in allowed (NULL-terminated);
 * where names obj in the message. */
bool srv_req_only_known(srv_conn *c, const cJSON *obj, const char *where,
                        const char *const *allowed);
/* Absent or JSON null. */
bool srv_req_is_null(const cJSON *v);
/* The field readers: an absent or null field leaves *out as it is (and
 * *present false); a field of the wrong type or out of [lo, hi] is a 400
 * naming it, and false. Strings point into obj. */
bool srv_req_get_number(srv_conn *c, const cJSON *obj, const char *name, double lo, double hi,
                        double *out, bool *present);
bool srv_req_get_int(srv_conn *c, const cJSON *obj, const char *name, double lo, double hi,
                     int64_t *out, bool *present);
bool srv_req_get_bool(srv_conn *c, const cJSON *obj, const char *name, bool *out);
bool srv_req_get_string(srv_conn *c, const cJSON *obj, const char *name, const char **out);

/* Which weights serve, for /admin/state and /info: weights_version,
 * weights_digest (hex) and merged ([{"name", "scale"}]) added to o. Two
 * replicas of one model with equal digests answer alike. */
void srv_req_add_weights_identity(cJSON *o, const lora_state *st);
/* 1 to 127 letters, digits, '-', '_' and '.': what an adapter may be named
 * (so a name is a label value and a folder name as it stands). */
bool srv_req_is_adapter_name(const char *name);

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
typedef struct srv_req_prompt {
    const char *text;
    const int32_t *tokens; /* when not NULL, n_tokens ids (no BOS added) */
    size_t n_tokens;
} srv_req_prompt;

/* What a generation request asks for, whatever its API. Strings point
 * into the parsed body, which outlives srv_gen_submit; token ids into
 * token_store (srv_req_ask_free). */
typedef struct srv_req_ask {
    const char *prompt; /* the one prompt, when n_prompts is 0 */
    srv_req_prompt prompts[SRV_MAX_PROMPTS];
    size_t n_prompts;
    int32_t *token_store; /* owned */
    int64_t max_new_tokens;
    eng_sampling sampling;
    eng_spec_request spec; /* speculative decoding for it (srv_req_get_speculative) */
    const char *stops[SRV_MAX_STOPS];
    size_t n_stops;
    /* what sampling.logit_bias points at (srv_req_get_sampling fills it) */
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
    bool reasoning;        /* a chat answer whose reasoning is kept apart (s->reason_format) */
    /* constrained decoding: the answer kept inside a grammar of
     * grammar_kind written as grammar_text (malloc'd, owned:
     * srv_req_ask_free; NULL: none), compiled off the loop through the
     * server's cache; a compile error is a 400 that begins with
     * grammar_where (the field it came from) */
    char *grammar_text;
    gr_kind grammar_kind;
    char grammar_where[128];
    /* what the API keeps for its answer beyond its shape (chat's tool
     * calls), owned: srv_gen_submit takes it (clearing these) and hands it
     * to the generation (g->answer), which calls answer_drop on it when
     * freed, or drops it at once when refused; srv_req_ask_free drops one
     * never handed over. */
    void *answer;
    void (*answer_drop)(void *answer);
} srv_req_ask;

/* Free what a owns (its token ids, its grammar's text, its answer state). */
void srv_req_ask_free(srv_req_ask *a);
/* Constrain a's answer to a grammar of kind from text[0..len) (copied),
 * where naming the field in a compile error; false after answering: a
 * 400 naming both fields when a already has one (one grammar per
 * request), 503 when memory is short. */
bool srv_req_ask_grammar(srv_conn *c, srv_req_ask *a, gr_kind kind, const char *text, size_t len,
                         const char *where);

/* "stop" (name): a string or an array of non-empty strings, into a. */
bool srv_req_get_stops(srv_conn *c, const cJSON *obj, const char *name, srv_req_ask *a);
/* The sampling fields both APIs share, from p (NULL: none given); TGI
 * samples greedily unless asked otherwise (greedy_default). Reads
 * frequency_penalty for both, and presence_penalty, logit_bias, min_tokens
 * and ignore_eos wherever the API's field list lets them through (OpenAI's
 * routes); a->max_new_tokens must be read first (min_tokens may not pass
 * it). */
bool srv_req_get_sampling(srv_conn *c, const cJSON *p, srv_req_ask *a, bool greedy_default);

/* A constrained answer asked by obj's field name (label: what messages
 * call it, "parameters.grammar"), into a (srv_req_ask_grammar):
 * OpenAI's response_format ({"type": "text"}: none; "json_object": any
 * object; "json_schema" with json_schema.schema, none meaning any JSON
 * value) and TGI's grammar ({"type": "json" or "json_object", "value": a
 * schema, as an object or a JSON string}, {"type": "regex", "value": RE},
 * {"type": "json_schema", "value": {"name", "schema"}}); each route
 * takes both. Absent or null: none. False after answering the 400. */
bool srv_req_get_grammar(srv_conn *c, const cJSON *obj, const char *name, const char *label,
                         srv_req_ask *a);
/* vLLM's guided decoding fields of a chat or completions body into a:
 * guided_json (a schema, or its JSON text), guided_regex, guided_choice
 * (the answer is one of the strings), or the same under newer vLLM's
 * structured_outputs {json, regex, choice}; guided_grammar (EBNF) is
 * refused by name, and so is a second grammar (response_format too). */
bool srv_req_get_guided(srv_conn *c, const cJSON *root, srv_req_ask *a);
/* The body fields srv_req_get_guided reads, for a route's list of known ones. */
#define SRV_GUIDED_FIELDS                                                                          \
    "guided_json", "guided_regex", "guided_choice", "guided_grammar", "structured_outputs"
/* A JSON Schema given as a value (NULL: out of memory) as a's grammar. */
bool srv_req_ask_schema(srv_conn *c, srv_req_ask *a, const cJSON *schema, const char *where);

/* vLLM's output fields both OpenAI routes take: skip_special_tokens
 * (default true) and include_stop_str_in_output (default false). */
bool srv_req_get_vllm_output(srv_conn *c, const cJSON *root, srv_req_ask *a);

/* llama-server's per-request speculation fields of obj, into a->spec: "speculative.n_max" (0 drafts
 * nothing; at most ENG_SPEC_MAX_DRAFT, and the engine bounds it to --draft-max) and
 * "speculative.n_min" (a shorter draft is not verified; at most n_max); "speculative.p_min" is
 * refused by name. Absent: the server's. False after answering the 400. */
bool srv_req_get_speculative(srv_conn *c, const cJSON *obj, srv_req_ask *a);
/* The body fields srv_req_get_speculative reads, for a route's list of known ones. */
#define SRV_SPECULATIVE_FIELDS "speculative.n_max", "speculative.n_min", "speculative.p_min"

/* The adapter an OpenAI-shaped request's "model" names (request.c): NULL
 * for the base model (no name, the base model's id, or "tgi" or "dummy",
 * the placeholders TGI's clients send to a server's URL), else the name. */
const char *srv_req_adapter_named(const srv_conn *c, const char *model);
/* The 404's tail for a "model" that is neither (srv_gen_shape.adapter_unknown). */
#define SRV_UNKNOWN_MODEL ": neither the base model nor a loaded adapter"

/* A whole (not streamed) answer (request.c): o (consumed), or a 500 when the engine
 * failed the request (o may then be NULL) or o is NULL (memory was short). */
void srv_req_respond_generation(srv_conn *c, cJSON *o, eng_finish why);
/* A stream's failure after its 200 was sent (request.c): one event with the body
 * srv_req_fail would have answered, {"error": {"type", "message", "code": status}}, which the
 * OpenAI SDK and huggingface_hub raise as an error; the caller then ends the stream. */
void srv_req_stream_error(srv_conn *c, int status, const char *message);

#endif

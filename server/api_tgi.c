/*
 * api_tgi.c - Text Generation Inference's API, so its clients work
 * unchanged: POST /generate and /generate_stream ({"inputs",
 * "parameters", "stream"} in; {"generated_text", "details"} out, or one
 * server-sent event per token and a last one with the whole text and
 * details), POST / (TGI's compat route: either, by "stream"), POST
 * /tokenize (the prompt's tokens with their byte spans) and GET /info
 * (TGI's Info fields, then ours). The generate parameters: best_of
 * candidates (the best by summed logprob answers, the others in
 * details.best_of_sequences), top_n_tokens (details.top_tokens and each
 * stream event's top_tokens), decoder_input_details (details.prefill:
 * each prompt token's logprob, the first null), truncate, typical_p,
 * frequency_penalty, grammar (a JSON Schema or a regular expression the
 * answer is kept inside: request.c's srv_req_get_grammar), llama-server's
 * speculative.n_max and n_min (details.speculative reports the drafts);
 * watermark only false. Token
 * logprobs are the engine's (raw model log-probabilities, scheduler.h):
 * TGI reports those of its processed distribution, which differ when
 * temperature or penalties are on.
 *
 * Offers the route handlers srv_tgi_* and srv_tgi_tokenize_spans (the token
 * list /tokenize answers, for any route that shows tokens); owns the TGI request fields (the
 * ones TGI has that this server does not implement are accepted only when
 * off) and the TGI answer shapes. Touches request.c's helpers, http.c's
 * stream end, and bridge.c's srv_gen_submit and the generation it hands
 * back as tokens arrive.
 */
#include "internal/api_tgi.h"
#include "internal/gen.h"
#include "internal/http.h"
#include "internal/logprobs.h"
#include "internal/pool_job.h"
#include "internal/request.h"

#include <cjson/cJSON.h>
#include <math.h>
#include <stdlib.h>
#include <string.h>

/* --- the request ----------------------------------------------------------------- */

/* TGI's best_of, top_n_tokens, decoder_input_details and truncate, with
 * its router's rules (validation.rs): best_of needs sampling and no seed
 * (each candidate draws its own), and neither best_of nor the prompt's
 * details may be streamed (checked by the route, which knows). */
static bool parse_tgi_details(srv_conn *c, const cJSON *p, srv_req_ask *a)
{
    int64_t best_of = 1, top_n = 0, truncate = 0;
    bool has_seed = !srv_req_is_null(cJSON_GetObjectItemCaseSensitive(p, "seed"));
    if (!srv_req_get_int(c, p, "best_of", 1, SRV_TGI_MAX_BEST_OF, &best_of, NULL) ||
        !srv_req_get_int(c, p, "top_n_tokens", 0, SRV_TGI_MAX_TOP_N, &top_n, NULL) ||
        !srv_req_get_bool(c, p, "decoder_input_details", &a->prompt_logprobs) ||
        !srv_req_get_int(c, p, "truncate", 1, INT32_MAX, &truncate, NULL))
        return false;
    if (best_of > 1 && a->sampling.temperature == 0) {
        srv_req_fail(c, 400,
                     "parameters.best_of %lld needs sampling (do_sample, or a temperature, "
                     "top_k, top_p or typical_p)",
                     (long long)best_of);
        return false;
    }
    if (best_of > 1 && has_seed) {
        srv_req_fail(c, 400,
                     "parameters.seed cannot be set when parameters.best_of is over 1 (each "
                     "candidate draws its own)");
        return false;
    }
    a->best_of = (int32_t)best_of;
    a->top_logprobs = (int32_t)top_n;
    a->truncate = (int32_t)truncate;
    a->prompt_logprobs_field = "parameters.decoder_input_details";
    return true;
}

/* TGI: {"inputs", "parameters": {...}, "stream"} */
static bool parse_tgi(srv_conn *c, const cJSON *root, srv_req_ask *a)
{
    static const char *const top[] = {"inputs", "parameters", "stream", NULL};
    static const char *const params[] = {"max_new_tokens",
                                         "temperature",
                                         "top_k",
                                         "top_p",
                                         "seed",
                                         "stop",
                                         "do_sample",
                                         "repetition_penalty",
                                         "adapter_id",
                                         "adapter_scale",
                                         "details",
                                         "return_full_text",
                                         "decoder_input_details",
                                         "watermark",
                                         "truncate",
                                         "typical_p",
                                         "best_of",
                                         "top_n_tokens",
                                         "frequency_penalty",
                                         "grammar",
                                         SRV_SPECULATIVE_FIELDS,
                                         NULL};
    if (!srv_req_only_known(c, root, "the body", top))
        return false;
    if (!srv_req_get_string(c, root, "inputs", &a->prompt))
        return false;
    if (!a->prompt) {
        srv_req_fail(c, 400, "\"inputs\" is required");
        return false;
    }
    const cJSON *p = cJSON_GetObjectItemCaseSensitive(root, "parameters");
    if (!srv_req_is_null(p) && !cJSON_IsObject(p)) {
        srv_req_fail(c, 400, "\"parameters\" must be an object");
        return false;
    }
    a->max_new_tokens = 100; /* TGI's default */
    if (srv_req_is_null(p))
        return srv_req_get_sampling(c, NULL, a, true);
    if (!srv_req_only_known(c, p, "parameters", params))
        return false;
    bool watermark = false;
    if (!srv_req_get_bool(c, p, "watermark", &watermark))
        return false;
    if (watermark) {
        srv_req_fail(c, 400, "parameters.watermark is not supported by this server");
        return false;
    }
    if (!srv_req_get_grammar(c, p, "grammar", "parameters.grammar", a))
        return false;
    if (!srv_req_get_int(c, p, "max_new_tokens", 1, INT32_MAX, &a->max_new_tokens, NULL) ||
        !srv_req_get_sampling(c, p, a, true) || !srv_req_get_stops(c, p, "stop", a) ||
        !srv_req_get_string(c, p, "adapter_id", &a->adapter) ||
        !srv_req_get_number(c, p, "adapter_scale", -100.0, 100.0, &a->adapter_scale,
                            &a->has_scale) ||
        !srv_req_get_bool(c, p, "details", &a->details) ||
        !srv_req_get_bool(c, p, "return_full_text", &a->return_full_text) ||
        !srv_req_get_speculative(c, p, a))
        return false;
    return parse_tgi_details(c, p, a);
}

/* --- the answer ------------------------------------------------------------------ */

static const char *tgi_finish(eng_finish f)
{
    switch (f) {
    case ENG_FINISH_EOS: return "eos_token";
    case ENG_FINISH_LENGTH: return "length";
    case ENG_FINISH_STOP: return "stop_sequence";
    case ENG_FINISH_CANCELLED: return "cancelled";
    case ENG_FINISH_ERROR:
    case ENG_FINISH_GRAMMAR: return "error";
    }
    return "unknown";
}

/* {"id", "text", "logprob", "special"} (logprob NaN: null, as TGI's
 * first prefill token) */
static cJSON *token_json(const srv_gen *g, int32_t id, const char *text, size_t len, float logprob,
                         bool special_field)
{
    cJSON *t = cJSON_CreateObject();
    cJSON_AddNumberToObject(t, "id", id);
    cJSON_AddItemToObject(t, "text", srv_req_json_text(text, len));
    if (isnan(logprob))
        cJSON_AddNullToObject(t, "logprob");
    else
        cJSON_AddNumberToObject(t, "logprob", isfinite(logprob) ? (double)logprob : -9999.0);
    if (special_field)
        cJSON_AddBoolToObject(t, "special", tok_is_special(g->s->model.tok, id));
    return t;
}

/* A token by its id alone: its own text. */
static cJSON *id_json(const srv_gen *g, int32_t id, float logprob, bool special_field)
{
    char *text = srv_logprobs_token_text(g->s->model.tok, id, NULL);
    cJSON *t = token_json(g, id, text, text ? strlen(text) : 0, logprob, special_field);
    free(text);
    return t;
}

/* Token k's top_n_tokens alternatives of choice i. */
static cJSON *top_json(const srv_gen *g, const srv_gen_choice *ch, size_t k)
{
    cJSON *list = cJSON_CreateArray();
    const eng_logprob *top = ch->top ? ch->top + k * (size_t)g->top_n : NULL;
    for (int32_t j = 0; top && j < g->top_n && top[j].token >= 0; j++)
        cJSON_AddItemToArray(list, id_json(g, top[j].token, top[j].logprob, true));
    return list;
}

/* What details say of one candidate: finish, counts, seed, prefill,
 * tokens and top tokens (the last three when tokens). */
static void add_candidate(cJSON *d, const srv_gen *g, int32_t i, bool tokens)
{
    const srv_gen_choice *ch = &g->choices[i];
    const srv_gen_part *part = &g->parts[0];
    cJSON_AddStringToObject(d, "finish_reason", tgi_finish(ch->why));
    cJSON_AddNumberToObject(d, "generated_tokens", ch->generated);
    if (g->sampled)
        cJSON_AddNumberToObject(d, "seed", (double)ch->seed);
    else
        cJSON_AddNullToObject(d, "seed");
    if (!tokens)
        return;
    cJSON *prefill = cJSON_AddArrayToObject(d, "prefill");
    for (int32_t k = 0; g->prompt_logprobs && k < part->n_tokens; k++)
        cJSON_AddItemToArray(
            prefill, id_json(g, part->tokens[k], part->logprobs ? part->logprobs[k] : NAN, false));
    cJSON *arr = cJSON_AddArrayToObject(d, "tokens");
    for (size_t k = 0; k < ch->n_tokens; k++)
        cJSON_AddItemToArray(arr, token_json(g, ch->tokens[k], ch->pieces[k], strlen(ch->pieces[k]),
                                             ch->logprobs[k], true));
    if (g->top_n) {
        cJSON *tops = cJSON_AddArrayToObject(d, "top_tokens");
        for (size_t k = 0; k < ch->n_tokens; k++)
            cJSON_AddItemToArray(tops, top_json(g, ch, k));
    }
}

/* details of the best candidate (best), with best_of_sequences for the
 * others when there are; when the request speculated, "speculative" with
 * its drafted tokens the model verified and of them the accepted (all
 * candidates together: a field of ours, TGI has none). */
static cJSON *tgi_details(const srv_gen *g, int32_t best, bool tokens, const eng_usage *u)
{
    cJSON *d = cJSON_CreateObject();
    add_candidate(d, g, best, tokens);
    if (u->spec.drafted > 0) {
        cJSON *spec = cJSON_AddObjectToObject(d, "speculative");
        cJSON_AddNumberToObject(spec, "drafted", (double)u->spec.drafted);
        cJSON_AddNumberToObject(spec, "accepted", (double)u->spec.accepted);
    }
    if (g->per_part > 1 && tokens) {
        cJSON *others = cJSON_AddArrayToObject(d, "best_of_sequences");
        for (int32_t i = 0; i < g->per_part; i++) {
            if (i == best)
                continue;
            cJSON *o = cJSON_CreateObject();
            size_t len;
            char *full = srv_gen_full_text(g, i, &len);
            cJSON_AddItemToObject(o, "generated_text", srv_req_json_text(full, len));
            free(full);
            add_candidate(o, g, i, true);
            cJSON_AddItemToArray(others, o);
        }
    }
    return d;
}

/* /generate's answer object: the best candidate's text and details. */
static cJSON *generation_json(const srv_gen *g, const eng_usage *u)
{
    int32_t best;
    srv_gen_answer_order(g, &best);
    cJSON *o = cJSON_CreateObject();
    size_t len;
    char *full = srv_gen_full_text(g, best, &len);
    cJSON_AddItemToObject(o, "generated_text", srv_req_json_text(full, len));
    free(full);
    if (g->details)
        cJSON_AddItemToObject(o, "details", tgi_details(g, best, true, u));
    return o;
}

/* /generate's whole answer (srv_gen_shape.whole: may run on a pool thread). */
static cJSON *whole_json(const srv_gen *g, const eng_usage *u)
{
    return generation_json(g, u);
}

static void stream_token(srv_gen *g, srv_conn *c, int32_t i, int32_t token, const char *text,
                         size_t len)
{
    if (token < 0)
        return; /* held-back text at the end: the final event carries it */
    const srv_gen_choice *ch = &g->choices[i];
    float lp = ch->n_tokens ? ch->logprobs[ch->n_tokens - 1] : 0.0f;
    cJSON *o = cJSON_CreateObject();
    cJSON_AddNumberToObject(o, "index", (double)ch->n_tokens);
    cJSON_AddItemToObject(o, "token", token_json(g, token, text, len, lp, true));
    if (g->top_n && ch->n_tokens)
        cJSON_AddItemToObject(o, "top_tokens", top_json(g, ch, ch->n_tokens - 1));
    cJSON_AddNullToObject(o, "generated_text");
    cJSON_AddNullToObject(o, "details");
    srv_req_stream_cjson(c, o);
}

static void stream_done(srv_gen *g, srv_conn *c, eng_finish why, const eng_usage *u)
{
    (void)why;
    /* the end: a pseudo-token carrying the whole text and details. Its own
     * text is what the engine held back until the end (a stop string's
     * possible start, an incomplete UTF-8 tail), as ordinary text, so
     * clients that join the non-special tokens' texts get the whole
     * generated_text; with no such tail it is an empty special token. */
    const srv_gen_choice *ch = &g->choices[0];
    const char *tail = ch->text ? ch->text + ch->text_len - ch->tail_len : "";
    cJSON *o = cJSON_CreateObject();
    cJSON_AddNumberToObject(o, "index", (double)ch->n_tokens + 1);
    cJSON *t = token_json(g, -1, tail, ch->tail_len, 0.0f, false);
    cJSON_AddBoolToObject(t, "special", ch->tail_len == 0);
    cJSON_AddItemToObject(o, "token", t);
    size_t len;
    char *full = srv_gen_full_text(g, 0, &len);
    cJSON_AddItemToObject(o, "generated_text", srv_req_json_text(full, len));
    free(full);
    cJSON *d = tgi_details(g, 0, false, u);
    cJSON_AddNumberToObject(d, "input_length", u->prompt_tokens); /* TGI's StreamDetails */
    cJSON_AddItemToObject(o, "details", d);
    srv_req_stream_cjson(c, o);
    srv_http_stream_end(c);
}

/* TGI's compat route answers a whole generation as a list of one /generate
 * answer ("to match api-inference", compat_generate says). */
static cJSON *compat_whole_json(const srv_gen *g, const eng_usage *u)
{
    cJSON *list = cJSON_CreateArray();
    cJSON_AddItemToArray(list, generation_json(g, u));
    return list;
}

static const srv_gen_shape tgi_whole = {
    .adapter_noun = "adapter", .adapter_unknown = " is not loaded", .whole = whole_json};
static const srv_gen_shape tgi_compat_whole = {
    .adapter_noun = "adapter", .adapter_unknown = " is not loaded", .whole = compat_whole_json};
static const srv_gen_shape tgi_stream = {.stream = true,
                                         .adapter_noun = "adapter",
                                         .adapter_unknown = " is not loaded",
                                         .on_token = stream_token,
                                         .on_done = stream_done};

/* --- the routes ------------------------------------------------------------------ */

/* What a stream cannot carry (TGI's router refuses the same), and the
 * token logprobs TGI always reports in details and stream events. */
static bool finish_ask(srv_conn *c, srv_req_ask *a, bool stream)
{
    if (stream && a->best_of > 1) {
        srv_req_fail(c, 400, "parameters.best_of over 1 cannot be streamed");
        return false;
    }
    if (stream && a->prompt_logprobs) {
        srv_req_fail(c, 400, "parameters.decoder_input_details cannot be streamed");
        return false;
    }
    a->logprobs = a->details || stream;
    return true;
}

/* POST /generate answers whole unless the body says "stream": true;
 * /generate_stream always streams (and ignores "stream"). */
static void generate(srv_conn *c, bool stream_route)
{
    cJSON *root = srv_req_body_object(c);
    if (!root)
        return;
    srv_req_ask a = {0};
    bool stream = stream_route;
    if (parse_tgi(c, root, &a) && (stream_route || srv_req_get_bool(c, root, "stream", &stream)) &&
        finish_ask(c, &a, stream))
        srv_gen_submit(c, &a, stream ? &tgi_stream : &tgi_whole);
    srv_req_ask_free(&a);
    cJSON_Delete(root);
}

void srv_tgi_generate(srv_conn *c, const char *name)
{
    (void)name;
    generate(c, false);
}

void srv_tgi_generate_stream(srv_conn *c, const char *name)
{
    (void)name;
    generate(c, true);
}

/*
 * POST /: TGI's compat route (router/src/server.rs compat_generate), what
 * huggingface_hub's InferenceClient.text_generation posts to: a /generate
 * body whose "stream" picks /generate_stream's events or a list of one
 * /generate answer. One difference from /generate, as in TGI: an absent
 * return_full_text defaults to true, TGI's default for a model whose Hub
 * pipeline tag is "text-generation" or unknown (a local model's is).
 */
void srv_tgi_compat(srv_conn *c, const char *name)
{
    (void)name;
    cJSON *root = srv_req_body_object(c);
    if (!root)
        return;
    srv_req_ask a = {.return_full_text = true};
    bool stream = false;
    if (parse_tgi(c, root, &a) && srv_req_get_bool(c, root, "stream", &stream) &&
        finish_ask(c, &a, stream))
        srv_gen_submit(c, &a, stream ? &tgi_stream : &tgi_compat_whole);
    srv_req_ask_free(&a);
    cJSON_Delete(root);
}

/* --- POST /tokenize: ids with their byte spans in the input --------------------- */

/*
 * Where each token of text[0..len) lies in it, as TGI answers /tokenize
 * (encoding_to_tokens: the tokenizers crate's byte offsets). Our tokenizer
 * does not keep offsets, so they are found by decoding: the tokens' bytes,
 * streamed one token at a time (tok_stream: whole characters only, and a
 * SentencePiece tokenizer's prefix space dropped as the first byte), must
 * spell the input from its start, and each token spans the bytes it
 * produced. Where a character's bytes are split over tokens (byte-fallback
 * or byte-level pieces of é or €), every token holding part of it spans
 * the whole character, as the tokenizers crate aligns them. A special
 * token spans its text where the input spells it, else nothing (the BOS
 * the tokenizer adds: start == stop). SentencePiece's prefix spaces: one
 * the input does not have (prepended to the text, or to a segment after a
 * special token) belongs to the token holding it, aligned with the
 * character that follows (a token that is only "▁" spans that
 * character); one the input has but the decoder drops (the first, when
 * the input starts with a space) is spanned by the token that holds it.
 * Checked against tokenizers 0.23 for byte-level and SentencePiece-style
 * tokenizers (tests/fixtures/make_tokenize_offsets.py). Not followed: a
 * ByteLevel post-processor's trim_offsets (GPT-2's own tokenizer.json has
 * it; Llama 3's and Qwen2's do not), which would leave a token's leading
 * space out of its span. When the bytes do not spell the input, *aligned
 * is false: TGI then answers every token with "" at 0..0, and so do we.
 */
typedef struct token_span {
    size_t start, stop;
} token_span;

/* Whether id is a special (control) token with a text (tok_is_special);
 * its text, when so, in *text. */
static bool special_text(const tok_tokenizer *t, int32_t id, char **text, size_t *len)
{
    *text = NULL;
    *len = 0;
    char *kept = NULL;
    size_t kept_len = 0;
    if (!tok_is_special(t, id) || tok_decode(t, &id, 1, false, &kept, &kept_len, NULL, 0) != QL_OK)
        return false;
    if (kept_len == 0) {
        free(kept);
        return false;
    }
    *text = kept;
    *len = kept_len;
    return true;
}

/* Push id onto the stream into *buf (grown as needed): the bytes it
 * completes, or a negative code. */
static long push_token(const tok_tokenizer *t, tok_stream *st, int32_t id, char **buf, size_t *cap)
{
    for (;;) {
        long k = tok_stream_push(t, st, id, *buf, *cap);
        if (k != QL_EINVAL || *cap >= ((size_t)1 << 20))
            return k;
        char *bigger = realloc(*buf, *cap * 4);
        if (!bigger)
            return QL_ENOMEM;
        *buf = bigger;
        *cap *= 4;
    }
}

/* The byte length of the character at text[pos] (1 for a byte that starts
 * none; 0 at the end). */
static size_t char_len_at(const char *text, size_t len, size_t pos)
{
    uint32_t cp;
    if (pos >= len)
        return 0;
    size_t n = ql_utf8_next((const uint8_t *)text + pos, len - pos, &cp);
    return n ? n : 1;
}

static int find_spans(const tok_tokenizer *t, const char *text, size_t len, const int32_t *ids,
                      size_t n, token_span *spans, bool *aligned)
{
    *aligned = false;
    size_t cap = 256, pos = 0;
    char *buf = malloc(cap);
    if (!buf)
        return QL_ENOMEM;
    tok_stream st = {0};
    long waiting = -1;          /* the first token whose last character is not yet whole */
    bool after_special = false; /* a segment starts: it may have a prefix space */
    int rc = QL_OK;
    size_t i = 0;
    for (; i < n; i++) {
        char *piece;
        size_t plen;
        if (special_text(t, ids[i], &piece, &plen)) {
            bool spelled =
                st.n_pending == 0 && plen <= len - pos && !memcmp(text + pos, piece, plen);
            free(piece);
            spans[i] = (token_span){pos, spelled ? pos + plen : pos};
            pos = spans[i].stop;
            after_special = true;
            continue;
        }
        bool first_push = st.n_pushed == 0;
        long k = push_token(t, &st, ids[i], &buf, &cap);
        if (k < 0) {
            rc = (int)k;
            break;
        }
        const char *b = buf;
        size_t lead = 0; /* input bytes the token covers before the ones it produced */
        if (after_special && k > 0 && b[0] == ' ' && (pos == len || text[pos] != ' ')) {
            b++; /* a segment's SentencePiece prefix space, not in the input */
            k--;
        } else if (first_push && st.n_pushed > (size_t)k && pos < len && text[pos] == ' ' &&
                   ((size_t)k > len - pos || memcmp(text + pos, b, (size_t)k) != 0)) {
            lead = 1; /* the decoder dropped the input's own first space */
        }
        after_special = false;
        size_t at = pos + lead;
        if ((size_t)k > len - at || memcmp(text + at, b, (size_t)k) != 0)
            break;
        if (k == 0 && !st.n_pending) {
            /* only a prefix space the input does not have: tokenizers aligns it
             * with the character that follows */
            spans[i] = (token_span){pos, pos + char_len_at(text, len, pos)};
            continue;
        }
        if (waiting >= 0 && k > 0) {
            for (size_t j = (size_t)waiting; j < i; j++)
                spans[j].stop = at + char_len_at(text, len, at);
            waiting = -1;
        }
        spans[i] = (token_span){pos, at + (size_t)k};
        pos = at + (size_t)k;
        if (st.n_pending && waiting < 0)
            waiting = (long)i;
    }
    free(buf);
    *aligned = rc == QL_OK && i == n && pos == len && waiting < 0;
    return rc;
}

/* The answer's list: one {"id", "text", "start", "stop"} per token, for
 * tokens [from, n). */
static cJSON *spans_json(const char *text, const int32_t *ids, const token_span *spans, size_t from,
                         size_t n, bool aligned)
{
    cJSON *list = cJSON_CreateArray();
    for (size_t i = from; list && i < n; i++) {
        token_span sp = aligned ? spans[i] : (token_span){0, 0};
        cJSON *o = cJSON_CreateObject();
        cJSON_AddNumberToObject(o, "id", ids[i]);
        char *piece = strndup(text + sp.start, sp.stop - sp.start);
        cJSON_AddStringToObject(o, "text", piece ? piece : "");
        free(piece);
        cJSON_AddNumberToObject(o, "start", (double)sp.start);
        cJSON_AddNumberToObject(o, "stop", (double)sp.stop);
        cJSON_AddItemToArray(list, o);
    }
    return list;
}

int64_t srv_tgi_context_tokens(const srv_server *s)
{
    int64_t context = s->model.cfg.max_position_embeddings;
    if (s->cfg->max_context > 0 && s->cfg->max_context < context)
        context = s->cfg->max_context;
    return context;
}

int srv_tgi_tokenize_spans(const tok_tokenizer *t, const char *text, size_t len,
                           const srv_tgi_token_list *want, cJSON **out, char *msg, size_t msg_len)
{
    *out = NULL;
    int32_t *ids = NULL;
    size_t n = 0;
    int rc = tok_encode(t, text, len, want->add_special && tok_adds_bos(t), true, &ids, &n, msg,
                        msg_len);
    if (rc != QL_OK)
        return rc;
    /* the list answered is bounded before any of it is built: each token
     * costs about 60 bytes of JSON (a megabyte of text that is one token
     * per byte would be a 50 MB answer) */
    size_t from = want->keep_last > 0 && n > want->keep_last ? n - want->keep_last : 0;
    if (n - from > want->max_tokens) {
        free(ids);
        return ql_fail(msg, msg_len, QL_EINVAL,
                       "\"%s\" is %zu tokens, more than the context length of %zu that a token "
                       "list answers%s",
                       want->field, n - from, want->max_tokens,
                       want->keep_last > 0 || !want->can_truncate
                           ? ""
                           : " (\"truncate\" keeps the last tokens)");
    }
    token_span *spans = calloc(n ? n : 1, sizeof *spans);
    bool aligned = false;
    rc = spans ? find_spans(t, text, len, ids, n, spans, &aligned) : QL_ENOMEM;
    if (rc == QL_OK)
        *out = spans_json(text, ids, spans, from, n, aligned);
    if (!*out)
        rc = ql_fail(msg, msg_len, QL_ENOMEM, "out of memory tokenizing %zu bytes", len);
    free(spans);
    free(ids);
    return rc;
}

/* /tokenize's work: the text tokenized with its spans and the answer
 * written as JSON on a pool thread (a megabyte of text must not hold the
 * loop, nor must printing its list). */
typedef struct tgi_tokens {
    char *text;
    srv_tgi_token_list want;
    char *answer; /* the JSON text answered */
} tgi_tokens;

static void tgi_tokens_run(srv_pool_job *w)
{
    tgi_tokens *tt = w->data;
    cJSON *list = NULL;
    /* truncate keeps the last tokens, as a generation would */
    w->rc = srv_tgi_tokenize_spans(w->s->model.tok, tt->text, strlen(tt->text), &tt->want, &list,
                                   w->msg, sizeof w->msg);
    if (w->rc != QL_OK)
        return;
    tt->answer = cJSON_PrintUnformatted(list);
    cJSON_Delete(list);
    if (!tt->answer)
        w->rc = ql_fail(w->msg, sizeof w->msg, QL_ENOMEM, "out of memory");
}

static void tgi_tokens_done(srv_pool_job *w)
{
    tgi_tokens *tt = w->data;
    if (w->conn && w->rc == QL_OK) {
        srv_http_respond_json_owned(w->conn, 200, tt->answer);
        tt->answer = NULL;
    } else if (w->conn) {
        srv_req_fail(w->conn, srv_req_status_of(w->rc), "%s", w->msg);
    }
    free(tt->answer);
    free(tt->text);
    free(tt);
}

/*
 * POST /tokenize, TGI's: a /generate body ({"inputs", "parameters"},
 * checked as /generate checks it) answered with the prompt's tokens as the
 * model is fed them: special tokens written in the text parsed, and the
 * tokenizer's BOS, which TGI always adds (its GenerateRequest's
 * add_special_tokens is not read from the body: serde skip, default true).
 * Ours reads "add_special_tokens" (default true) so a client can see the
 * text without it.
 */
void srv_tgi_tokenize(srv_conn *c, const char *name)
{
    (void)name;
    cJSON *root = srv_req_body_object(c);
    if (!root)
        return;
    cJSON *flag = cJSON_DetachItemFromObjectCaseSensitive(root, "add_special_tokens");
    srv_req_ask a = {0};
    tgi_tokens *tt = NULL;
    if (!srv_req_is_null(flag) && !cJSON_IsBool(flag)) {
        srv_req_fail(c, 400, "\"add_special_tokens\" must be a boolean");
    } else if (parse_tgi(c, root, &a) && srv_gen_ready(c)) {
        tt = calloc(1, sizeof *tt);
        if (tt && !(tt->text = strdup(a.prompt))) {
            free(tt);
            tt = NULL;
        }
        if (!tt)
            srv_req_fail(c, 503, "out of memory");
    }
    if (tt) {
        tt->want = (srv_tgi_token_list){.add_special = !cJSON_IsFalse(flag),
                                        .keep_last = a.truncate > 0 ? (size_t)a.truncate : 0,
                                        .max_tokens = (size_t)srv_tgi_context_tokens(c->s),
                                        .field = "inputs",
                                        .can_truncate = true};
        if (srv_pool_begin(c, tt, tgi_tokens_run, tgi_tokens_done) != 0) {
            free(tt->text);
            free(tt);
        }
    }
    srv_req_ask_free(&a);
    cJSON_Delete(flag);
    cJSON_Delete(root);
}

/* /info's step_budget: the options (0: automatic, from the time) and what the engine
 * measured and chose last (eng_engine_stats). */
static void add_step_budget(cJSON *root, const cfg_serve *cfg, const eng_engine_stats *es)
{
    cJSON *b = cJSON_AddObjectToObject(root, "step_budget");
    if (!b)
        return;
    cJSON_AddNumberToObject(b, "step_budget_ms", cfg->step_budget_ms);
    cJSON_AddNumberToObject(b, "max_prefill_per_step", cfg->max_prefill_per_step);
    cJSON_AddNumberToObject(b, "min_prefill_per_step", cfg->min_prefill_per_step);
    cJSON_AddNumberToObject(b, "prefill_tokens", es->prefill_budget);
    cJSON_AddNumberToObject(b, "target_ms", es->step_target_s * 1e3);
    cJSON_AddNumberToObject(b, "step_fixed_ms", es->step_fixed_s * 1e3);
    cJSON_AddNumberToObject(b, "step_token_ms", es->step_token_s * 1e3);
    cJSON_AddNumberToObject(b, "held_steps", (double)es->prefill_held_steps);
}

void srv_tgi_info(srv_conn *c, const char *name)
{
    (void)name;
    srv_server *s = c->s;
    cJSON *root = cJSON_CreateObject();
    /* TGI's Info fields (router/src/lib.rs), then our own */
    cJSON_AddStringToObject(root, "model_id", s->model_id);
    cJSON_AddNullToObject(root, "model_sha");
    cJSON_AddStringToObject(root, "model_pipeline_tag", "text-generation");
    cJSON_AddNumberToObject(root, "max_concurrent_requests", s->cfg->max_running);
    cJSON_AddNumberToObject(root, "max_best_of", SRV_TGI_MAX_BEST_OF);
    cJSON_AddNumberToObject(root, "max_stop_sequences", SRV_MAX_STOPS);
    cJSON_AddNumberToObject(root, "max_top_n_tokens", SRV_TGI_MAX_TOP_N);
    cJSON_AddNumberToObject(root, "validation_workers", 1);
    cJSON_AddNumberToObject(root, "max_client_batch_size", SRV_MAX_PROMPTS);
    cJSON_AddStringToObject(root, "router", "qlserve");
    cJSON_AddStringToObject(root, "version", QL_VERSION);
    cJSON_AddNullToObject(root, "sha");
    cJSON_AddNullToObject(root, "docker_label");
    cJSON_AddBoolToObject(root, "serving", s->serving);
    if (s->serving) {
        const eng_model *m = &s->model;
        int64_t context = srv_tgi_context_tokens(s);
        /* a prompt leaves room for at least one new token */
        cJSON_AddNumberToObject(root, "max_input_tokens", (double)(context - 1));
        cJSON_AddNumberToObject(root, "max_total_tokens", (double)context);
        cJSON_AddStringToObject(root, "model_dtype", m->quant);
        cJSON_AddStringToObject(root, "architecture", eng_arch_name(m->cfg.arch));
        cJSON_AddStringToObject(root, "format", m->format);
        cJSON_AddStringToObject(root, "quant", m->quant);
        cJSON_AddNumberToObject(root, "weight_bytes", (double)eng_model_weight_bytes(m));
        cJSON_AddNumberToObject(root, "max_new_tokens", s->cfg->max_new_tokens);
        cJSON_AddNumberToObject(root, "max_queued_requests", s->cfg->max_queued);
        cJSON_AddStringToObject(root, "cpu_kernels", qt_cpu_path());
        /* --activations as this run computes (srv_activations_settle) */
        cJSON_AddStringToObject(root, "activations",
                                ql_name_of(&ql_activations_names, qt_get_activations()));
        /* the kernel set the 8-bit products take here (avx512vnni, avx2, scalar) */
        cJSON_AddStringToObject(root, "q8_kernels", qt_q8_path());
        /* and the f32 products' (avx512: eight rows of x a pass; avx2; scalar) */
        cJSON_AddStringToObject(root, "f32_kernels", qt_f32_path());
        /* attention, the KV cache's conversions and unmerged LoRA products'
         * (avx512: zmm registers, the AVX2 bits; avx2; scalar) */
        cJSON_AddStringToObject(root, "row_kernels", qt_rows_path());
        cJSON_AddStringToObject(root, "device", eng_engine_backend(s->engine));
        eng_engine_stats es;
        eng_engine_stats_get(s->engine, &es);
        cJSON_AddStringToObject(root, "kv_dtype", qt_kind_name(es.kv_dtype));
        cJSON_AddNumberToObject(root, "kv_bytes_per_token",
                                (double)eng_kv_token_bytes(&m->cfg, es.kv_dtype));
        cJSON_AddNumberToObject(root, "kv_blocks_total", es.kv_blocks_total);
        add_step_budget(root, s->cfg, &es);
        /* a hybrid model: its recurrent states, and the prefix cache off */
        cJSON_AddNumberToObject(root, "recurrent_states_total", es.states_total);
        const char *off = eng_linear_prefix_off(&m->cfg.linear);
        if (off) {
            cJSON_AddStringToObject(root, "prefix_cache", "off");
            cJSON_AddStringToObject(root, "prefix_cache_off_because", off);
        }
        /* speculative decoding as it runs, and why not when asked for but refused */
        cJSON_AddStringToObject(root, "speculative",
                                ql_name_of(&ql_speculative_names, (int)es.spec.drafter));
        if (es.spec.off_reason[0])
            cJSON_AddStringToObject(root, "speculative_off_because", es.spec.off_reason);
    }
    if (s->serving && s->registry) {
        /* which replicas are interchangeable: the same digest */
        lora_state st;
        lora_registry_state(s->registry, &st);
        srv_req_add_weights_identity(root, &st);
    }
    srv_req_respond_cjson(c, 200, root);
}

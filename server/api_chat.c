/*
 * api_chat.c - chat completions, the route every chat client calls:
 * POST /v1/chat/completions in OpenAI's shape (TGI's Messages API serves
 * the same route with the same shapes), and TGI's POST /chat_tokenize
 * (the rendered text and its tokens, for the same body).
 *
 * A request's messages are rendered through the model's chat template
 * (template/: the Jinja program the model ships, rendered as
 * transformers' apply_chat_template renders it), with the variables
 * transformers passes: messages, tools (none when not given),
 * add_generation_prompt (true, as every chat server sends it), bos_token and
 * eos_token. The text it gives is the prompt, tokenized as transformers
 * tokenizes a rendered template: special tokens written in it are parsed,
 * and no BOS is added (the template writes its own). The answer is a
 * chat.completion with n choices, or chat.completion.chunk events: per
 * choice a first delta carrying the role, then content deltas (with
 * logprobs.content when asked: logprobs.c), a last chunk with its
 * finish_reason; then the usage when stream_options.include_usage, and
 * [DONE].
 *
 * A request naming an adapter that carries its own template (PEFT saves
 * the tokenizer beside an adapter when training changed it) is rendered
 * with that one, compiled for the request: adapters are loaded and
 * unloaded at run time, and compiling a template is cheap next to the
 * generation it frames.
 *
 * response_format keeps the answer inside a grammar (request.c's
 * srv_req_get_grammar); llama-server's speculative.n_max and n_min bound
 * the request's drafts (srv_req_get_speculative); tools and tool_choice are chat_tools.c's, which
 * turns the answer's text into tool_calls, whole or as stream deltas, when the request has tools
 * (g->answer set), and readies an assistant's past tool_calls for the template.
 *
 * Reasoning: a model whose vocabulary or template marks its thinking
 * (reasoning.c: <think>...</think>, GPT-OSS's harmony channels; found at
 * load by reasoning_load) has it kept apart in every chat-shaped answer
 * (srv_chat_prepare sets a->reasoning; bridge.c keeps each choice's
 * split): here message.reasoning_content beside the content, and
 * delta.reasoning_content before the content's deltas. vLLM's
 * chat_template_kwargs (enable_thinking) and OpenAI's reasoning_effort
 * are more of the template's variables.
 *
 * What was chosen where OpenAI leaves it open: content given as a list of
 * parts must be text parts ({"type": "text"}), joined with "\n" into one
 * string (vLLM's "string" content format), since the templates of text
 * models read content as a string; any other part (an image) is refused by
 * its type. A template that raises (raise_exception) answers 400 with the
 * template's message.
 *
 * Offers srv_chat_completions and srv_chat_tokenize (the handlers) and the templates' life on the
 * server (srv_chat_templates_load/free, called by serve.c); owns the compiled templates and the
 * chat request and answer shapes. Touches request.c's helpers, http.c's stream events, bridge.c's
 * srv_gen_submit, api_tgi.c's token spans, api_openai.c's shared OpenAI pieces, the model's
 * tokenizer (for the BOS/EOS text) and template/.
 */
#include "internal/api_chat.h"
#include "internal/api_openai.h"
#include "internal/api_tgi.h"
#include "internal/chat_tools.h"
#include "internal/gen.h"
#include "internal/http.h"
#include "internal/logprobs.h"
#include "internal/pool_job.h"
#include "internal/reasoning.h"
#include "internal/request.h"
#include "internal/tool_calls.h"

#include <cjson/cJSON.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

/* Output past this is a template gone wrong: real templates render a few
 * kilobytes of framing around the messages, and the messages themselves
 * are bounded by the body limit. */
#define CHAT_RENDER_MAX ((size_t)8 << 20)

/* --- the templates ------------------------------------------------------------ */

/* The text of special token id (tok_bos/tok_eos), or "" when there is none. */
static char *token_text(const tok_tokenizer *tok, int32_t id)
{
    char *text = NULL;
    size_t len = 0;
    char msg[256];
    if (id < 0 || tok_decode(tok, &id, 1, false, &text, &len, msg, sizeof msg) != QL_OK)
        return strdup("");
    return text;
}

static void compile_one(srv_server *s, const char *source, const char *what, tpl_template **out)
{
    if (!source)
        return;
    char msg[400]; /* leaves room in chat_template_error for the sentence around it */
    if (tpl_compile(out, source, strlen(source), msg, sizeof msg) != QL_OK) {
        snprintf(s->chat_template_error, sizeof s->chat_template_error,
                 "the model's %s chat template was refused at load: %s", what, msg);
        fprintf(stderr, "qlserve: %s (chat requests will be refused)\n", s->chat_template_error);
    }
}

/* The id of the one token whose text is marker (a vocabulary entry or an
 * added token, as Qwen3's <think> is), or -1. */
static int32_t marker_token(const tok_tokenizer *tok, const char *marker)
{
    int32_t *ids = NULL, id = -1;
    size_t n = 0;
    char msg[128];
    if (tok_encode(tok, marker, strlen(marker), false, true, &ids, &n, msg, sizeof msg) == QL_OK &&
        n == 1)
        id = ids[0];
    free(ids);
    return id;
}

/* Whether the model thinks between markers (srv_reason_format_of): its
 * vocabulary's <think>/</think> pair, or its template's; whether the
 * template's prompt leaves it inside a block (rendered once for one user
 * message); and whether its closing marker (</think>, or harmony's
 * <|channel|>) is a special token, which decoding would drop. */
static void reasoning_load(srv_server *s)
{
    const tok_tokenizer *tok = s->model.tok;
    int32_t open = marker_token(tok, "<think>"), close = marker_token(tok, "</think>");
    int32_t channel = marker_token(tok, "<|channel|>");
    bool harmony = channel >= 0 && marker_token(tok, "<|message|>") >= 0;
    s->reason_format =
        srv_reason_format_of(open >= 0 && close >= 0, harmony, s->model.chat_template);
    if (s->reason_format == SRV_REASON_NONE)
        return;
    size_t len = 0;
    int32_t marker = s->reason_format == SRV_REASON_HARMONY ? channel : close;
    s->reason_special = marker >= 0 && tok_is_special(tok, marker);
    cJSON *ctx = cJSON_Parse("{\"messages\": [{\"role\": \"user\", \"content\": \"x\"}], "
                             "\"tools\": null, \"add_generation_prompt\": true}");
    cJSON_AddStringToObject(ctx, "bos_token", s->chat_bos);
    cJSON_AddStringToObject(ctx, "eos_token", s->chat_eos);
    char *prompt = NULL, why[256];
    if (s->chat_template &&
        tpl_render(s->chat_template, ctx, CHAT_RENDER_MAX, &prompt, &len, why, sizeof why) == QL_OK)
        s->reason_opens = srv_reason_prompt_opens(s->reason_format, prompt, len);
    free(prompt);
    cJSON_Delete(ctx);
    fprintf(stderr, "qlserve: reasoning is kept apart (%s%s)\n",
            srv_reason_format_name(s->reason_format),
            s->reason_opens ? ", the prompt opens it" : "");
}

void srv_chat_templates_load(srv_server *s)
{
    s->chat_bos = token_text(s->model.tok, tok_bos(s->model.tok));
    s->chat_eos = token_text(s->model.tok, tok_eos(s->model.tok));
    compile_one(s, s->model.chat_template, "default", &s->chat_template);
    compile_one(s, s->model.chat_template_tool_use, "tool_use", &s->chat_template_tools);
    /* the syntax of the calls the model writes: its tool_use template's,
     * which is the one a request with tools renders, else its default's */
    const char *tools_source =
        s->chat_template_tools ? s->model.chat_template_tool_use : s->model.chat_template;
    s->tool_format = srv_tool_format_of(tools_source);
    if (s->tool_format != SRV_TOOLS_NONE)
        fprintf(stderr, "qlserve: tool calls are read in the %s syntax (the chat template's)\n",
                srv_tool_format_name(s->tool_format));
    reasoning_load(s);
}

void srv_chat_templates_free(srv_server *s)
{
    tpl_free(s->chat_template);
    tpl_free(s->chat_template_tools);
    free(s->chat_bos);
    free(s->chat_eos);
    s->chat_template = s->chat_template_tools = NULL;
    s->chat_bos = s->chat_eos = NULL;
}

/* The template for a request, as transformers chooses: the tool_use one
 * when tools are given and the model has one, else the default. NULL with
 * the refusal in msg when the model has none. Any thread. */
static const tpl_template *template_for(const srv_server *s, bool tools, char *msg, size_t msg_len)
{
    if (tools && s->chat_template_tools)
        return s->chat_template_tools;
    if (s->chat_template)
        return s->chat_template;
    if (s->chat_template_error[0])
        snprintf(msg, msg_len, "%s", s->chat_template_error);
    else
        snprintf(msg, msg_len,
                 "the model %s has no chat template (tokenizer_config.json's chat_template, "
                 "chat_template.jinja or GGUF tokenizer.chat_template): use /v1/completions, "
                 "or give one with --chat-template",
                 s->model_id);
    return NULL;
}

/* --- the messages ------------------------------------------------------------- */

/* Content as a list of parts: text parts joined with "\n"; NULL after
 * answering the refusal. */
static char *join_parts(srv_conn *c, const cJSON *parts, int index)
{
    size_t len = 0, cap = 64;
    char *out = malloc(cap);
    if (!out) {
        srv_req_fail(c, 503, "out of memory");
        return NULL;
    }
    out[0] = 0;
    int k = 0;
    for (const cJSON *p = parts->child; p; p = p->next, k++) {
        const char *type = cJSON_IsObject(p) ? mf_json_str(p, "type") : NULL;
        const char *text = mf_json_str(p, "text");
        if (!type || strcmp(type, "text") != 0 || !text) {
            srv_req_fail(c, 400,
                         "messages[%d].content[%d]: only {\"type\": \"text\", \"text\": ...} parts "
                         "are supported%s%s",
                         index, k, type ? ", not " : "", type ? type : "");
            free(out);
            return NULL;
        }
        size_t n = strlen(text), need = len + n + 2;
        if (need > cap) {
            while (cap < need)
                cap *= 2;
            char *grown = realloc(out, cap);
            if (!grown) {
                free(out);
                srv_req_fail(c, 503, "out of memory");
                return NULL;
            }
            out = grown;
        }
        if (k > 0)
            out[len++] = '\n';
        memcpy(out + len, text, n + 1);
        len += n;
    }
    return out;
}

/* Check message i and copy it into the template's list, content as one
 * string. False after answering the refusal. */
static bool add_message(srv_conn *c, const cJSON *m, int i, cJSON *list)
{
    static const char *const fields[] = {"role",         "content", "name", "tool_calls",
                                         "tool_call_id", "refusal", NULL};
    static const char *const roles[] = {"system", "user", "assistant", "tool", NULL};
    char where[32];
    snprintf(where, sizeof where, "messages[%d]", i);
    if (!cJSON_IsObject(m)) {
        srv_req_fail(c, 400, "%s must be an object", where);
        return false;
    }
    if (!srv_req_only_known(c, m, where, fields))
        return false;
    const char *role = mf_json_str(m, "role");
    size_t r = 0;
    while (role && roles[r] && strcmp(roles[r], role) != 0)
        r++;
    if (!role || !roles[r]) {
        srv_req_fail(c, 400, "%s.role must be system, user, assistant or tool%s%s", where,
                     role ? ", not " : "", role ? role : "");
        return false;
    }
    cJSON *copy = cJSON_Duplicate(m, true);
    if (!copy) {
        srv_req_fail(c, 503, "out of memory");
        return false;
    }
    cJSON_AddItemToArray(list, copy);
    if (!srv_chat_tools_message_in(c, copy, i))
        return false;
    const cJSON *content = cJSON_GetObjectItemCaseSensitive(m, "content");
    if (cJSON_IsArray(content)) {
        char *joined = join_parts(c, content, i);
        if (!joined)
            return false;
        cJSON_ReplaceItemInObjectCaseSensitive(copy, "content", cJSON_CreateString(joined));
        free(joined);
    } else if (!cJSON_IsString(content) &&
               !(srv_req_is_null(content) && strcmp(role, "assistant") == 0)) {
        srv_req_fail(c, 400, "%s.content must be a string or a list of text parts", where);
        return false;
    }
    return true;
}

/* vLLM's chat_template_kwargs (e.g. {"enable_thinking": false}): more of
 * the template's variables, beside (never over) the ones the request
 * makes itself; and OpenAI's reasoning_effort as the variable of that
 * name. False after answering the 400 (ctx then freed). */
static bool template_kwargs(srv_conn *c, const cJSON *root, cJSON *ctx)
{
    const cJSON *kw = cJSON_GetObjectItemCaseSensitive(root, "chat_template_kwargs");
    const char *effort = NULL;
    if (!srv_req_get_string(c, root, "reasoning_effort", &effort)) {
        cJSON_Delete(ctx);
        return false;
    }
    if (effort) /* GPT-OSS's template reads it ("Reasoning: high"), as vLLM passes it */
        cJSON_AddStringToObject(ctx, "reasoning_effort", effort);
    if (srv_req_is_null(kw))
        return true;
    if (!cJSON_IsObject(kw)) {
        srv_req_fail(c, 400, "\"chat_template_kwargs\" must be an object");
        cJSON_Delete(ctx);
        return false;
    }
    for (const cJSON *v = kw->child; v; v = v->next)
        if (!cJSON_GetObjectItemCaseSensitive(ctx, v->string))
            cJSON_AddItemToObject(ctx, v->string, cJSON_Duplicate(v, true));
    return true;
}

/* The template's variables for this request; NULL after answering. */
static cJSON *template_context(srv_conn *c, const cJSON *root)
{
    const cJSON *messages = cJSON_GetObjectItemCaseSensitive(root, "messages");
    if (!cJSON_IsArray(messages) || cJSON_GetArraySize(messages) == 0) {
        srv_req_fail(c, 400, "\"messages\" must be a non-empty list");
        return NULL;
    }
    cJSON *ctx = cJSON_CreateObject();
    cJSON *list = cJSON_AddArrayToObject(ctx, "messages");
    int i = 0;
    for (const cJSON *m = messages->child; m; m = m->next, i++) {
        if (!add_message(c, m, i, list)) {
            cJSON_Delete(ctx);
            return NULL;
        }
    }
    const cJSON *tools = cJSON_GetObjectItemCaseSensitive(root, "tools");
    if (!srv_req_is_null(tools) && !cJSON_IsArray(tools)) {
        srv_req_fail(c, 400, "\"tools\" must be a list");
        cJSON_Delete(ctx);
        return NULL;
    }
    cJSON_AddItemToObject(
        ctx, "tools", srv_req_is_null(tools) ? cJSON_CreateNull() : cJSON_Duplicate(tools, true));
    bool add_generation_prompt = true; /* vLLM's and TGI's default */
    if (!srv_req_get_bool(c, root, "add_generation_prompt", &add_generation_prompt)) {
        cJSON_Delete(ctx);
        return NULL;
    }
    cJSON_AddBoolToObject(ctx, "add_generation_prompt", add_generation_prompt);
    cJSON_AddStringToObject(ctx, "bos_token", c->s->chat_bos ? c->s->chat_bos : "");
    cJSON_AddStringToObject(ctx, "eos_token", c->s->chat_eos ? c->s->chat_eos : "");
    return template_kwargs(c, root, ctx) ? ctx : NULL;
}

/* An adapter's own template, when PEFT saved the tokenizer beside it
 * (training changed it): compiled for this request into *own (NULL: no
 * adapter, or one without, and the model's serves). A refused one is
 * QL_EINVAL with msg. Any thread. */
static int adapter_template(const eng_lora *adapter, bool tools, tpl_template **own, char *msg,
                            size_t msg_len)
{
    *own = NULL;
    if (!adapter)
        return QL_OK;
    const char *source = tools && adapter->chat_template_tool_use ? adapter->chat_template_tool_use
                                                                  : adapter->chat_template;
    char why[400];
    int rc = source ? tpl_compile(own, source, strlen(source), why, sizeof why) : QL_OK;
    if (rc != QL_OK)
        return ql_fail(msg, msg_len, QL_EINVAL, "adapter %s's chat template is refused: %s",
                       adapter->name, why);
    return QL_OK;
}

/* A chat prompt rendered off the loop (srv_gen_prompt_maker's arg): the
 * template is chosen there too, since an adapter named by the request may
 * only be loaded there (on first use), and its own template then serves.
 * The adapter comes from the generation (bridge.c acquires it once). */
typedef struct chat_render {
    const srv_server *s; /* its templates outlive every request (freed after the drain) */
    bool tools;
    cJSON *ctx; /* the template's variables, owned */
} chat_render;

static int render_make(void *arg, const eng_lora *adapter, char **prompt, char *msg, size_t msg_len)
{
    const chat_render *cr = arg;
    tpl_template *own = NULL;
    int rc = adapter_template(adapter, cr->tools, &own, msg, msg_len);
    if (rc != QL_OK)
        return rc;
    const tpl_template *t = own ? own : template_for(cr->s, cr->tools, msg, msg_len);
    if (!t)
        return QL_EINVAL;
    char why[1024];
    size_t len = 0;
    rc = tpl_render(t, cr->ctx, CHAT_RENDER_MAX, prompt, &len, why, sizeof why);
    if (rc != QL_OK)
        snprintf(msg, msg_len, "the chat template: %s", why);
    tpl_free(own);
    return rc;
}

static void render_drop(void *arg)
{
    chat_render *cr = arg;
    cJSON_Delete(cr->ctx);
    free(cr);
}

/* The request's messages, to be rendered off the loop into *maker. False
 * after answering the refusal: a request for the base model of a model
 * without a template is refused here, before any work. */
static bool prompt_maker(srv_conn *c, const cJSON *root, const char *adapter,
                         srv_gen_prompt_maker *maker)
{
    cJSON *ctx = template_context(c, root);
    if (!ctx)
        return false;
    bool tools = !cJSON_IsNull(cJSON_GetObjectItem(ctx, "tools"));
    char msg[1024];
    if (!adapter && !template_for(c->s, tools, msg, sizeof msg)) {
        srv_req_fail(c, 400, "%s", msg);
        cJSON_Delete(ctx);
        return false;
    }
    chat_render *cr = calloc(1, sizeof *cr);
    if (!cr) {
        srv_req_fail(c, 503, "out of memory");
        cJSON_Delete(ctx);
        return false;
    }
    *cr = (chat_render){.s = c->s, .tools = tools, .ctx = ctx};
    *maker = (srv_gen_prompt_maker){.make = render_make, .drop = render_drop, .arg = cr};
    return true;
}

/* --- other APIs' tools --------------------------------------------------------- */

bool srv_chat_read_tools(srv_conn *c, const cJSON *root, cJSON *chat, srv_chat_tool_reader *each)
{
    const cJSON *tools = cJSON_GetObjectItemCaseSensitive(root, "tools");
    if (!srv_req_is_null(tools) && !cJSON_IsArray(tools)) {
        srv_req_fail(c, 400, "tools: must be a list");
        return false;
    }
    int n = cJSON_GetArraySize(tools);
    if (n > SRV_MAX_TOOLS) {
        srv_req_fail(c, 400, "tools: %d tools; at most %d", n, SRV_MAX_TOOLS);
        return false;
    }
    if (n == 0)
        return true;
    cJSON *out = cJSON_AddArrayToObject(chat, "tools");
    int k = 0;
    for (const cJSON *t = tools->child; t; t = t->next, k++)
        if (!each(c, t, k, out))
            return false;
    return true;
}

/* --- the request -------------------------------------------------------------- */

/* The fields of a chat request other than messages and tools. */
static bool parse_chat(srv_conn *c, const cJSON *root, srv_req_ask *a, const char **model,
                       bool *stream)
{
    static const char *const fields[] = {"model",
                                         "messages",
                                         "max_tokens",
                                         "max_completion_tokens",
                                         "temperature",
                                         "top_p",
                                         "n",
                                         "stop",
                                         "seed",
                                         "stream",
                                         "stream_options",
                                         "presence_penalty",
                                         "frequency_penalty",
                                         "logprobs",
                                         "top_logprobs",
                                         "logit_bias",
                                         "user",
                                         "tools",
                                         "tool_choice",
                                         "parallel_tool_calls",
                                         "response_format",
                                         SRV_GUIDED_FIELDS,
                                         "top_k",
                                         "repetition_penalty",
                                         "metadata",
                                         "store",
                                         "service_tier",
                                         "add_generation_prompt",
                                         "min_tokens",
                                         "ignore_eos",
                                         "skip_special_tokens",
                                         "include_stop_str_in_output",
                                         "chat_template_kwargs",
                                         "reasoning_effort",
                                         SRV_SPECULATIVE_FIELDS,
                                         NULL};
    if (!srv_req_only_known(c, root, "the body", fields))
        return false;
    if (!srv_req_get_string(c, root, "model", model) ||
        !srv_req_get_bool(c, root, "stream", stream))
        return false;
    /* OpenAI's default: as many as the context allows; the server's own
     * cap on max_new_tokens applies (check_limits) */
    a->max_new_tokens = c->s->cfg->max_new_tokens;
    bool has_max = false, has_max_tokens = false, logprobs = false, has_top = false;
    int64_t n = 1, top = 0;
    if (!srv_req_get_int(c, root, "max_completion_tokens", 1, INT32_MAX, &a->max_new_tokens,
                         &has_max) ||
        (!has_max && !srv_req_get_int(c, root, "max_tokens", 1, INT32_MAX, &a->max_new_tokens,
                                      &has_max_tokens)) ||
        !srv_req_get_sampling(c, root, a, false) || !srv_req_get_stops(c, root, "stop", a) ||
        !srv_req_get_int(c, root, "n", 1, SRV_MAX_CHOICES, &n, NULL) ||
        !srv_req_get_bool(c, root, "logprobs", &logprobs) ||
        !srv_req_get_int(c, root, "top_logprobs", 0, ENG_MAX_LOGPROBS, &top, &has_top) ||
        !srv_req_get_vllm_output(c, root, a) || !srv_req_get_speculative(c, root, a))
        return false;
    if (has_top && !logprobs) {
        srv_req_fail(c, 400, "\"top_logprobs\" needs \"logprobs\": true");
        return false;
    }
    a->n = (int32_t)n;
    a->logprobs = logprobs;
    a->top_logprobs = (int32_t)top;
    /* response_format first: a forced tool call refuses a second grammar */
    if (!srv_oai_stream_options(c, root, a) ||
        !srv_req_get_grammar(c, root, "response_format", "response_format", a) ||
        !srv_req_get_guided(c, root, a))
        return false;
    a->fill_context = !has_max && !has_max_tokens;
    return true;
}

/* --- the answer --------------------------------------------------------------- */

/* An answer object with no choices yet. */
static cJSON *chat_object(const srv_gen *g, const char *object, cJSON **choices)
{
    cJSON *o = cJSON_CreateObject();
    cJSON_AddStringToObject(o, "id", g->oai_id);
    cJSON_AddStringToObject(o, "object", object);
    cJSON_AddNumberToObject(o, "created", (double)time(NULL));
    cJSON_AddStringToObject(o, "model", g->model_id);
    *choices = cJSON_AddArrayToObject(o, "choices");
    return o;
}

/* One choice: `what` ("message" or "delta") holding body (consumed),
 * logprobs (consumed; NULL: null), finish (NULL: null). */
static void add_choice(cJSON *choices, int32_t index, const char *what, cJSON *body,
                       cJSON *logprobs, const char *finish)
{
    cJSON *choice = cJSON_CreateObject();
    cJSON_AddNumberToObject(choice, "index", index);
    cJSON_AddItemToObject(choice, what, body);
    if (logprobs)
        cJSON_AddItemToObject(choice, "logprobs", logprobs);
    else
        cJSON_AddNullToObject(choice, "logprobs");
    if (finish)
        cJSON_AddStringToObject(choice, "finish_reason", finish);
    else
        cJSON_AddNullToObject(choice, "finish_reason");
    cJSON_AddItemToArray(choices, choice);
}

/* A role and content as given (NULL: left out). */
static cJSON *message_body(const char *role, const char *text, size_t len)
{
    cJSON *body = cJSON_CreateObject();
    if (role)
        cJSON_AddStringToObject(body, "role", role);
    if (text)
        cJSON_AddItemToObject(body, "content", srv_req_json_text(text, len));
    return body;
}

/* A chunk of one choice carrying delta (consumed). */
static cJSON *delta_object_chunk(const srv_gen *g, int32_t i, cJSON *delta, cJSON *logprobs,
                                 const char *finish)
{
    cJSON *choices;
    cJSON *o = chat_object(g, "chat.completion.chunk", &choices);
    add_choice(choices, i, "delta", delta, logprobs, finish);
    return o;
}

/* A chunk of one choice's delta: role and content as given (NULL: left
 * out). */
static cJSON *delta_chunk(const srv_gen *g, int32_t i, const char *role, const char *text,
                          size_t len, cJSON *logprobs, const char *finish)
{
    return delta_object_chunk(g, i, message_body(role, text, len), logprobs, finish);
}

/* vLLM's reasoning_content beside the content: the reasoning, or null
 * when the answer had none. */
static void add_reasoning(const srv_gen *g, int32_t i, cJSON *message)
{
    size_t len;
    const char *text = srv_gen_reasoning(g, i, &len);
    cJSON_AddItemToObject(message, "reasoning_content",
                          len ? srv_req_json_text(text, len) : cJSON_CreateNull());
}

/* The whole answer (srv_gen_shape.whole: may run on a pool thread). */
static cJSON *whole_json(const srv_gen *g, const eng_usage *u)
{
    cJSON *choices;
    cJSON *o = chat_object(g, "chat.completion", &choices);
    for (int32_t i = 0; i < g->n_choices; i++) {
        const srv_gen_choice *ch = &g->choices[i];
        cJSON *lp = g->logprobs ? srv_logprobs_chat(g, i, 0, ch->n_tokens) : NULL;
        const char *finish = srv_oai_finish(ch->why);
        cJSON *message;
        if (g->answer) { /* tools: the text read for calls */
            message = message_body("assistant", NULL, 0);
            srv_chat_tools_answer(g, g->answer, i, message, &finish);
        } else {
            size_t len;
            const char *text = srv_gen_content(g, i, &len);
            message = message_body("assistant", text, len);
        }
        if (g->reasoning)
            add_reasoning(g, i, message);
        add_choice(choices, i, "message", message, lp, finish);
    }
    srv_oai_add_usage(o, u);
    return o;
}

/* The first chunk of each choice's stream carries the role, as OpenAI's does. */
static void open_stream(srv_gen *g, srv_conn *c, int32_t i)
{
    if (g->choices[i].opened)
        return;
    g->choices[i].opened = true;
    srv_req_stream_cjson(c, delta_chunk(g, i, "assistant", "", 0, NULL, NULL));
}

/* With tools: what chat_tools.c lets out of choice i now (at its end,
 * the rest and its calls, then the finish), each delta its own chunk; the
 * token's logprobs ride on the first (a token held back as a possible
 * call sends none). */
/* With reasoning kept apart: the reasoning choice i has let out since
 * the last call, as a delta.reasoning_content chunk carrying the token's
 * logprobs when lp; whether one was sent. */
static bool stream_reasoning(srv_gen *g, srv_conn *c, int32_t i, bool lp)
{
    srv_gen_choice *ch = &g->choices[i];
    size_t len;
    const char *text = srv_gen_reasoning(g, i, &len);
    if (len <= ch->reason_sent)
        return false;
    cJSON *delta = cJSON_CreateObject();
    cJSON_AddItemToObject(delta, "reasoning_content",
                          srv_req_json_text(text + ch->reason_sent, len - ch->reason_sent));
    ch->reason_sent = len;
    srv_req_stream_cjson(
        c, delta_object_chunk(g, i, delta,
                              lp ? srv_logprobs_chat(g, i, ch->n_tokens - 1, ch->n_tokens) : NULL,
                              NULL));
    return true;
}

/* With reasoning kept apart and no tools: the content choice i has let
 * out since the last call (none while it reasons); whether a chunk went. */
static bool stream_content(srv_gen *g, srv_conn *c, int32_t i, bool lp)
{
    srv_gen_choice *ch = &g->choices[i];
    size_t len;
    const char *text = srv_gen_content(g, i, &len);
    if (len <= ch->content_sent && !lp)
        return false;
    const char *from = text + (len > ch->content_sent ? ch->content_sent : len);
    size_t n = len > ch->content_sent ? len - ch->content_sent : 0;
    ch->content_sent += n;
    srv_req_stream_cjson(
        c, delta_chunk(g, i, NULL, from, n,
                       lp ? srv_logprobs_chat(g, i, ch->n_tokens - 1, ch->n_tokens) : NULL, NULL));
    return true;
}

static void stream_tools(srv_gen *g, srv_conn *c, int32_t i, bool token, bool end)
{
    const srv_gen_choice *ch = &g->choices[i];
    const char *finish = srv_oai_finish(ch->why);
    cJSON *deltas = srv_chat_tools_stream(g, g->answer, i, end, &finish);
    bool lp = g->logprobs && token && ch->n_tokens;
    for (cJSON *d; deltas && (d = cJSON_DetachItemFromArray(deltas, 0));) {
        cJSON *logprobs = lp ? srv_logprobs_chat(g, i, ch->n_tokens - 1, ch->n_tokens) : NULL;
        srv_req_stream_cjson(c, delta_object_chunk(g, i, d, logprobs, NULL));
        lp = false;
    }
    cJSON_Delete(deltas);
    if (end)
        srv_req_stream_cjson(c, delta_chunk(g, i, NULL, NULL, 0, NULL, finish));
}

static void stream_token(srv_gen *g, srv_conn *c, int32_t i, int32_t token, const char *text,
                         size_t len)
{
    open_stream(g, c, i);
    const srv_gen_choice *ch = &g->choices[i];
    bool lp = g->logprobs && token >= 0 && ch->n_tokens;
    if (g->reasoning && stream_reasoning(g, c, i, lp))
        token = -1; /* its logprobs have gone */
    if (g->answer) {
        stream_tools(g, c, i, token >= 0, false);
        return;
    }
    if (g->reasoning) {
        stream_content(g, c, i, lp && token >= 0);
        return;
    }
    /* every token is a chunk, its content empty when it adds no text (a
     * special token, an end token ignore_eos lets through, text held back
     * for a stop string), as vLLM streams it */
    if (len > 0 || token >= 0)
        srv_req_stream_cjson(
            c,
            delta_chunk(g, i, NULL, text ? text : "", len,
                        lp ? srv_logprobs_chat(g, i, ch->n_tokens - 1, ch->n_tokens) : NULL, NULL));
}

static void stream_done(srv_gen *g, srv_conn *c, eng_finish why, const eng_usage *u)
{
    (void)why; /* each choice's own finish is sent */
    for (int32_t i = 0; i < g->n_choices; i++) {
        open_stream(g, c, i);
        if (g->reasoning)
            stream_reasoning(g, c, i, false);
        if (g->answer) {
            stream_tools(g, c, i, false, true);
            continue;
        }
        if (g->reasoning)
            stream_content(g, c, i, false);
        srv_req_stream_cjson(
            c, delta_chunk(g, i, NULL, NULL, 0, NULL, srv_oai_finish(g->choices[i].why)));
    }
    if (g->include_usage) {
        cJSON *choices;
        srv_oai_usage_chunk(c, chat_object(g, "chat.completion.chunk", &choices), u);
    }
    srv_http_stream_event(c, "[DONE]", 6);
    srv_http_stream_end(c);
}

static const srv_gen_shape chat_whole = {.id_prefix = "chatcmpl",
                                         .adapter_noun = "model",
                                         .adapter_unknown = SRV_UNKNOWN_MODEL,
                                         .whole = whole_json};
static const srv_gen_shape chat_stream = {.stream = true,
                                          .id_prefix = "chatcmpl",
                                          .adapter_noun = "model",
                                          .adapter_unknown = SRV_UNKNOWN_MODEL,
                                          .on_token = stream_token,
                                          .on_done = stream_done};

/* --- the routes --------------------------------------------------------------- */

/* A chat request read whole: the body (returned: a's strings point into
 * it; cJSON_Delete it after a), its fields in a, the adapter its "model"
 * names, and its messages ready to render (*maker, the caller's). NULL
 * after answering a refusal (the templates come with the model: not before
 * it has loaded). */
static cJSON *read_chat(srv_conn *c, srv_req_ask *a, bool *stream, srv_gen_prompt_maker *maker)
{
    if (!srv_gen_ready(c))
        return NULL;
    cJSON *root = srv_req_body_object(c);
    if (!root)
        return NULL;
    const char *model = NULL;
    if (!parse_chat(c, root, a, &model, stream)) {
        cJSON_Delete(root);
        return NULL;
    }
    a->adapter = srv_req_adapter_named(c, model);
    if (!srv_chat_prepare(c, root, a, maker)) {
        cJSON_Delete(root);
        return NULL;
    }
    return root;
}

bool srv_chat_prepare(srv_conn *c, const cJSON *chat, srv_req_ask *a, srv_gen_prompt_maker *maker)
{
    /* after any response_format: a forced tool call refuses a second grammar */
    if (!srv_chat_tools_read(c, chat, a))
        return false;
    a->templated = true;
    /* reasoning kept apart; a </think> that is a control token is kept in
     * the text (unless the client chose), so that it can be seen */
    a->reasoning = c->s->reason_format != SRV_REASON_NONE;
    if (a->reasoning && c->s->reason_special &&
        !cJSON_GetObjectItemCaseSensitive(chat, "skip_special_tokens"))
        a->keep_special = true;
    return prompt_maker(c, chat, a->adapter, maker);
}

/* /chat_tokenize's work: the template rendered, its text tokenized and
 * the answer written as JSON, on a pool thread. */
typedef struct chat_tokens {
    srv_gen_prompt_maker maker;
    char adapter[128]; /* the adapter "model" names ("": the base model) */
    srv_chat_token_answer *shape;
    char *answer; /* the JSON text answered */
} chat_tokens;

/* /chat_tokenize's answer: the text and TGI's token list. */
static cJSON *tokenize_answer(const char *prompt, cJSON *tokens)
{
    cJSON *o = cJSON_CreateObject();
    cJSON_AddItemToObject(o, "tokenize_response", tokens);
    cJSON_AddStringToObject(o, "templated_text", prompt);
    return o;
}

static void chat_tokens_run(srv_pool_job *w)
{
    chat_tokens *ct = w->data;
    char *prompt = NULL;
    cJSON *tokens = NULL;
    /* no generation to acquire it: the adapter, when loaded, for its template */
    eng_lora *adapter = srv_gen_adapter_loaded(w->s, ct->adapter[0] ? ct->adapter : NULL);
    w->rc = ct->maker.make(ct->maker.arg, adapter, &prompt, w->msg, sizeof w->msg);
    eng_lora_unref(adapter);
    /* a rendered template writes its own special tokens: none added */
    srv_tgi_token_list want = {.max_tokens = (size_t)srv_tgi_context_tokens(w->s),
                               .field = "messages"};
    if (w->rc == QL_OK)
        w->rc = srv_tgi_tokenize_spans(w->s->model.tok, prompt, strlen(prompt), &want, &tokens,
                                       w->msg, sizeof w->msg);
    if (w->rc == QL_OK) {
        cJSON *o = ct->shape(prompt, tokens);
        ct->answer = cJSON_PrintUnformatted(o);
        cJSON_Delete(o);
        if (!ct->answer)
            w->rc = ql_fail(w->msg, sizeof w->msg, QL_ENOMEM, "out of memory");
    }
    free(prompt);
}

static void chat_tokens_done(srv_pool_job *w)
{
    chat_tokens *ct = w->data;
    if (w->conn && w->rc == QL_OK) {
        srv_http_respond_json_owned(w->conn, 200, ct->answer);
        ct->answer = NULL;
    } else if (w->conn) {
        srv_req_fail(w->conn, srv_req_status_of(w->rc), "%s", w->msg);
    }
    ct->maker.drop(ct->maker.arg);
    free(ct->answer);
    free(ct);
}

void srv_chat_tokens(srv_conn *c, const char *adapter, srv_gen_prompt_maker maker,
                     srv_chat_token_answer *shape)
{
    chat_tokens *ct = calloc(1, sizeof *ct);
    if (!ct) {
        maker.drop(maker.arg);
        srv_req_fail(c, 503, "out of memory");
        return;
    }
    snprintf(ct->adapter, sizeof ct->adapter, "%s", adapter ? adapter : "");
    ct->maker = maker;
    ct->shape = shape;
    if (srv_pool_begin(c, ct, chat_tokens_run, chat_tokens_done) != 0) {
        maker.drop(maker.arg);
        free(ct);
    }
}

/* A chat request read, then answered: rendered and tokenized
 * (/chat_tokenize), or generated. */
static void chat_route(srv_conn *c, bool tokens_only)
{
    srv_req_ask a = {0};
    bool stream = false;
    srv_gen_prompt_maker maker;
    cJSON *root = read_chat(c, &a, &stream, &maker);
    if (root && tokens_only)
        srv_chat_tokens(c, a.adapter, maker, tokenize_answer);
    else if (root)
        srv_gen_submit_made(c, &a, stream ? &chat_stream : &chat_whole, maker);
    srv_req_ask_free(&a);
    cJSON_Delete(root);
}

/* POST /chat_tokenize (TGI's): what the model would be fed for this chat
 * request, as text and as TGI's token list. */
void srv_chat_tokenize(srv_conn *c, const char *name)
{
    (void)name;
    chat_route(c, true);
}

void srv_chat_completions(srv_conn *c, const char *name)
{
    (void)name;
    chat_route(c, false);
}

/*
 * api_messages.c - Anthropic's Messages API, for the clients that speak it
 * (the anthropic SDK; Claude Code and other agents pointed at this server
 * with ANTHROPIC_BASE_URL): POST /v1/messages, whole or streamed, and
 * POST /v1/messages/count_tokens.
 *
 * A reader and a writer around chat completions' path, not a copy of it
 * (api_chat.h's srv_chat_prepare, the one translation layer). The reader
 * checks the body in Anthropic's terms (each 400 names Anthropic's field)
 * and rewrites it as a chat request in chat completions' shape: system (a
 * string or text blocks) becomes a system message; a user message's text
 * blocks its content parts and its tool_result blocks tool messages (before
 * it, in their order); an assistant's text blocks its content and its
 * tool_use blocks its tool_calls; tools {name, description, input_schema}
 * become function tools; tool_choice auto, any, tool and none become auto,
 * required, a named function and none, and disable_parallel_tool_use
 * parallel_tool_calls false. max_tokens, temperature, top_p, top_k and
 * stop_sequences go into the request as chat's fields do. The generation
 * is chat's (the template, the grammar of a forced call, chat_tools.c's
 * reading of calls); the writer turns chat_answer.c's parts of its answer
 * (text, tool calls) into Anthropic's message: text and tool_use content
 * blocks, stop_reason, stop_sequence and usage; or Anthropic's events:
 * message_start, ping, content_block_start / content_block_delta
 * (text_delta, input_json_delta) / content_block_stop per block,
 * message_delta with the stop_reason and usage, message_stop. Errors, the
 * key's 401 included, are in Anthropic's shape (routes.c marks the
 * request; http.c writes them).
 *
 * What was chosen where Anthropic's API is silent or does not fit:
 *   - max_tokens is a ceiling, as Anthropic's documentation says: past the
 *     server's --max-new-tokens it is lowered to it, and the answer may
 *     end at the context's end (stop_reason max_tokens either way), since
 *     agents send 32000 or more whatever the model.
 *   - Which stop sequence ended the answer: named (chat_answer.c says
 *     how), and left out of the text, as Anthropic does.
 *   - usage: input_tokens are the prompt's tokens not served from the
 *     prefix cache, cache_read_input_tokens those that were (Anthropic's
 *     split), cache_creation_input_tokens 0.
 *   - A generation cancelled (the server draining) ends with end_turn.
 *   - thinking: enabled (or adaptive) and disabled map onto the
 *     template's enable_thinking; budget_tokens is checked, not enforced.
 *     A model that reasons answers with a thinking block first (signature
 *     "": a local model signs nothing), streamed as thinking_delta; an
 *     assistant's thinking and redacted_thinking blocks sent back are
 *     taken and left out of the prompt.
 *   - Refused by name: image, document and every other block type but
 *     text, tool_use, tool_result and an assistant's thinking; server tools
 *     (a type other than "custom"); thinking of another type; container,
 *     mcp_servers, context_management, diagnostics, user_profile_id,
 *     workspace_id. Accepted and ignored: metadata, service_tier, speed,
 *     inference_geo, cache_control (the prefix cache needs no marks),
 *     output_config.effort, citations, the anthropic-version header.
 *   - output_config.format (newer SDKs' structured output) is implemented:
 *     its JSON Schema constrains the answer as response_format does.
 *
 * Offers srv_messages_create and srv_messages_count_tokens (internal/
 * api_messages.h) to routes.c; owns the Anthropic request and answer
 * shapes. Touches api_chat.c's srv_chat_prepare and srv_chat_tokens,
 * chat_answer.c's parts,
 * request.c's helpers, http.c's named stream events and bridge.c's
 * srv_gen_submit_made.
 */
#include "internal/api_messages.h"
#include "internal/api_chat.h"
#include "internal/chat_answer.h"
#include "internal/gen.h"
#include "internal/http.h"
#include "internal/request.h"
#include "internal/tool_calls.h"

#include <cjson/cJSON.h>
#include <stdlib.h>
#include <string.h>

/* Anthropic's own limit on messages in one request; the blocks of each are
 * bounded by the body's size (--max-body-bytes), which bounds the chat
 * request made from them too (at most the body's strings again). */
#define MSG_MAX_MESSAGES 100000

/* --- the reader: Anthropic's body as a chat request --------------------------------- */

/* Block k of content (where: "messages[i].content" or "system"), checked
 * as a text block; its text, or NULL after the 400. */
static const char *text_block(srv_conn *c, const cJSON *b, const char *where, int k)
{
    static const char *const fields[] = {"type", "text", "cache_control", "citations", NULL};
    char at[96];
    snprintf(at, sizeof at, "%s[%d]", where, k);
    const char *text = mf_json_str(b, "text");
    if (!srv_req_only_known(c, b, at, fields))
        return NULL;
    if (!text) {
        srv_req_fail(c, 400, "%s.text must be a string", at);
        return NULL;
    }
    return text;
}

/* The type of block k, or NULL after the 400 (not an object, no type). */
static const char *block_type(srv_conn *c, const cJSON *b, const char *where, int k)
{
    const char *type = cJSON_IsObject(b) ? mf_json_str(b, "type") : NULL;
    if (!type)
        srv_req_fail(c, 400, "%s[%d] must be a content block, an object with a \"type\"", where, k);
    return type;
}

static void refuse_block(srv_conn *c, const char *where, int k, const char *type,
                         const char *allowed)
{
    srv_req_fail(c, 400, "%s[%d]: a \"%s\" block is not supported here (%s)", where, k, type,
                 allowed);
}

/* A chat content part holding text, appended to parts. */
static void add_text_part(cJSON *parts, const char *text)
{
    cJSON *part = cJSON_CreateObject();
    cJSON_AddStringToObject(part, "type", "text");
    cJSON_AddStringToObject(part, "text", text);
    cJSON_AddItemToArray(parts, part);
}

/* Text blocks (blocks, where naming them) as chat content parts, appended
 * to parts; false after the 400 (a block of another type, by its name). */
static bool text_parts(srv_conn *c, const cJSON *blocks, const char *where, cJSON *parts)
{
    int k = 0;
    for (const cJSON *b = blocks->child; b; b = b->next, k++) {
        const char *type = block_type(c, b, where, k);
        if (!type)
            return false;
        if (strcmp(type, "text") != 0) {
            refuse_block(c, where, k, type, "only text blocks are");
            return false;
        }
        const char *text = text_block(c, b, where, k);
        if (!text)
            return false;
        add_text_part(parts, text);
    }
    return true;
}

/* Content that is a string or a list of text blocks, as chat content (a
 * string, or a list of text parts); NULL after the 400. */
static cJSON *text_content(srv_conn *c, const cJSON *content, const char *where)
{
    if (cJSON_IsString(content))
        return cJSON_CreateString(content->valuestring);
    if (!cJSON_IsArray(content)) {
        srv_req_fail(c, 400, "%s must be a string or a list of text blocks", where);
        return NULL;
    }
    cJSON *parts = cJSON_CreateArray();
    if (!text_parts(c, content, where, parts)) {
        cJSON_Delete(parts);
        return NULL;
    }
    return parts;
}

/* A tool_result block (messages[i].content[k]) as a tool message, appended
 * to list. */
static bool tool_result(srv_conn *c, const cJSON *b, const char *where, int k, cJSON *list)
{
    static const char *const fields[] = {"type",     "tool_use_id",   "content",
                                         "is_error", "cache_control", NULL};
    char at[96];
    snprintf(at, sizeof at, "%s[%d]", where, k);
    const char *id = mf_json_str(b, "tool_use_id");
    bool is_error = false;
    if (!srv_req_only_known(c, b, at, fields) || !srv_req_get_bool(c, b, "is_error", &is_error))
        return false;
    if (!id) {
        srv_req_fail(c, 400, "%s.tool_use_id must be a string", at);
        return false;
    }
    const cJSON *content = cJSON_GetObjectItemCaseSensitive(b, "content");
    char content_at[112];
    snprintf(content_at, sizeof content_at, "%s.content", at);
    /* absent: a result with nothing to say; is_error has no place in a
     * chat template's tool message, so the content alone goes */
    cJSON *body =
        srv_req_is_null(content) ? cJSON_CreateString("") : text_content(c, content, content_at);
    if (!body)
        return false;
    cJSON *m = cJSON_CreateObject();
    cJSON_AddStringToObject(m, "role", "tool");
    cJSON_AddStringToObject(m, "tool_call_id", id);
    cJSON_AddItemToObject(m, "content", body);
    cJSON_AddItemToArray(list, m);
    return true;
}

/* A tool_use block as one of an assistant message's tool_calls. */
static bool tool_use(srv_conn *c, const cJSON *b, const char *where, int k, cJSON *calls)
{
    static const char *const fields[] = {"type", "id", "name", "input", "cache_control", NULL};
    char at[96];
    snprintf(at, sizeof at, "%s[%d]", where, k);
    const char *id = mf_json_str(b, "id"), *name = mf_json_str(b, "name");
    const cJSON *input = cJSON_GetObjectItemCaseSensitive(b, "input");
    if (!srv_req_only_known(c, b, at, fields))
        return false;
    if (!id || !name || !cJSON_IsObject(input)) {
        srv_req_fail(c, 400,
                     "%s must be {\"type\": \"tool_use\", \"id\", \"name\", \"input\": {...}}", at);
        return false;
    }
    cJSON *call = cJSON_CreateObject();
    cJSON_AddStringToObject(call, "id", id);
    cJSON_AddStringToObject(call, "type", "function");
    cJSON *fn = cJSON_AddObjectToObject(call, "function");
    cJSON_AddStringToObject(fn, "name", name);
    cJSON_AddItemToObject(fn, "arguments", cJSON_Duplicate(input, true));
    cJSON_AddItemToArray(calls, call);
    return true;
}

/* messages[i]'s blocks: text into parts, tool_use into calls (an
 * assistant's), tool_result as tool messages into list (a user's). */
static bool read_blocks(srv_conn *c, const cJSON *blocks, const char *where, bool assistant,
                        cJSON *parts, cJSON *calls, cJSON *list)
{
    int k = 0;
    for (const cJSON *b = blocks->child; b; b = b->next, k++) {
        const char *type = block_type(c, b, where, k);
        bool ok;
        if (!type)
            return false;
        if (strcmp(type, "text") == 0) {
            const char *text = text_block(c, b, where, k);
            ok = text != NULL;
            if (ok)
                add_text_part(parts, text);
        } else if (strcmp(type, "tool_use") == 0 && assistant) {
            ok = tool_use(c, b, where, k, calls);
        } else if ((strcmp(type, "thinking") == 0 || strcmp(type, "redacted_thinking") == 0) &&
                   assistant) {
            ok = true; /* an earlier turn's thinking: templates leave it out (Qwen3's drops it) */
        } else if (strcmp(type, "tool_result") == 0 && !assistant) {
            ok = tool_result(c, b, where, k, list);
        } else {
            refuse_block(c, where, k, type,
                         assistant ? "an assistant's may be text, thinking and tool_use"
                                   : "a user's may be text and tool_result");
            ok = false;
        }
        if (!ok)
            return false;
    }
    return true;
}

/* messages[i] as chat messages appended to list. */
static bool read_message(srv_conn *c, const cJSON *m, int i, cJSON *list)
{
    static const char *const fields[] = {"role", "content", NULL};
    char where[48];
    snprintf(where, sizeof where, "messages[%d]", i);
    if (!cJSON_IsObject(m)) {
        srv_req_fail(c, 400, "%s must be an object", where);
        return false;
    }
    if (!srv_req_only_known(c, m, where, fields))
        return false;
    const char *role = mf_json_str(m, "role");
    if (!role || (strcmp(role, "user") != 0 && strcmp(role, "assistant") != 0)) {
        srv_req_fail(c, 400, "%s.role must be user or assistant%s%s", where, role ? ", not " : "",
                     role ? role : "");
        return false;
    }
    bool assistant = strcmp(role, "assistant") == 0;
    const cJSON *content = cJSON_GetObjectItemCaseSensitive(m, "content");
    cJSON *out = cJSON_CreateObject();
    cJSON_AddStringToObject(out, "role", role);
    if (cJSON_IsString(content)) {
        cJSON_AddStringToObject(out, "content", content->valuestring);
        cJSON_AddItemToArray(list, out);
        return true;
    }
    snprintf(where, sizeof where, "messages[%d].content", i);
    if (!cJSON_IsArray(content)) {
        srv_req_fail(c, 400, "%s must be a string or a list of content blocks", where);
        cJSON_Delete(out);
        return false;
    }
    cJSON *parts = cJSON_CreateArray(), *calls = cJSON_CreateArray();
    bool ok = read_blocks(c, content, where, assistant, parts, calls, list);
    /* the message itself after its tool results (Anthropic puts them first) */
    if (ok && (cJSON_GetArraySize(parts) > 0 || cJSON_GetArraySize(calls) > 0 || assistant)) {
        /* an assistant's calls without text: content "", not null, which
         * templates that join strings (SmolLM2's) cannot render */
        if (cJSON_GetArraySize(parts) > 0 || cJSON_GetArraySize(calls) == 0)
            cJSON_AddItemToObject(out, "content", parts);
        else {
            cJSON_AddStringToObject(out, "content", "");
            cJSON_Delete(parts);
        }
        if (cJSON_GetArraySize(calls) > 0)
            cJSON_AddItemToObject(out, "tool_calls", calls);
        else
            cJSON_Delete(calls);
        cJSON_AddItemToArray(list, out);
        return true;
    }
    cJSON_Delete(parts);
    cJSON_Delete(calls);
    cJSON_Delete(out);
    return ok;
}

/* system and messages into chat's "messages". */
static bool read_messages(srv_conn *c, const cJSON *root, cJSON *chat)
{
    const cJSON *messages = cJSON_GetObjectItemCaseSensitive(root, "messages");
    int n = cJSON_IsArray(messages) ? cJSON_GetArraySize(messages) : 0;
    if (n == 0) {
        srv_req_fail(c, 400, "messages: must be a non-empty list");
        return false;
    }
    if (n > MSG_MAX_MESSAGES) {
        srv_req_fail(c, 400, "messages: %d messages; at most %d", n, MSG_MAX_MESSAGES);
        return false;
    }
    cJSON *list = cJSON_AddArrayToObject(chat, "messages");
    const cJSON *system = cJSON_GetObjectItemCaseSensitive(root, "system");
    if (!srv_req_is_null(system)) {
        cJSON *content = text_content(c, system, "system");
        if (!content)
            return false;
        cJSON *m = cJSON_CreateObject();
        cJSON_AddStringToObject(m, "role", "system");
        cJSON_AddItemToObject(m, "content", content);
        cJSON_AddItemToArray(list, m);
    }
    int i = 0;
    for (const cJSON *m = messages->child; m; m = m->next, i++)
        if (!read_message(c, m, i, list))
            return false;
    return true;
}

/* tools[k] as a function tool appended to out. */
static bool read_tool(srv_conn *c, const cJSON *tool, int k, cJSON *out)
{
    static const char *const fields[] = {"type",         "name",          "description",
                                         "input_schema", "cache_control", NULL};
    char where[32];
    snprintf(where, sizeof where, "tools[%d]", k);
    const char *type = cJSON_IsObject(tool) ? mf_json_str(tool, "type") : NULL;
    if (type && strcmp(type, "custom") != 0) {
        srv_req_fail(c, 400, "%s: server tools (\"%s\") are not supported by this server", where,
                     type);
        return false;
    }
    if (!cJSON_IsObject(tool) || !srv_req_only_known(c, tool, where, fields))
        return cJSON_IsObject(tool) ? false
                                    : (srv_req_fail(c, 400, "%s must be an object", where), false);
    const char *name = mf_json_str(tool, "name");
    const char *description = NULL;
    if (!name || !srv_tool_name_ok(name, strlen(name))) {
        srv_req_fail(c, 400, "%s.name must be 1 to 64 letters, digits, '_', '-' or '.'%s%s", where,
                     name ? ", not " : " (it is missing)", name ? name : "");
        return false;
    }
    const cJSON *schema = cJSON_GetObjectItemCaseSensitive(tool, "input_schema");
    if (!cJSON_IsObject(schema)) {
        srv_req_fail(c, 400, "%s.input_schema must be an object (a JSON Schema)", where);
        return false;
    }
    if (!srv_req_get_string(c, tool, "description", &description))
        return false;
    cJSON *t = cJSON_CreateObject();
    cJSON_AddStringToObject(t, "type", "function");
    cJSON *fn = cJSON_AddObjectToObject(t, "function");
    cJSON_AddStringToObject(fn, "name", name);
    if (description)
        cJSON_AddStringToObject(fn, "description", description);
    cJSON_AddItemToObject(fn, "parameters", cJSON_Duplicate(schema, true));
    cJSON_AddItemToArray(out, t);
    return true;
}

/* Whether tools (chat's, made by read_tool) has one named name. */
static bool has_tool(const cJSON *tools, const char *name)
{
    for (const cJSON *t = tools ? tools->child : NULL; t; t = t->next)
        if (strcmp(mf_json_str(cJSON_GetObjectItemCaseSensitive(t, "function"), "name"), name) == 0)
            return true;
    return false;
}

/* tool_choice {"type": auto | any | tool | none, "name",
 * "disable_parallel_tool_use"} as chat's tool_choice and
 * parallel_tool_calls. */
static bool read_tool_choice(srv_conn *c, const cJSON *tc, cJSON *chat)
{
    static const char *const fields[] = {"type", "name", "disable_parallel_tool_use", NULL};
    const cJSON *tools = cJSON_GetObjectItemCaseSensitive(chat, "tools");
    const char *type = cJSON_IsObject(tc) ? mf_json_str(tc, "type") : NULL;
    bool serial = false;
    if (!type || !srv_req_only_known(c, tc, "tool_choice", fields) ||
        !srv_req_get_bool(c, tc, "disable_parallel_tool_use", &serial)) {
        if (!type)
            srv_req_fail(c, 400,
                         "tool_choice must be {\"type\": \"auto\", \"any\", \"tool\" or \"none\"}");
        return false;
    }
    const char *name = mf_json_str(tc, "name");
    bool forced = strcmp(type, "any") == 0 || strcmp(type, "tool") == 0;
    if (forced && !tools) {
        srv_req_fail(c, 400, "tool_choice: type \"%s\" needs tools", type);
        return false;
    }
    if (strcmp(type, "auto") == 0 || strcmp(type, "none") == 0)
        cJSON_AddStringToObject(chat, "tool_choice", type);
    else if (strcmp(type, "any") == 0)
        cJSON_AddStringToObject(chat, "tool_choice", "required");
    else if (strcmp(type, "tool") == 0 && name && has_tool(tools, name)) {
        cJSON *choice = cJSON_AddObjectToObject(chat, "tool_choice");
        cJSON_AddStringToObject(choice, "type", "function");
        cJSON_AddStringToObject(cJSON_AddObjectToObject(choice, "function"), "name", name);
    } else {
        if (strcmp(type, "tool") == 0)
            srv_req_fail(c, 400, "tool_choice.name must name one of the tools%s%s",
                         name ? ", not " : " (it is missing)", name ? name : "");
        else
            srv_req_fail(c, 400, "tool_choice.type must be auto, any, tool or none, not %s", type);
        return false;
    }
    if (serial)
        cJSON_AddFalseToObject(chat, "parallel_tool_calls");
    return true;
}

/* tools and tool_choice into chat. */
static bool read_tools(srv_conn *c, const cJSON *root, cJSON *chat)
{
    if (!srv_chat_read_tools(c, root, chat, read_tool))
        return false;
    const cJSON *tc = cJSON_GetObjectItemCaseSensitive(root, "tool_choice");
    return srv_req_is_null(tc) || read_tool_choice(c, tc, chat);
}

/* The fields every Messages body may have that this server does not
 * implement, refused by name rather than as unknown. */
static bool refuse_unimplemented(srv_conn *c, const cJSON *root)
{
    static const char *const refused[] = {"container",   "mcp_servers",     "context_management",
                                          "diagnostics", "user_profile_id", "workspace_id"};
    for (size_t i = 0; i < sizeof refused / sizeof *refused; i++)
        if (cJSON_GetObjectItemCaseSensitive(root, refused[i])) {
            srv_req_fail(c, 400, "%s: not supported by this server", refused[i]);
            return false;
        }
    const cJSON *metadata = cJSON_GetObjectItemCaseSensitive(root, "metadata");
    static const char *const metadata_fields[] = {"user_id", NULL};
    const char *user = NULL;
    if (!srv_req_is_null(metadata) &&
        (!cJSON_IsObject(metadata) ||
         !srv_req_only_known(c, metadata, "metadata", metadata_fields) ||
         !srv_req_get_string(c, metadata, "user_id", &user)))
        return cJSON_IsObject(metadata)
                   ? false
                   : (srv_req_fail(c, 400, "metadata: must be an object"), false);
    return true;
}

/* thinking: {"type": "enabled", "budget_tokens": N} (or "adaptive") or
 * {"type": "disabled"}, onto the template's enable_thinking (the variable
 * Qwen3's and SmolLM3's templates read) through chat_template_kwargs.
 * budget_tokens is checked and not enforced: max_tokens bounds the whole
 * answer. */
static bool read_thinking(srv_conn *c, const cJSON *root, cJSON *chat)
{
    static const char *const fields[] = {"type", "budget_tokens", "display", NULL};
    const cJSON *thinking = cJSON_GetObjectItemCaseSensitive(root, "thinking");
    if (srv_req_is_null(thinking))
        return true;
    const char *type = cJSON_IsObject(thinking) ? mf_json_str(thinking, "type") : NULL;
    bool on = type && (strcmp(type, "enabled") == 0 || strcmp(type, "adaptive") == 0);
    if (!on && !(type && strcmp(type, "disabled") == 0)) {
        srv_req_fail(c, 400,
                     "thinking: must be {\"type\": \"enabled\", \"budget_tokens\": N}, "
                     "{\"type\": \"adaptive\"} or {\"type\": \"disabled\"}");
        return false;
    }
    int64_t budget = 0;
    if (!srv_req_only_known(c, thinking, "thinking", fields) ||
        !srv_req_get_int(c, thinking, "budget_tokens", 0, INT32_MAX, &budget, NULL))
        return false;
    cJSON_AddBoolToObject(cJSON_AddObjectToObject(chat, "chat_template_kwargs"), "enable_thinking",
                          on);
    return true;
}

/* The chat request (a new object, the caller's) Anthropic's body root asks
 * for: its messages, tools and tool_choice, after its "model" into
 * a->adapter; NULL after the 400. */
static cJSON *read_chat(srv_conn *c, const cJSON *root, const char *const *fields, srv_req_ask *a)
{
    const char *model = NULL;
    if (!srv_req_only_known(c, root, "the body", fields) || !refuse_unimplemented(c, root) ||
        !srv_req_get_string(c, root, "model", &model))
        return NULL;
    if (!model) {
        srv_req_fail(c, 400, "model: field required");
        return NULL;
    }
    a->adapter = srv_req_adapter_named(c, model);
    cJSON *chat = cJSON_CreateObject();
    if (!chat) {
        srv_req_fail(c, 503, "out of memory");
        return NULL;
    }
    if (!read_messages(c, root, chat) || !read_tools(c, root, chat) ||
        !read_thinking(c, root, chat)) {
        cJSON_Delete(chat);
        return NULL;
    }
    return chat;
}

/* output_config: format {"type": "json_schema", "schema"} keeps the answer
 * inside the schema (the grammar compiler's JSON Schema); effort is a hint
 * for models that reason at length, ignored. */
static bool read_output_config(srv_conn *c, const cJSON *root, srv_req_ask *a)
{
    static const char *const fields[] = {"effort", "format", NULL};
    static const char *const format_fields[] = {"type", "schema", NULL};
    const cJSON *oc = cJSON_GetObjectItemCaseSensitive(root, "output_config");
    if (srv_req_is_null(oc))
        return true;
    if (!cJSON_IsObject(oc)) {
        srv_req_fail(c, 400, "output_config: must be an object");
        return false;
    }
    const cJSON *format = cJSON_GetObjectItemCaseSensitive(oc, "format");
    if (!srv_req_only_known(c, oc, "output_config", fields))
        return false;
    if (srv_req_is_null(format))
        return true;
    const char *type = cJSON_IsObject(format) ? mf_json_str(format, "type") : NULL;
    const cJSON *schema = cJSON_GetObjectItemCaseSensitive(format, "schema");
    if (!type || strcmp(type, "json_schema") != 0 || !cJSON_IsObject(schema)) {
        srv_req_fail(c, 400,
                     "output_config.format must be {\"type\": \"json_schema\", "
                     "\"schema\": {...}}");
        return false;
    }
    return srv_req_only_known(c, format, "output_config.format", format_fields) &&
           srv_req_ask_schema(c, a, schema, "output_config.format.schema");
}

/* max_tokens (required), temperature, top_p, top_k, stop_sequences and
 * output_config. */
static bool read_sampling(srv_conn *c, const cJSON *root, srv_req_ask *a)
{
    bool has_max = false;
    double temperature = 1.0;
    if (!srv_req_get_int(c, root, "max_tokens", 1, INT32_MAX, &a->max_new_tokens, &has_max) ||
        !srv_req_get_number(c, root, "temperature", 0.0, 1.0, &temperature, NULL))
        return false;
    if (!has_max) {
        srv_req_fail(c, 400, "max_tokens: field required");
        return false;
    }
    /* a ceiling: the server's own, and the context's (fill_context) */
    if (a->max_new_tokens > c->s->cfg->max_new_tokens)
        a->max_new_tokens = c->s->cfg->max_new_tokens;
    a->fill_context = true;
    a->n = 1;
    return srv_req_get_sampling(c, root, a, false) &&
           srv_req_get_stops(c, root, "stop_sequences", a) && read_output_config(c, root, a) &&
           srv_req_get_guided(c, root, a);
}

/* --- the writer --------------------------------------------------------------------- */

/* Anthropic's stop_reason for how an answer ended. */
static const char *stop_reason(const srv_chat_end *e)
{
    if (strcmp(e->finish, "tool_calls") == 0)
        return "tool_use";
    if (e->why == ENG_FINISH_LENGTH)
        return "max_tokens";
    return e->why == ENG_FINISH_STOP ? "stop_sequence" : "end_turn";
}

static void add_usage(cJSON *o, const eng_usage *u, int64_t prompt_tokens, int64_t cached)
{
    cJSON *us = cJSON_AddObjectToObject(o, "usage");
    cJSON_AddNumberToObject(us, "input_tokens", (double)(prompt_tokens - cached));
    cJSON_AddNumberToObject(us, "output_tokens", u ? u->generated_tokens : 0);
    cJSON_AddNumberToObject(us, "cache_creation_input_tokens", 0);
    cJSON_AddNumberToObject(us, "cache_read_input_tokens", (double)cached);
}

/* A message object with no content yet (e NULL: stop_reason null). */
static cJSON *message_object(const srv_gen *g, const srv_chat_end *e)
{
    cJSON *o = cJSON_CreateObject();
    cJSON_AddStringToObject(o, "id", g->oai_id);
    cJSON_AddStringToObject(o, "type", "message");
    cJSON_AddStringToObject(o, "role", "assistant");
    cJSON_AddStringToObject(o, "model", g->model_id);
    cJSON_AddArrayToObject(o, "content");
    if (e)
        cJSON_AddStringToObject(o, "stop_reason", stop_reason(e));
    else
        cJSON_AddNullToObject(o, "stop_reason");
    if (e && e->stop)
        cJSON_AddStringToObject(o, "stop_sequence", e->stop);
    else
        cJSON_AddNullToObject(o, "stop_sequence");
    return o;
}

/* A content block beginning: text "", or tool_use with input {} (a
 * whole answer's is filled in at the part's end, a stream's arrives as
 * input_json_delta). */
static cJSON *block_of(srv_chat_part kind, const char *id, const char *name)
{
    cJSON *b = cJSON_CreateObject();
    if (kind == SRV_PART_REASONING) { /* a local model signs nothing: signature "" */
        cJSON_AddStringToObject(b, "type", "thinking");
        cJSON_AddStringToObject(b, "thinking", "");
        cJSON_AddStringToObject(b, "signature", "");
        return b;
    }
    cJSON_AddStringToObject(b, "type", kind == SRV_PART_CALL ? "tool_use" : "text");
    if (kind == SRV_PART_CALL) {
        cJSON_AddStringToObject(b, "id", id);
        cJSON_AddStringToObject(b, "name", name);
        cJSON_AddObjectToObject(b, "input");
    } else {
        cJSON_AddStringToObject(b, "text", "");
    }
    return b;
}

/* A whole answer's blocks, built from its parts. */
typedef struct whole_blocks {
    cJSON *blocks;
} whole_blocks;

static void whole_begin(void *ctx, int index, srv_chat_part kind, const char *id, const char *name)
{
    (void)index;
    whole_blocks *wb = ctx;
    cJSON_AddItemToArray(wb->blocks, block_of(kind, id, name));
}

static void whole_delta(void *ctx, int index, srv_chat_part kind, const char *text, size_t len)
{
    whole_blocks *wb = ctx;
    cJSON *b = cJSON_GetArrayItem(wb->blocks, index);
    if (kind != SRV_PART_CALL) {
        cJSON_ReplaceItemInObjectCaseSensitive(b, kind == SRV_PART_TEXT ? "text" : "thinking",
                                               srv_req_json_text(text, len));
        return;
    }
    /* the call's arguments; a forced call cut short by max_tokens is no
     * whole object, and keeps its input {} */
    cJSON *input = cJSON_ParseWithLength(text, len);
    if (cJSON_IsObject(input))
        cJSON_ReplaceItemInObjectCaseSensitive(b, "input", input);
    else
        cJSON_Delete(input);
}

static void whole_end(void *ctx, int index, srv_chat_part kind)
{
    (void)ctx, (void)index, (void)kind;
}

static const srv_chat_writer whole_writer = {whole_begin, whole_delta, whole_end};

/* The whole answer (srv_gen_shape.whole: may run on a pool thread). */
static cJSON *whole_json(const srv_gen *g, const eng_usage *u)
{
    whole_blocks wb = {.blocks = cJSON_CreateArray()};
    srv_chat_end e = srv_chat_answer_whole(g, &whole_writer, &wb);
    cJSON *o = message_object(g, &e);
    cJSON_ReplaceItemInObjectCaseSensitive(o, "content", wb.blocks);
    add_usage(o, u, u->prompt_tokens, u->cached_tokens);
    return o;
}

/* Send o (consumed) as the event its "type" names. */
static void send_event(srv_conn *c, cJSON *o)
{
    char *text = cJSON_PrintUnformatted(o);
    if (text)
        srv_http_stream_named_event(c, mf_json_str(o, "type"), text, strlen(text));
    free(text);
    cJSON_Delete(o);
}

static cJSON *event_of(const char *type)
{
    cJSON *o = cJSON_CreateObject();
    cJSON_AddStringToObject(o, "type", type);
    return o;
}

/* A stream's writer: ctx is the connection. */
static void stream_begin(void *ctx, int index, srv_chat_part kind, const char *id, const char *name)
{
    cJSON *o = event_of("content_block_start");
    cJSON_AddNumberToObject(o, "index", index);
    cJSON_AddItemToObject(o, "content_block", block_of(kind, id, name));
    send_event(ctx, o);
}

/* text_delta, thinking_delta for a thinking block, or input_json_delta
 * for a tool_use block's input */
static void stream_delta(void *ctx, int index, srv_chat_part kind, const char *text, size_t len)
{
    static const char *const types[] = {[SRV_PART_TEXT] = "text_delta",
                                        [SRV_PART_CALL] = "input_json_delta",
                                        [SRV_PART_REASONING] = "thinking_delta"};
    static const char *const fields[] = {[SRV_PART_TEXT] = "text",
                                         [SRV_PART_CALL] = "partial_json",
                                         [SRV_PART_REASONING] = "thinking"};
    cJSON *o = event_of("content_block_delta");
    cJSON_AddNumberToObject(o, "index", index);
    cJSON *d = cJSON_AddObjectToObject(o, "delta");
    cJSON_AddStringToObject(d, "type", types[kind]);
    cJSON_AddItemToObject(d, fields[kind], srv_req_json_text(text, len));
    send_event(ctx, o);
}

static void stream_end(void *ctx, int index, srv_chat_part kind)
{
    (void)kind;
    cJSON *o = event_of("content_block_stop");
    cJSON_AddNumberToObject(o, "index", index);
    send_event(ctx, o);
}

static const srv_chat_writer stream_writer = {stream_begin, stream_delta, stream_end};

/* message_start (with the prompt's tokens as input_tokens) and a ping,
 * once: the first choice's opened flag says whether they have gone. */
static void stream_start(srv_gen *g, srv_conn *c)
{
    if (g->choices[0].opened)
        return;
    g->choices[0].opened = true;
    cJSON *o = event_of("message_start");
    cJSON *m = message_object(g, NULL);
    add_usage(m, NULL, g->n_parts ? g->parts[0].n_tokens : 0, 0);
    cJSON_AddItemToObject(o, "message", m);
    send_event(c, o);
    send_event(c, event_of("ping"));
}

static void stream_token(srv_gen *g, srv_conn *c, int32_t i, int32_t token, const char *text,
                         size_t len)
{
    (void)i, (void)token, (void)text, (void)len; /* the one choice's whole text is read */
    stream_start(g, c);
    srv_chat_answer_stream(g, false, &stream_writer, c);
}

static void stream_done(srv_gen *g, srv_conn *c, eng_finish why, const eng_usage *u)
{
    (void)why; /* the one choice's own */
    stream_start(g, c);
    srv_chat_end e = srv_chat_answer_stream(g, true, &stream_writer, c);
    cJSON *o = event_of("message_delta");
    cJSON *d = cJSON_AddObjectToObject(o, "delta");
    cJSON_AddStringToObject(d, "stop_reason", stop_reason(&e));
    if (e.stop)
        cJSON_AddStringToObject(d, "stop_sequence", e.stop);
    else
        cJSON_AddNullToObject(d, "stop_sequence");
    add_usage(o, u, u->prompt_tokens, u->cached_tokens);
    send_event(c, o);
    send_event(c, event_of("message_stop"));
    srv_http_stream_end(c);
}

static const srv_gen_shape msg_whole = {.id_prefix = "msg",
                                        .adapter_noun = "model",
                                        .adapter_unknown = SRV_UNKNOWN_MODEL,
                                        .whole = whole_json};
static const srv_gen_shape msg_stream = {.stream = true,
                                         .id_prefix = "msg",
                                         .adapter_noun = "model",
                                         .adapter_unknown = SRV_UNKNOWN_MODEL,
                                         .on_token = stream_token,
                                         .on_done = stream_done};

/* --- the routes --------------------------------------------------------------------- */

/* Fields of a Messages body: the implemented and ignored ones, and those
 * refused by name (refuse_unimplemented). */
#define MSG_REFUSED_FIELDS                                                                         \
    "container", "mcp_servers", "context_management", "diagnostics", "user_profile_id",            \
        "workspace_id"

/* count_tokens' answer: the rendered prompt's tokens. */
static cJSON *count_answer(const char *prompt, cJSON *tokens)
{
    (void)prompt;
    cJSON *o = cJSON_CreateObject();
    cJSON_AddNumberToObject(o, "input_tokens", cJSON_GetArraySize(tokens));
    cJSON_Delete(tokens);
    return o;
}

/* A Messages body read (fields: the ones it may have), then answered:
 * its prompt's tokens counted (count), or generated. */
static void messages_route(srv_conn *c, const char *const *fields, bool count)
{
    if (!srv_gen_ready(c))
        return;
    cJSON *root = srv_req_body_object(c);
    if (!root)
        return;
    srv_req_ask a = {0};
    bool stream = false;
    srv_gen_prompt_maker maker;
    cJSON *chat = read_chat(c, root, fields, &a);
    bool ok =
        chat &&
        (count || (read_sampling(c, root, &a) && srv_req_get_bool(c, root, "stream", &stream))) &&
        srv_chat_prepare(c, chat, &a, &maker);
    if (ok && count)
        srv_chat_tokens(c, a.adapter, maker, count_answer);
    else if (ok && srv_chat_answer_take(c, &a, NULL, NULL))
        srv_gen_submit_made(c, &a, stream ? &msg_stream : &msg_whole, maker);
    else if (ok)
        maker.drop(maker.arg);
    cJSON_Delete(chat);
    srv_req_ask_free(&a);
    cJSON_Delete(root);
}

void srv_messages_create(srv_conn *c, const char *name)
{
    (void)name;
    static const char *const fields[] = {
        "model",       "messages",      "max_tokens",   "system",          "stop_sequences",
        "temperature", "top_p",         "top_k",        "stream",          "tools",
        "tool_choice", "metadata",      "service_tier", "output_config",   "cache_control",
        "speed",       "inference_geo", "thinking",     SRV_GUIDED_FIELDS, MSG_REFUSED_FIELDS,
        NULL};
    messages_route(c, fields, false);
}

void srv_messages_count_tokens(srv_conn *c, const char *name)
{
    (void)name;
    static const char *const fields[] = {"model",    "messages",    "system",           "tools",
                                         "thinking", "tool_choice", MSG_REFUSED_FIELDS, NULL};
    messages_route(c, fields, true);
}

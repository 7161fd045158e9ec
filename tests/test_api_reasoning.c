/*
 * test_api_reasoning.c - reasoning kept apart on the three chat-shaped
 * APIs, end to end: the real binary on the tiny random model
 * (tests/tiny_server.h) with Qwen3's own chat template
 * (tests/fixtures/chat_templates/Qwen-Qwen3-0.6B.jinja), whose <think> and
 * </think> mark the model as one that reasons. The model's text is forced
 * by a guided_regex (vLLM's extension, taken on all three APIs), so the
 * answer is known byte for byte without a trained model.
 *
 * What is pinned: the same forced text is split the same way everywhere:
 * chat completions' message.reasoning_content and content (streamed:
 * delta.reasoning_content then delta.content, joined equal to the whole,
 * no marker's byte in any delta); Messages' thinking block then text block
 * (streamed: thinking_delta, then text_delta); Responses' reasoning item
 * (a reasoning_text part) then message item (streamed:
 * response.reasoning_text.delta, then response.output_text.delta); a
 * thought cut short by max_tokens is all reasoning; chat_template_kwargs reach the template
 * (enable_thinking false renders Qwen3's empty block), and Anthropic's thinking and the Responses
 * API's reasoning.effort map onto the same variable.
 */
#include "tiny_server.h"

/* The tiny model served with tests/fixtures/chat_templates/NAME. */
static void start_with_template(const char *name)
{
    char path[1024], msg[256];
    snprintf(path, sizeof path, "%s/chat_templates/%s", QL_FIXTURES, name);
    char *tpl = NULL;
    size_t len = 0;
    cr_assert_eq(mf_read_file(path, 1 << 20, &tpl, &len, msg, sizeof msg), QL_OK, "%s", msg);
    ts_start(tpl);
    free(tpl);
}

static void setup(void)
{
    start_with_template("Qwen-Qwen3-0.6B.jinja");
}

TestSuite(reasoning, .init = setup, .fini = ts_teardown, .timeout = 300);

/* The forced answer: a thought, then the answer; as a JSON string of a
 * regex (\n a newline; letters and spaces only, so nothing to escape). */
#define THOUGHT_REGEX "\"<think>\\nadd one and one\\n</think>\\n\\nTwo it is\""
#define THOUGHT       "add one and one"
#define ANSWER        "Two it is"

/* obj's string at a path of names (NULL when missing or not a string) */
static const char *str_at(const cJSON *obj, const char *a, const char *b, const char *c)
{
    const cJSON *v = cJSON_GetObjectItemCaseSensitive(obj, a);
    if (b)
        v = cJSON_GetObjectItemCaseSensitive(v, b);
    if (c)
        v = cJSON_GetObjectItemCaseSensitive(v, c);
    return cJSON_IsString(v) ? v->valuestring : NULL;
}

static void no_marker(const char *piece)
{
    cr_assert(!strchr(piece, '<') && !strchr(piece, '>'), "a marker's byte let out: %s", piece);
}

/* --- chat completions -------------------------------------------------------------- */

#define CHAT_BODY(extra)                                                                           \
    "{\"messages\": [{\"role\": \"user\", \"content\": \"1+1?\"}], \"max_tokens\": 64, "           \
    "\"guided_regex\": " THOUGHT_REGEX extra "}"

/* chat's whole answer to body: reasoning_content and content as wanted */
static void chat_split(const char *body, const char *reasoning, const char *content)
{
    cJSON *j = ts_ok("/v1/chat/completions", body);
    const cJSON *m =
        cJSON_GetObjectItem(cJSON_GetArrayItem(cJSON_GetObjectItem(j, "choices"), 0), "message");
    cr_assert_str_eq(sp_str_at(m, "reasoning_content"), reasoning);
    cr_assert_str_eq(sp_str_at(m, "content"), content);
    cJSON_Delete(j);
}

Test(reasoning, chat_answers_carry_reasoning_content_apart_from_the_content)
{
    chat_split(CHAT_BODY(""), THOUGHT, ANSWER);
}

Test(reasoning, chat_streams_send_reasoning_deltas_then_content_deltas)
{
    ts_events ev;
    ts_events_of("/v1/chat/completions", CHAT_BODY(", \"stream\": true"), &ev);
    char reasoning[256] = "", content[256] = "";
    for (int i = 0; i < ev.n; i++) {
        const cJSON *d = cJSON_GetObjectItem(
            cJSON_GetArrayItem(cJSON_GetObjectItem(ev.data[i], "choices"), 0), "delta");
        const char *r = str_at(d, "reasoning_content", NULL, NULL);
        const char *c = str_at(d, "content", NULL, NULL);
        if (r) {
            no_marker(r);
            cr_assert_eq(content[0], 0, "reasoning after content");
            strncat(reasoning, r, sizeof reasoning - strlen(reasoning) - 1);
        }
        if (c) {
            no_marker(c);
            strncat(content, c, sizeof content - strlen(content) - 1);
        }
    }
    cr_assert_str_eq(reasoning, THOUGHT);
    cr_assert_str_eq(content, ANSWER);
    ts_events_free(&ev);
}

Test(reasoning, a_thought_cut_short_is_all_reasoning)
{
    /* "<think>\nadd" is 11 bytes: the byte-level model writes one a token */
    cJSON *j =
        ts_ok("/v1/chat/completions",
              "{\"messages\": [{\"role\": \"user\", \"content\": \"1+1?\"}], \"max_tokens\": "
              "11, \"guided_regex\": " THOUGHT_REGEX "}");
    const cJSON *ch = cJSON_GetArrayItem(cJSON_GetObjectItem(j, "choices"), 0);
    const cJSON *m = cJSON_GetObjectItem(ch, "message");
    cr_assert_str_eq(sp_str_at(ch, "finish_reason"), "length");
    cr_assert_str_eq(sp_str_at(m, "reasoning_content"), "add");
    cr_assert_str_eq(sp_str_at(m, "content"), "");
    cJSON_Delete(j);
}

/* /chat_tokenize's text of a one-message chat request with extra fields */
static char *rendered(const char *extra)
{
    char body[512];
    snprintf(body, sizeof body, "{\"messages\": [{\"role\": \"user\", \"content\": \"hi\"}]%s}",
             extra);
    cJSON *j = ts_ok("/chat_tokenize", body);
    char *text = strdup(sp_str_at(j, "templated_text"));
    cJSON_Delete(j);
    return text;
}

Test(reasoning, chat_template_kwargs_reach_the_template)
{
    char *on = rendered(""),
         *off = rendered(", \"chat_template_kwargs\": {\"enable_thinking\": false}");
    size_t n = strlen(on);
    cr_assert(strstr(on, "<think>") == NULL, "%s", on);
    /* Qwen3 asked not to think: its template closes an empty block */
    cr_assert_eq(strncmp(off, on, n), 0, "%s", off);
    cr_assert_str_eq(off + n, "<think>\n\n</think>\n\n");
    free(on);
    free(off);
    ts_refused("/chat_tokenize",
               "{\"messages\": [{\"role\": \"user\", \"content\": \"hi\"}], "
               "\"chat_template_kwargs\": 1}",
               "chat_template_kwargs");
}

/* --- Messages ---------------------------------------------------------------------- */

#define MSG_BODY(extra)                                                                            \
    "{\"model\": \"tiny\", \"max_tokens\": 64, \"messages\": [{\"role\": \"user\", \"content\": "  \
    "\"1+1?\"}], \"guided_regex\": " THOUGHT_REGEX extra "}"

Test(reasoning, messages_answer_with_a_thinking_block_then_the_text)
{
    cJSON *j = ts_ok("/v1/messages", MSG_BODY(""));
    const cJSON *content = cJSON_GetObjectItem(j, "content");
    cr_assert_eq(cJSON_GetArraySize(content), 2);
    const cJSON *t = cJSON_GetArrayItem(content, 0), *x = cJSON_GetArrayItem(content, 1);
    cr_assert_str_eq(sp_str_at(t, "type"), "thinking");
    cr_assert_str_eq(sp_str_at(t, "thinking"), THOUGHT);
    cr_assert_str_eq(sp_str_at(t, "signature"), "");
    cr_assert_str_eq(sp_str_at(x, "type"), "text");
    cr_assert_str_eq(sp_str_at(x, "text"), ANSWER);
    cr_assert_str_eq(sp_str_at(j, "stop_reason"), "end_turn");
    cJSON_Delete(j);
}

Test(reasoning, messages_stream_thinking_deltas_then_text_deltas)
{
    ts_events ev;
    ts_events_of("/v1/messages", MSG_BODY(", \"stream\": true"), &ev);
    char thinking[256] = "", text[256] = "";
    int blocks = 0;
    for (int i = 0; i < ev.n; i++) {
        const char *type = sp_str_at(ev.data[i], "type");
        if (strcmp(type, "content_block_start") == 0) {
            const char *kind = str_at(ev.data[i], "content_block", "type", NULL);
            cr_assert_str_eq(kind, blocks == 0 ? "thinking" : "text");
            cr_assert_eq(sp_num_at(ev.data[i], "index"), blocks++);
        }
        if (strcmp(type, "content_block_delta") != 0)
            continue;
        const char *dt = str_at(ev.data[i], "delta", "type", NULL);
        const char *piece = str_at(ev.data[i], "delta",
                                   strcmp(dt, "thinking_delta") == 0 ? "thinking" : "text", NULL);
        cr_assert(piece, "%s", dt);
        no_marker(piece);
        strncat(strcmp(dt, "thinking_delta") == 0 ? thinking : text, piece, 200);
    }
    cr_assert_eq(blocks, 2);
    cr_assert_str_eq(thinking, THOUGHT);
    cr_assert_str_eq(text, ANSWER);
    ts_events_free(&ev);
}

/* count_tokens of a one-message body with extra fields */
static int counted(const char *extra)
{
    char body[512];
    snprintf(body, sizeof body,
             "{\"model\": \"tiny\", \"messages\": [{\"role\": \"user\", \"content\": \"hi\"}]%s}",
             extra);
    cJSON *j = ts_ok("/v1/messages/count_tokens", body);
    int n = (int)sp_num_at(j, "input_tokens");
    cJSON_Delete(j);
    return n;
}

Test(reasoning, anthropic_thinking_maps_onto_enable_thinking)
{
    int plain = counted(""), on = counted(", \"thinking\": {\"type\": \"enabled\", "
                                          "\"budget_tokens\": 1024}");
    int off = counted(", \"thinking\": {\"type\": \"disabled\"}");
    /* the byte-level tokenizer: "<think>\n\n</think>\n\n" is 19 tokens */
    cr_assert_eq(on, plain);
    cr_assert_eq(off, plain + 19);
    ts_refused("/v1/messages", MSG_BODY(", \"thinking\": {\"type\": \"sometimes\"}"), "thinking");
    /* an earlier turn's thinking block is taken back (and left out) */
    cJSON *j =
        ts_ok("/v1/messages",
              "{\"model\": \"tiny\", \"max_tokens\": 64, \"messages\": [{\"role\": \"user\", "
              "\"content\": \"1+1?\"}, {\"role\": \"assistant\", \"content\": [{\"type\": "
              "\"thinking\", \"thinking\": \"t\", \"signature\": \"\"}, {\"type\": \"text\", "
              "\"text\": \"2\"}]}, {\"role\": \"user\", \"content\": \"sure?\"}], "
              "\"guided_regex\": " THOUGHT_REGEX "}");
    cJSON_Delete(j);
}

/* --- Responses --------------------------------------------------------------------- */

#define RESP_BODY(extra)                                                                           \
    "{\"model\": \"tiny\", \"input\": \"1+1?\", \"max_output_tokens\": 64, "                       \
    "\"guided_regex\": " THOUGHT_REGEX extra "}"

Test(reasoning, responses_output_a_reasoning_item_then_the_message)
{
    cJSON *j = ts_ok("/v1/responses", RESP_BODY(""));
    const cJSON *out = cJSON_GetObjectItem(j, "output");
    cr_assert_eq(cJSON_GetArraySize(out), 2);
    const cJSON *r = cJSON_GetArrayItem(out, 0), *m = cJSON_GetArrayItem(out, 1);
    cr_assert_str_eq(sp_str_at(r, "type"), "reasoning");
    cr_assert(strncmp(sp_str_at(r, "id"), "rs_", 3) == 0);
    cr_assert(cJSON_IsArray(cJSON_GetObjectItem(r, "summary")));
    const cJSON *part = cJSON_GetArrayItem(cJSON_GetObjectItem(r, "content"), 0);
    cr_assert_str_eq(sp_str_at(part, "type"), "reasoning_text");
    cr_assert_str_eq(sp_str_at(part, "text"), THOUGHT);
    cr_assert_str_eq(sp_str_at(m, "type"), "message");
    part = cJSON_GetArrayItem(cJSON_GetObjectItem(m, "content"), 0);
    cr_assert_str_eq(sp_str_at(part, "text"), ANSWER);
    /* the byte-level model: "<think>\nadd one and one\n</think>\n\n" is 34 tokens, before
     * the content's first */
    const cJSON *usage = cJSON_GetObjectItem(j, "usage");
    cr_assert_eq(sp_num_at(cJSON_GetObjectItem(usage, "output_tokens_details"), "reasoning_tokens"),
                 34);
    /* the next turn sends the output back, reasoning item and all */
    char body[2048];
    char *prev = cJSON_PrintUnformatted(out);
    snprintf(body, sizeof body,
             "{\"model\": \"tiny\", \"max_output_tokens\": 8, \"store\": false, \"input\": "
             "[{\"role\": \"user\", \"content\": \"1+1?\"}, %.*s, {\"role\": \"user\", "
             "\"content\": \"sure?\"}]}",
             (int)strlen(prev) - 2, prev + 1);
    free(prev);
    cJSON_Delete(ts_ok("/v1/responses", body));
    cJSON_Delete(j);
}

Test(reasoning, responses_stream_reasoning_text_deltas_then_output_text_deltas)
{
    ts_events ev;
    ts_events_of("/v1/responses", RESP_BODY(", \"stream\": true"), &ev);
    char reasoning[256] = "", text[256] = "", done[256] = "";
    for (int i = 0; i < ev.n; i++) {
        const char *type = sp_str_at(ev.data[i], "type");
        if (strcmp(type, "response.reasoning_text.delta") == 0) {
            cr_assert_eq(sp_num_at(ev.data[i], "output_index"), 0);
            no_marker(sp_str_at(ev.data[i], "delta"));
            strncat(reasoning, sp_str_at(ev.data[i], "delta"), 200);
        } else if (strcmp(type, "response.output_text.delta") == 0) {
            cr_assert_eq(sp_num_at(ev.data[i], "output_index"), 1);
            no_marker(sp_str_at(ev.data[i], "delta"));
            strncat(text, sp_str_at(ev.data[i], "delta"), 200);
        } else if (strcmp(type, "response.reasoning_text.done") == 0) {
            snprintf(done, sizeof done, "%s", sp_str_at(ev.data[i], "text"));
        }
    }
    cr_assert_str_eq(reasoning, THOUGHT);
    cr_assert_str_eq(done, THOUGHT);
    cr_assert_str_eq(text, ANSWER);
    const cJSON *last = ev.data[ev.n - 1];
    cr_assert_str_eq(sp_str_at(last, "type"), "response.completed");
    const cJSON *out = cJSON_GetObjectItem(cJSON_GetObjectItem(last, "response"), "output");
    cr_assert_str_eq(sp_str_at(cJSON_GetArrayItem(out, 0), "type"), "reasoning");
    ts_events_free(&ev);
}

Test(reasoning, responses_reasoning_effort_maps_onto_enable_thinking)
{
    const char *bodies[] = {
        "{\"model\": \"tiny\", \"input\": \"hi\", \"max_output_tokens\": 1, \"store\": false}",
        "{\"model\": \"tiny\", \"input\": \"hi\", \"max_output_tokens\": 1, \"store\": false, "
        "\"reasoning\": {\"effort\": \"none\"}}",
        "{\"model\": \"tiny\", \"input\": \"hi\", \"max_output_tokens\": 1, \"store\": false, "
        "\"reasoning\": {\"effort\": \"high\", \"summary\": \"auto\"}}"};
    double input[3];
    for (int i = 0; i < 3; i++) {
        cJSON *j = ts_ok("/v1/responses", bodies[i]);
        input[i] = sp_num_at(cJSON_GetObjectItem(j, "usage"), "input_tokens");
        cJSON_Delete(j);
    }
    cr_assert_eq(input[1], input[0] + 19, "effort none: the template's closed empty block");
    cr_assert_eq(input[2], input[0]);
    /* Codex's way: store false, the reasoning asked for as encrypted content (nothing is) */
    cJSON_Delete(ts_ok("/v1/responses",
                       "{\"model\": \"tiny\", \"input\": \"hi\", \"max_output_tokens\": 1, "
                       "\"store\": false, \"include\": [\"reasoning.encrypted_content\"], "
                       "\"reasoning\": {\"effort\": \"medium\", \"summary\": \"auto\"}}"));
    ts_refused(
        "/v1/responses",
        "{\"model\": \"tiny\", \"input\": \"hi\", \"include\": [\"file_search_call.results\"]}",
        "include: only \"reasoning.encrypted_content\"");
}

/* --- GPT-OSS's harmony channels ---------------------------------------------------- */

static void setup_harmony(void)
{
    start_with_template("openai-gpt-oss-120b.jinja");
}

TestSuite(harmony, .init = setup_harmony, .fini = ts_teardown, .timeout = 300);

/* a harmony marker in a regex written as a JSON string: \| is a '|' */
#define H(name) "<\\\\|" name "\\\\|>"
#define HARMONY_REGEX                                                                              \
    "\"" H("channel") "analysis" H("message") "add one and one" H("end")                           \
        H("start") "assistant" H("channel") "final" H("message") "Two it is\""

Test(harmony, the_analysis_channel_is_reasoning_and_the_final_channel_content)
{
    chat_split("{\"messages\": [{\"role\": \"user\", \"content\": \"1+1?\"}], \"max_tokens\": "
               "160, \"guided_regex\": " HARMONY_REGEX "}",
               THOUGHT, ANSWER);
    cJSON *j = ts_ok("/v1/messages",
                     "{\"model\": \"tiny\", \"max_tokens\": 160, \"messages\": [{\"role\": "
                     "\"user\", \"content\": \"1+1?\"}], \"guided_regex\": " HARMONY_REGEX "}");
    const cJSON *content = cJSON_GetObjectItem(j, "content");
    cr_assert_str_eq(sp_str_at(cJSON_GetArrayItem(content, 0), "thinking"), THOUGHT);
    cr_assert_str_eq(sp_str_at(cJSON_GetArrayItem(content, 1), "text"), ANSWER);
    cJSON_Delete(j);
}

Test(harmony, a_streamed_answer_lets_out_no_marker)
{
    ts_events ev;
    ts_events_of(
        "/v1/responses",
        "{\"model\": \"tiny\", \"input\": \"1+1?\", \"max_output_tokens\": 160, \"stream\": "
        "true, \"guided_regex\": " HARMONY_REGEX "}",
        &ev);
    char reasoning[256] = "", text[256] = "";
    for (int i = 0; i < ev.n; i++) {
        const char *type = sp_str_at(ev.data[i], "type");
        bool r = strcmp(type, "response.reasoning_text.delta") == 0;
        if (r || strcmp(type, "response.output_text.delta") == 0) {
            no_marker(sp_str_at(ev.data[i], "delta"));
            strncat(r ? reasoning : text, sp_str_at(ev.data[i], "delta"), 200);
        }
    }
    cr_assert_str_eq(reasoning, THOUGHT);
    cr_assert_str_eq(text, ANSWER);
    ts_events_free(&ev);
}

/* GPT-OSS's template renders a tool as TypeScript in a system message too
 * long for the tiny model's 512 positions beside a call: the call's test
 * serves a template of a few lines that writes harmony's frame (its
 * comment names the markers, as GPT-OSS's own template's text does, which
 * is what load reads) */
#define SHORT_HARMONY                                                                              \
    "{# <|channel|> functions. #}{% for m in messages %}<|start|>{{ m['role'] }}<|message|>"       \
    "{{ m['content'] }}<|end|>{% endfor %}<|start|>assistant"

static void setup_short_harmony(void)
{
    ts_start(SHORT_HARMONY);
}

TestSuite(harmony_calls, .init = setup_short_harmony, .fini = ts_teardown, .timeout = 300);

Test(harmony_calls, a_commentary_message_to_a_function_is_a_tool_call)
{
    cJSON *j = ts_ok("/v1/chat/completions",
                     "{\"messages\": [{\"role\": \"user\", \"content\": \"t?\"}], \"max_tokens\": "
                     "128, \"tools\": [{\"type\": \"function\", \"function\": {\"name\": \"now\", "
                     "\"description\": \"d\", "
                     "\"parameters\": {\"type\": \"object\", \"properties\": {}}}}], "
                     "\"guided_regex\": \"" H("channel") "analysis" H("message") "ask" H("end")
                         H("start") "assistant to=functions\\\\.now" H(
                             "channel") "commentary json" H("message") "\\\\{\\\\}\"}");
    const cJSON *ch = cJSON_GetArrayItem(cJSON_GetObjectItem(j, "choices"), 0);
    const cJSON *m = cJSON_GetObjectItem(ch, "message");
    cr_assert_str_eq(sp_str_at(ch, "finish_reason"), "tool_calls", "%s", cJSON_PrintUnformatted(j));
    cr_assert_str_eq(sp_str_at(m, "reasoning_content"), "ask");
    const cJSON *call = cJSON_GetArrayItem(cJSON_GetObjectItem(m, "tool_calls"), 0);
    cr_assert_str_eq(str_at(call, "function", "name", NULL), "now");
    cr_assert_str_eq(str_at(call, "function", "arguments", NULL), "{}");
    cJSON_Delete(j);
}

Test(harmony, reasoning_effort_reaches_the_template)
{
    cJSON *j =
        ts_ok("/chat_tokenize", "{\"messages\": [{\"role\": \"user\", \"content\": \"hi\"}], "
                                "\"reasoning_effort\": \"high\"}");
    cr_assert(strstr(sp_str_at(j, "templated_text"), "Reasoning: high"));
    cJSON_Delete(j);
}

/* --- markers found in the vocabulary ----------------------------------------------- */

/* The tiny model's tokenizer with Qwen3's two added tokens, <think> (260)
 * and </think> (261), not special (as Qwen3's are), beside its bytes. */
static void add_think_tokens(const char *dir)
{
    char path[700];
    snprintf(path, sizeof path, "%s/tokenizer.json", dir);
    size_t len = 0;
    char *text = test_read_file(path, &len);
    cr_assert(text);
    cJSON *root = sp_json(text);
    free(text);
    cJSON *added = cJSON_GetObjectItem(root, "added_tokens");
    const char *marks[] = {"<think>", "</think>"};
    for (int k = 0; k < 2; k++) {
        cJSON *t = cJSON_CreateObject();
        cJSON_AddNumberToObject(t, "id", 260 + k);
        cJSON_AddStringToObject(t, "content", marks[k]);
        cJSON_AddFalseToObject(t, "special");
        cJSON_AddItemToArray(added, t);
    }
    text = cJSON_Print(root);
    test_write_text(path, text);
    free(text);
    cJSON_Delete(root);
}

static void setup_vocab(void)
{
    tiny_spec spec = tiny_default();
    spec.vocab = 262;
    ts_start_spec(TS_JOIN_TEMPLATE, &spec, add_think_tokens, NULL);
}

TestSuite(vocab, .init = setup_vocab, .fini = ts_teardown, .timeout = 300);

Test(vocab, a_think_token_pair_in_the_vocabulary_marks_reasoning_without_the_template)
{
    char *log = sp_read_log(); /* TS_JOIN_TEMPLATE names no marker: the vocabulary did */
    cr_assert(strstr(log, "reasoning is kept apart (<think>...</think>)"), "%s", log);
    free(log);
    chat_split(CHAT_BODY(""), THOUGHT, ANSWER);
}

/*
 * chat_answer.c - a chat answer as parts (reasoning, text, tool calls), whole or as it
 * streams, for the APIs that write chat's answer in their own shape
 * (api_messages.c, api_responses.c): the writer's half of the one
 * translation layer, as api_chat.c's srv_chat_prepare is the reader's.
 *
 * With tools, the parts come from chat_tools.c, which chat completions
 * uses too (its content and calls, or its stream deltas, turned into
 * parts: a delta's content goes to a text part, a call's first delta
 * begins a call part and its arguments are that part's deltas). Without,
 * the text is one text part. A model that reasons has its reasoning as a
 * first part (bridge.c's split of the text; the text and calls are read
 * from the content after it). An answer with no text or call part has one
 * empty text part, whole or streamed, so that every writer has something
 * to say.
 *
 * Stop sequences: the engine does not say which stop string ended an
 * answer, so without tools the request asks for it to be left in the text
 * (include_stop_str); it is taken off the end here and named, and a
 * stream holds back as many bytes as the longest stop sequence (cut at a
 * character's start, so no delta splits one) until they cannot be one.
 * With tools the text is chat_tools.c's to read as chat's, so the stop
 * string is not in it: the stop sequence is named when only one was
 * given.
 *
 * Offers srv_chat_answer_take, srv_chat_answer_whole and
 * srv_chat_answer_stream (internal/chat_answer.h); owns a request's
 * srv_chat_answer (the generation holds it as g->answer). Touches
 * chat_tools.c's readers, api_openai.c's srv_oai_finish and request.c's
 * errors.
 */
#include "internal/chat_answer.h"
#include "internal/api_openai.h"
#include "internal/chat_tools.h"
#include "internal/request.h"

#include <cjson/cJSON.h>
#include <stdlib.h>
#include <string.h>

struct srv_chat_answer {
    srv_chat_tools *tools; /* chat_tools.c's (NULL: the answer is text), owned */
    void (*tools_drop)(void *tools);
    char *stops[SRV_MAX_STOPS]; /* copies (the body they came from is gone) */
    size_t n_stops, longest_stop;
    bool stop_in_text; /* the engine leaves the stop string in the text */
    /* the stream */
    bool open; /* a part is open */
    srv_chat_part open_kind;
    int parts;    /* parts begun */
    size_t sent;  /* without tools: bytes of the text sent */
    size_t calls; /* call parts begun */
    int reasoned; /* reasoning parts begun (0 or 1) */
    void *writer; /* the API writer's, owned */
    void (*writer_drop)(void *writer);
};

static void answer_drop(void *arg)
{
    srv_chat_answer *st = arg;
    if (st->tools_drop)
        st->tools_drop(st->tools);
    for (size_t i = 0; i < st->n_stops; i++)
        free(st->stops[i]);
    if (st->writer_drop)
        st->writer_drop(st->writer);
    free(st);
}

void *srv_chat_answer_writer(const srv_gen *g)
{
    const srv_chat_answer *st = g->answer;
    return st->writer;
}

bool srv_chat_answer_take(srv_conn *c, srv_req_ask *a, void *writer,
                          void (*writer_drop)(void *writer))
{
    srv_chat_answer *st = calloc(1, sizeof *st);
    if (!st) {
        if (writer_drop)
            writer_drop(writer);
        srv_req_fail(c, 503, "out of memory");
        return false;
    }
    st->writer = writer;
    st->writer_drop = writer_drop;
    st->tools = a->answer;
    st->tools_drop = a->answer_drop;
    a->answer = st;
    a->answer_drop = answer_drop;
    for (size_t i = 0; i < a->n_stops; i++) {
        if (!(st->stops[i] = strdup(a->stops[i]))) {
            srv_req_fail(c, 503, "out of memory");
            return false;
        }
        st->n_stops = i + 1;
        size_t len = strlen(a->stops[i]);
        st->longest_stop = len > st->longest_stop ? len : st->longest_stop;
    }
    st->stop_in_text = st->n_stops > 0 && !st->tools;
    a->include_stop_str = st->stop_in_text;
    return true;
}

/* The answer's content (g's first choice's, less its reasoning: *text,
 * *len bytes, a stop sequence left in it taken off) and, when a stop
 * sequence ended it, which (*stop). */
static void answer_text(const srv_chat_answer *st, const srv_gen *g, const char **text, size_t *len,
                        const char **stop)
{
    const srv_gen_choice *ch = &g->choices[0];
    *stop = NULL;
    *text = srv_gen_content(g, 0, len);
    if (!ch->ended || ch->why != ENG_FINISH_STOP)
        return;
    if (!st->stop_in_text) {
        if (st->n_stops == 1)
            *stop = st->stops[0];
        return;
    }
    for (size_t i = 0; i < st->n_stops; i++) {
        size_t n = strlen(st->stops[i]);
        if (n <= *len && memcmp(*text + *len - n, st->stops[i], n) == 0) {
            *stop = st->stops[i];
            *len -= n;
            return;
        }
    }
}

/* chat's finish with calls: "tool_calls" for an answer that ended by itself */
static srv_chat_end end_of(const srv_chat_answer *st, const srv_gen *g, size_t calls)
{
    const srv_gen_choice *ch = &g->choices[0];
    srv_chat_end e = {.finish = srv_oai_finish(ch->why), .why = ch->why};
    const char *text;
    size_t len;
    answer_text(st, g, &text, &len, &e.stop);
    if (calls > 0 && strcmp(e.finish, "stop") == 0)
        e.finish = "tool_calls";
    return e;
}

/* --- whole ------------------------------------------------------------------- */

static void whole_part(const srv_chat_writer *w, void *ctx, int *index, srv_chat_part kind,
                       const char *id, const char *name, const char *text, size_t len)
{
    w->begin(ctx, *index, kind, id, name);
    if (len > 0)
        w->delta(ctx, *index, kind, text, len);
    w->end(ctx, *index, kind);
    ++*index;
}

srv_chat_end srv_chat_answer_whole(const srv_gen *g, const srv_chat_writer *w, void *ctx)
{
    const srv_chat_answer *st = g->answer;
    int index = 0;
    size_t len;
    const char *text = srv_gen_reasoning(g, 0, &len);
    if (len > 0)
        whole_part(w, ctx, &index, SRV_PART_REASONING, NULL, NULL, text, len);
    if (!st->tools) {
        const char *stop;
        answer_text(st, g, &text, &len, &stop);
        whole_part(w, ctx, &index, SRV_PART_TEXT, NULL, NULL, text, len);
        return end_of(st, g, 0);
    }
    /* chat's message, then its content and calls as parts */
    cJSON *m = cJSON_CreateObject();
    const char *finish = "stop";
    srv_chat_tools_answer(g, st->tools, 0, m, &finish);
    const cJSON *content = cJSON_GetObjectItemCaseSensitive(m, "content");
    const cJSON *calls = cJSON_GetObjectItemCaseSensitive(m, "tool_calls");
    size_t n_calls = (size_t)cJSON_GetArraySize(calls);
    text = cJSON_IsString(content) ? content->valuestring : "";
    if (text[0] || n_calls == 0)
        whole_part(w, ctx, &index, SRV_PART_TEXT, NULL, NULL, text, strlen(text));
    for (const cJSON *call = calls ? calls->child : NULL; call; call = call->next) {
        const cJSON *fn = cJSON_GetObjectItemCaseSensitive(call, "function");
        const char *args = mf_json_str(fn, "arguments");
        whole_part(w, ctx, &index, SRV_PART_CALL, mf_json_str(call, "id"), mf_json_str(fn, "name"),
                   args ? args : "{}", args ? strlen(args) : 2);
    }
    cJSON_Delete(m);
    return end_of(st, g, n_calls);
}

/* --- streamed ---------------------------------------------------------------- */

static void close_part(srv_chat_answer *st, const srv_chat_writer *w, void *ctx)
{
    if (st->open)
        w->end(ctx, st->parts - 1, st->open_kind);
    st->open = false;
}

static void open_part(srv_chat_answer *st, const srv_chat_writer *w, void *ctx, srv_chat_part kind,
                      const char *id, const char *name)
{
    close_part(st, w, ctx);
    w->begin(ctx, st->parts++, kind, id, name);
    st->open = true;
    st->open_kind = kind;
    st->calls += kind == SRV_PART_CALL;
    st->reasoned += kind == SRV_PART_REASONING;
}

static void stream_text(srv_chat_answer *st, const srv_chat_writer *w, void *ctx, const char *text,
                        size_t len, srv_chat_part kind)
{
    if (len == 0)
        return;
    if (!st->open || st->open_kind != kind)
        open_part(st, w, ctx, kind, NULL, NULL);
    w->delta(ctx, st->parts - 1, kind, text, len);
}

/* chat_tools.c's stream deltas (consumed) as parts. */
static void stream_chat_deltas(srv_chat_answer *st, const srv_chat_writer *w, void *ctx,
                               cJSON *deltas)
{
    for (const cJSON *d = deltas ? deltas->child : NULL; d; d = d->next) {
        const cJSON *content = cJSON_GetObjectItemCaseSensitive(d, "content");
        const cJSON *calls = cJSON_GetObjectItemCaseSensitive(d, "tool_calls");
        if (cJSON_IsString(content))
            stream_text(st, w, ctx, content->valuestring, strlen(content->valuestring),
                        SRV_PART_TEXT);
        for (const cJSON *call = calls ? calls->child : NULL; call; call = call->next) {
            const cJSON *fn = cJSON_GetObjectItemCaseSensitive(call, "function");
            const char *id = mf_json_str(call, "id"), *args = mf_json_str(fn, "arguments");
            if (id)
                open_part(st, w, ctx, SRV_PART_CALL, id, mf_json_str(fn, "name"));
            if (args && args[0] && st->open && st->open_kind == SRV_PART_CALL)
                w->delta(ctx, st->parts - 1, SRV_PART_CALL, args, strlen(args));
        }
    }
    cJSON_Delete(deltas);
}

/* Without tools: the text not yet sent, less (until the end) a tail that
 * may still be a stop sequence left in the text. */
static void stream_plain(srv_chat_answer *st, const srv_gen *g, bool end, const srv_chat_writer *w,
                         void *ctx)
{
    const char *stop, *text;
    size_t upto;
    answer_text(st, g, &text, &upto, &stop);
    if (!end && st->stop_in_text) {
        upto = upto > st->longest_stop ? upto - st->longest_stop : 0;
        while (upto > st->sent && ((unsigned char)text[upto] & 0xC0) == 0x80)
            upto--;
    }
    if (upto > st->sent) {
        stream_text(st, w, ctx, text + st->sent, upto - st->sent, SRV_PART_TEXT);
        st->sent = upto;
    }
}

/* The reasoning let out since the last call (reasoning.c holds back what
 * may be its closing marker). */
static void stream_reasoning(srv_chat_answer *st, srv_gen *g, const srv_chat_writer *w, void *ctx)
{
    srv_gen_choice *ch = &g->choices[0];
    size_t len;
    const char *text = srv_gen_reasoning(g, 0, &len);
    if (len > ch->reason_sent) {
        stream_text(st, w, ctx, text + ch->reason_sent, len - ch->reason_sent, SRV_PART_REASONING);
        ch->reason_sent = len;
    }
}

srv_chat_end srv_chat_answer_stream(srv_gen *g, bool end, const srv_chat_writer *w, void *ctx)
{
    srv_chat_answer *st = g->answer;
    const srv_gen_choice *ch = &g->choices[0];
    const char *finish = "stop";
    if (g->reasoning)
        stream_reasoning(st, g, w, ctx);
    if (st->tools)
        stream_chat_deltas(st, w, ctx, srv_chat_tools_stream(g, st->tools, 0, end, &finish));
    else
        stream_plain(st, g, end, w, ctx);
    if (!end)
        return (srv_chat_end){.finish = "stop", .why = ch->why};
    if (st->parts == st->reasoned) /* no text or call: one empty text part */
        open_part(st, w, ctx, SRV_PART_TEXT, NULL, NULL);
    close_part(st, w, ctx);
    return end_of(st, g, st->calls);
}

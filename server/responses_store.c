/*
 * responses_store.c - recent responses of the Responses API kept by id
 * (internal/responses_store.h): a list in order of use, the most recent
 * first, bounded in count and bytes; a put or a get moves an entry to the
 * front, and the back is dropped past the bounds. Lookups walk the list:
 * at most SRV_RESP_STORE_MAX_ENTRIES short string compares, next to a
 * generation's cost nothing. One mutex, since a whole answer is written
 * (and stored) on a pool thread when it is large.
 *
 * Offers srv_resp_store_*; owns the entries and their text. Touches nothing
 * else.
 */
#include "internal/responses_store.h"

#include <pthread.h>
#include <stdlib.h>
#include <string.h>

typedef struct entry {
    char *id, *response, *conversation;
    size_t bytes;
    struct entry *prev, *next;
} entry;

struct srv_resp_store {
    pthread_mutex_t mu;
    entry *head, *tail; /* most and least recently used */
    size_t n, bytes, max_entries, max_bytes;
};

srv_resp_store *srv_resp_store_new(size_t max_entries, size_t max_bytes)
{
    srv_resp_store *st = calloc(1, sizeof *st);
    if (!st)
        return NULL;
    pthread_mutex_init(&st->mu, NULL);
    st->max_entries = max_entries;
    st->max_bytes = max_bytes;
    return st;
}

static void entry_free(entry *e)
{
    free(e->id);
    free(e->response);
    free(e->conversation);
    free(e);
}

static void unlink_entry(srv_resp_store *st, entry *e)
{
    if (e->prev)
        e->prev->next = e->next;
    else
        st->head = e->next;
    if (e->next)
        e->next->prev = e->prev;
    else
        st->tail = e->prev;
    e->prev = e->next = NULL;
    st->n--;
    st->bytes -= e->bytes;
}

static void push_front(srv_resp_store *st, entry *e)
{
    e->prev = NULL;
    e->next = st->head;
    if (st->head)
        st->head->prev = e;
    st->head = e;
    if (!st->tail)
        st->tail = e;
    st->n++;
    st->bytes += e->bytes;
}

static entry *find(const srv_resp_store *st, const char *id)
{
    for (entry *e = st->head; e; e = e->next)
        if (strcmp(e->id, id) == 0)
            return e;
    return NULL;
}

void srv_resp_store_free(srv_resp_store *st)
{
    if (!st)
        return;
    for (entry *e = st->head, *next; e; e = next) {
        next = e->next;
        entry_free(e);
    }
    pthread_mutex_destroy(&st->mu);
    free(st);
}

bool srv_resp_store_put(srv_resp_store *st, const char *id, const char *response,
                        const char *conversation)
{
    size_t bytes = strlen(id) + strlen(response) + strlen(conversation) + sizeof(entry);
    if (!st || bytes > st->max_bytes)
        return false;
    entry *e = calloc(1, sizeof *e);
    if (!e)
        return false;
    e->id = strdup(id);
    e->response = strdup(response);
    e->conversation = strdup(conversation);
    e->bytes = bytes;
    if (!e->id || !e->response || !e->conversation) {
        entry_free(e);
        return false;
    }
    pthread_mutex_lock(&st->mu);
    entry *old = find(st, id);
    if (old) {
        unlink_entry(st, old);
        entry_free(old);
    }
    while (st->tail && (st->n + 1 > st->max_entries || st->bytes + bytes > st->max_bytes)) {
        entry *last = st->tail;
        unlink_entry(st, last);
        entry_free(last);
    }
    push_front(st, e);
    pthread_mutex_unlock(&st->mu);
    return true;
}

bool srv_resp_store_get(srv_resp_store *st, const char *id, char **response, char **conversation)
{
    if (response)
        *response = NULL;
    if (conversation)
        *conversation = NULL;
    if (!st)
        return false;
    pthread_mutex_lock(&st->mu);
    entry *e = find(st, id);
    bool ok = e != NULL;
    if (e) {
        unlink_entry(st, e);
        push_front(st, e);
        if (response)
            ok = ok && (*response = strdup(e->response)) != NULL;
        if (conversation)
            ok = ok && (*conversation = strdup(e->conversation)) != NULL;
    }
    pthread_mutex_unlock(&st->mu);
    if (!ok) {
        if (response) {
            free(*response);
            *response = NULL;
        }
        if (conversation) {
            free(*conversation);
            *conversation = NULL;
        }
    }
    return ok;
}

bool srv_resp_store_delete(srv_resp_store *st, const char *id)
{
    if (!st)
        return false;
    pthread_mutex_lock(&st->mu);
    entry *e = find(st, id);
    if (e)
        unlink_entry(st, e);
    pthread_mutex_unlock(&st->mu);
    if (e)
        entry_free(e);
    return e != NULL;
}

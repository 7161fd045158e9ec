/*
 * pool.c - the worker threads that run the CPU kernels for the engine
 * thread. One job at a time: the engine thread posts a range [0, n), every
 * thread (the engine thread too) takes chunks of it from an atomic counter
 * until none are left, and the call returns when the last chunk is done.
 * Dynamic chunks rather than a fixed split, because rows of a quantized
 * matrix or attention over different context lengths do not cost the same.
 */
#include "engine.h"

#include <pthread.h>
#include <stdatomic.h>
#include <stdlib.h>
#include <unistd.h>

struct eng_pool {
    int n_threads; /* including the caller */
    pthread_t *threads;
    pthread_mutex_t mu;
    pthread_cond_t work, done;
    uint64_t generation; /* bumped for each job */
    int finished;        /* workers done with the current job */
    bool stop;
    /* the current job */
    void (*fn)(void *ctx, int64_t begin, int64_t end);
    void *ctx;
    int64_t n, chunk;
    atomic_int_fast64_t next;
};

static void take_chunks(eng_pool *p)
{
    for (;;) {
        int64_t b = atomic_fetch_add(&p->next, p->chunk);
        if (b >= p->n)
            return;
        int64_t e = b + p->chunk < p->n ? b + p->chunk : p->n;
        p->fn(p->ctx, b, e);
    }
}

static void *worker(void *arg)
{
    eng_pool *p = arg;
    uint64_t seen = 0;
    pthread_mutex_lock(&p->mu);
    for (;;) {
        while (!p->stop && p->generation == seen)
            pthread_cond_wait(&p->work, &p->mu);
        if (p->stop)
            break;
        seen = p->generation;
        pthread_mutex_unlock(&p->mu);
        take_chunks(p);
        pthread_mutex_lock(&p->mu);
        if (++p->finished == p->n_threads - 1)
            pthread_cond_signal(&p->done);
    }
    pthread_mutex_unlock(&p->mu);
    return NULL;
}

int eng_pool_new(eng_pool **out, int n_threads, char *msg, size_t msg_len)
{
    *out = NULL;
    if (n_threads <= 0) {
        long n = sysconf(_SC_NPROCESSORS_ONLN);
        n_threads = n > 0 ? (int)n : 1;
    }
    if (n_threads > 256)
        return qt_fail(msg, msg_len, ENG_EINVAL, "%d threads: at most 256", n_threads);
    eng_pool *p = calloc(1, sizeof *p);
    if (!p)
        return qt_fail(msg, msg_len, ENG_ENOMEM, "out of memory");
    p->n_threads = n_threads;
    pthread_mutex_init(&p->mu, NULL);
    pthread_cond_init(&p->work, NULL);
    pthread_cond_init(&p->done, NULL);
    p->threads = calloc((size_t)n_threads, sizeof *p->threads);
    if (!p->threads) {
        eng_pool_free(p);
        return qt_fail(msg, msg_len, ENG_ENOMEM, "out of memory");
    }
    for (int i = 1; i < n_threads; i++) {
        if (pthread_create(&p->threads[i], NULL, worker, p) != 0) {
            p->n_threads = i; /* the ones started are joined by free */
            eng_pool_free(p);
            return qt_fail(msg, msg_len, ENG_ENOMEM, "cannot start worker thread %d", i);
        }
    }
    *out = p;
    return ENG_OK;
}

void eng_pool_free(eng_pool *p)
{
    if (!p)
        return;
    pthread_mutex_lock(&p->mu);
    p->stop = true;
    pthread_cond_broadcast(&p->work);
    pthread_mutex_unlock(&p->mu);
    for (int i = 1; p->threads && i < p->n_threads; i++)
        pthread_join(p->threads[i], NULL);
    pthread_mutex_destroy(&p->mu);
    pthread_cond_destroy(&p->work);
    pthread_cond_destroy(&p->done);
    free(p->threads);
    free(p);
}

int eng_pool_threads(const eng_pool *p)
{
    return p->n_threads;
}

void eng_pool_run(eng_pool *p, void (*fn)(void *ctx, int64_t begin, int64_t end), void *ctx,
                  int64_t n, int64_t grain)
{
    if (n <= 0)
        return;
    if (grain < 1)
        grain = 1;
    if (!p || p->n_threads == 1 || n <= grain) {
        fn(ctx, 0, n);
        return;
    }
    /* about four chunks per thread: balance without much contention */
    int64_t chunk = (n + 4 * p->n_threads - 1) / (4 * p->n_threads);
    pthread_mutex_lock(&p->mu);
    p->fn = fn;
    p->ctx = ctx;
    p->n = n;
    p->chunk = chunk > grain ? chunk : grain;
    atomic_store(&p->next, 0);
    p->finished = 0;
    p->generation++;
    pthread_cond_broadcast(&p->work);
    pthread_mutex_unlock(&p->mu);
    take_chunks(p);
    pthread_mutex_lock(&p->mu);
    while (p->finished < p->n_threads - 1)
        pthread_cond_wait(&p->done, &p->mu);
    pthread_mutex_unlock(&p->mu);
}

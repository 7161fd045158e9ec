/*
 * pool.c - the worker threads that run the CPU kernels for the engine
 * thread. One job at a time: the engine thread posts a range [0, n), every
 * thread (the engine thread too) takes chunks of it from an atomic counter
 * until none are left, and the call returns when the last chunk is done.
 * Dynamic chunks rather than a fixed split, because rows of a quantized
 * matrix or attention over different context lengths do not cost the same.
 *
 * A decode step posts about eight jobs per layer, each tens of
 * microseconds long, so handing a job over must cost far less than a
 * futex wake-up. Both sides therefore spin on an atomic for a short while
 * (SPIN_NS) before they sleep on a condition variable: during a step the
 * next job or the last chunk arrives within the spin, and an idle server
 * sleeps after SPIN_NS of spinning. The sleepers counters, read and
 * written under the mutex, make the wake-ups lossless.
 *
 * It offers eng_pool_* (runtime.h) and owns its threads; it calls nothing
 * else in engine/runtime/ (base/'s ql_now_ns is its clock).
 */
#include "runtime.h"

#include <pthread.h>
#include <stdatomic.h>
#include <stdlib.h>
#include <unistd.h>

#if defined(__x86_64__) || defined(__i386__)
#include <immintrin.h>
#define cpu_relax() _mm_pause()
#else
#define cpu_relax() ((void)0)
#endif

#define SPIN_NS 200000 /* spin this long for the next job or the last chunk */

struct eng_pool {
    int n_threads; /* including the caller */
    pthread_t *threads;
    pthread_mutex_t mu;
    pthread_cond_t work, done;
    int work_sleepers;               /* workers asleep on work (under mu) */
    bool done_sleeper;               /* the caller asleep on done (under mu) */
    atomic_uint_fast64_t generation; /* bumped for each job */
    atomic_int finished;             /* workers done with the current job */
    atomic_bool stop;
    /* the current job: written before generation is bumped */
    void (*fn)(void *ctx, int64_t begin, int64_t end);
    void *ctx;
    int64_t n, chunk;
    atomic_int_fast64_t next;
};

/* Spins until ready(p, arg) holds or SPIN_NS pass; true when it holds. */
static bool spin_until(eng_pool *p, bool (*ready)(eng_pool *, uint64_t), uint64_t arg)
{
    int64_t deadline = 0;
    for (unsigned i = 0;; i++) {
        if (ready(p, arg))
            return true;
        cpu_relax();
        if ((i & 255) == 255) { /* the clock is read now and then, not every turn */
            int64_t t = ql_now_ns();
            if (!deadline)
                deadline = t + SPIN_NS;
            else if (t > deadline)
                return false;
        }
    }
}

static bool job_posted(eng_pool *p, uint64_t seen)
{
    return atomic_load_explicit(&p->generation, memory_order_acquire) != seen ||
           atomic_load_explicit(&p->stop, memory_order_relaxed);
}

static bool job_done(eng_pool *p, uint64_t unused)
{
    (void)unused;
    return atomic_load_explicit(&p->finished, memory_order_acquire) == p->n_threads - 1;
}

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
    for (;;) {
        if (!spin_until(p, job_posted, seen)) {
            pthread_mutex_lock(&p->mu);
            p->work_sleepers++;
            while (!job_posted(p, seen))
                pthread_cond_wait(&p->work, &p->mu);
            p->work_sleepers--;
            pthread_mutex_unlock(&p->mu);
        }
        if (atomic_load(&p->stop))
            break;
        seen = atomic_load_explicit(&p->generation, memory_order_acquire);
        take_chunks(p);
        if (atomic_fetch_add_explicit(&p->finished, 1, memory_order_acq_rel) ==
            p->n_threads - 2) { /* the last one: wake the caller if it sleeps */
            pthread_mutex_lock(&p->mu);
            if (p->done_sleeper)
                pthread_cond_signal(&p->done);
            pthread_mutex_unlock(&p->mu);
        }
    }
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
        return ql_fail(msg, msg_len, QL_EINVAL, "%d threads: at most 256", n_threads);
    eng_pool *p = calloc(1, sizeof *p);
    if (!p)
        return ql_fail(msg, msg_len, QL_ENOMEM, "out of memory");
    p->n_threads = n_threads;
    pthread_mutex_init(&p->mu, NULL);
    pthread_cond_init(&p->work, NULL);
    pthread_cond_init(&p->done, NULL);
    p->threads = calloc((size_t)n_threads, sizeof *p->threads);
    if (!p->threads) {
        eng_pool_free(p);
        return ql_fail(msg, msg_len, QL_ENOMEM, "out of memory");
    }
    for (int i = 1; i < n_threads; i++) {
        if (pthread_create(&p->threads[i], NULL, worker, p) != 0) {
            p->n_threads = i; /* the ones started are joined by free */
            eng_pool_free(p);
            return ql_fail(msg, msg_len, QL_ENOMEM, "cannot start worker thread %d", i);
        }
    }
    *out = p;
    return QL_OK;
}

void eng_pool_free(eng_pool *p)
{
    if (!p)
        return;
    pthread_mutex_lock(&p->mu);
    atomic_store(&p->stop, true);
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
    p->fn = fn;
    p->ctx = ctx;
    p->n = n;
    p->chunk = chunk > grain ? chunk : grain;
    atomic_store(&p->next, 0);
    atomic_store(&p->finished, 0);
    atomic_fetch_add_explicit(&p->generation, 1, memory_order_acq_rel);
    pthread_mutex_lock(&p->mu);
    if (p->work_sleepers)
        pthread_cond_broadcast(&p->work);
    pthread_mutex_unlock(&p->mu);
    take_chunks(p);
    if (!spin_until(p, job_done, 0)) {
        pthread_mutex_lock(&p->mu);
        p->done_sleeper = true;
        while (!job_done(p, 0))
            pthread_cond_wait(&p->done, &p->mu);
        p->done_sleeper = false;
        pthread_mutex_unlock(&p->mu);
    }
}

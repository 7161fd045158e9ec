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
 * A worker joins a job before it takes chunks, and the caller waits only
 * for the workers that joined: one the kernel has not scheduled (the
 * server's loop thread or a client took its core) is not waited for, and
 * the caller does its share. Waiting for every worker to check in turned
 * each such preemption into a stall of a scheduler slice per job, a few
 * hundred of them per step. The job's word (state) packs its number, a
 * closed flag and the count of workers in it: a worker joins with a
 * compare-and-swap on an open job, so the parameters it reads are that
 * job's, and the caller closes the job (no worker in it) before it returns
 * or writes the next one.
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

/* The job word: number << 32 | CLOSED | workers in it. */
#define CLOSED      (UINT64_C(1) << 31)
#define ACTIVE_MASK (CLOSED - 1)

static uint32_t job_of(uint64_t state)
{
    return (uint32_t)(state >> 32);
}

struct eng_pool {
    int n_threads; /* including the caller */
    pthread_t *threads;
    struct pool_worker *workers; /* [n_threads]: what each thread is handed (0 unused) */
    pthread_mutex_t mu;
    pthread_cond_t work, done;
    int work_sleepers;      /* workers asleep on work (under mu) */
    bool done_sleeper;      /* the caller asleep on done (under mu) */
    _Atomic uint64_t state; /* the current job's word */
    uint32_t jobs;          /* jobs posted (the caller's) */
    atomic_bool stop;
    /* the current job: written while it is closed, before it opens */
    void (*fn)(void *ctx, int worker, int64_t begin, int64_t end);
    void *ctx;
    int64_t n, chunk;
    atomic_int_fast64_t next;
};

/* A worker thread's start argument: its pool and its number (1 and up; the
 * caller of eng_pool_run is 0). */
typedef struct pool_worker {
    eng_pool *pool;
    int index;
} pool_worker;

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

/* An open job other than the one numbered `last` (the worker's last), or stop. */
static bool job_posted(eng_pool *p, uint64_t last)
{
    uint64_t v = atomic_load_explicit(&p->state, memory_order_acquire);
    return (!(v & CLOSED) && job_of(v) != (uint32_t)last) ||
           atomic_load_explicit(&p->stop, memory_order_relaxed);
}

/* No worker is in the current job. */
static bool job_idle(eng_pool *p, uint64_t unused)
{
    (void)unused;
    return (atomic_load_explicit(&p->state, memory_order_acquire) & ACTIVE_MASK) == 0;
}

static void take_chunks(eng_pool *p, int worker)
{
    for (;;) {
        int64_t b = atomic_fetch_add(&p->next, p->chunk);
        if (b >= p->n)
            return;
        int64_t e = b + p->chunk < p->n ? b + p->chunk : p->n;
        p->fn(p->ctx, worker, b, e);
    }
}

/* Join the open job v names: true when this worker is now in it. */
static bool join(eng_pool *p, uint64_t v, uint32_t last)
{
    if ((v & CLOSED) || job_of(v) == last)
        return false;
    return atomic_compare_exchange_weak_explicit(&p->state, &v, v + 1, memory_order_acq_rel,
                                                 memory_order_acquire);
}

static void *worker(void *arg)
{
    const pool_worker *self = arg;
    eng_pool *p = self->pool;
    uint32_t last = 0; /* the last job joined (job numbers start at 1) */
    for (;;) {
        if (!spin_until(p, job_posted, last)) {
            pthread_mutex_lock(&p->mu);
            p->work_sleepers++;
            while (!job_posted(p, last))
                pthread_cond_wait(&p->work, &p->mu);
            p->work_sleepers--;
            pthread_mutex_unlock(&p->mu);
        }
        if (atomic_load(&p->stop))
            break;
        uint64_t v = atomic_load_explicit(&p->state, memory_order_acquire);
        if (!join(p, v, last))
            continue; /* closed meanwhile, or another worker's swap came first */
        last = job_of(v);
        take_chunks(p, self->index);
        uint64_t after = atomic_fetch_sub_explicit(&p->state, 1, memory_order_acq_rel) - 1;
        if ((after & ACTIVE_MASK) == 0) { /* the last one out: wake the caller if it sleeps */
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
    atomic_init(&p->state, CLOSED); /* job 0, closed: nothing to join */
    pthread_mutex_init(&p->mu, NULL);
    pthread_cond_init(&p->work, NULL);
    pthread_cond_init(&p->done, NULL);
    p->threads = calloc((size_t)n_threads, sizeof *p->threads);
    p->workers = calloc((size_t)n_threads, sizeof *p->workers);
    if (!p->threads || !p->workers) {
        eng_pool_free(p);
        return ql_fail(msg, msg_len, QL_ENOMEM, "out of memory");
    }
    for (int i = 1; i < n_threads; i++) {
        p->workers[i] = (pool_worker){p, i};
        if (pthread_create(&p->threads[i], NULL, worker, &p->workers[i]) != 0) {
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
    free(p->workers);
    free(p);
}

int eng_pool_threads(const eng_pool *p)
{
    return p->n_threads;
}

/* eng_pool_run's function, handed on without the worker's number. */
typedef struct plain_job {
    void (*fn)(void *ctx, int64_t begin, int64_t end);
    void *ctx;
} plain_job;

static void plain_chunk(void *ctx, int worker, int64_t begin, int64_t end)
{
    (void)worker;
    const plain_job *j = ctx;
    j->fn(j->ctx, begin, end);
}

void eng_pool_run(eng_pool *p, void (*fn)(void *ctx, int64_t begin, int64_t end), void *ctx,
                  int64_t n, int64_t grain)
{
    plain_job j = {fn, ctx};
    eng_pool_run_workers(p, plain_chunk, &j, n, grain);
}

void eng_pool_run_workers(eng_pool *p,
                          void (*fn)(void *ctx, int worker, int64_t begin, int64_t end), void *ctx,
                          int64_t n, int64_t grain)
{
    if (n <= 0)
        return;
    if (grain < 1)
        grain = 1;
    if (!p || p->n_threads == 1 || n <= grain) {
        fn(ctx, 0, 0, n);
        return;
    }
    /* about four chunks per thread: balance without much contention */
    int64_t chunk = (n + 4 * p->n_threads - 1) / (4 * p->n_threads);
    p->fn = fn;
    p->ctx = ctx;
    p->n = n;
    p->chunk = chunk > grain ? chunk : grain;
    atomic_store_explicit(&p->next, 0, memory_order_relaxed);
    if (++p->jobs == 0)
        p->jobs = 1; /* 0 is no worker's "last" */
    uint64_t open = (uint64_t)p->jobs << 32;
    atomic_store_explicit(&p->state, open, memory_order_release);
    pthread_mutex_lock(&p->mu);
    if (p->work_sleepers)
        pthread_cond_broadcast(&p->work);
    pthread_mutex_unlock(&p->mu);
    take_chunks(p, 0);
    /* every chunk is taken; wait for the workers in the job, then close it
     * (a worker joining meanwhile finds nothing left and leaves) */
    for (;;) {
        if (!spin_until(p, job_idle, 0)) {
            pthread_mutex_lock(&p->mu);
            p->done_sleeper = true;
            while (!job_idle(p, 0))
                pthread_cond_wait(&p->done, &p->mu);
            p->done_sleeper = false;
            pthread_mutex_unlock(&p->mu);
        }
        uint64_t idle = open;
        if (atomic_compare_exchange_strong_explicit(&p->state, &idle, open | CLOSED,
                                                    memory_order_acq_rel, memory_order_acquire))
            return;
    }
}

/*
 * gpu_model_util.h - what the model-level GPU tests share (header-only,
 * static functions beside gpu_test_util.h): a fixture folder loaded as a
 * model, and requests submitted to an engine together and waited for.
 */
#ifndef GPU_MODEL_UTIL_H
#define GPU_MODEL_UTIL_H

#include <pthread.h>

#include "gpu_test_util.h"
#include "model.h"
#include "runtime.h"
#include "scheduler.h"

/* tests/fixtures/<folder> as a model (gpu_fixture_folder's scratch folder,
 * removed once loaded): QL_OK, or the failure with its reason in msg. */
static inline int gpu_fixture_load(eng_model *m, const char *folder, char *msg, size_t msg_len)
{
    char dir[64];
    eng_load_opts o = {.path = dir};
    int rc = gpu_fixture_folder(folder, dir, sizeof dir);
    if (rc == QL_OK)
        rc = eng_model_load(m, &o, msg, msg_len);
    else
        snprintf(msg, msg_len, "cannot make a scratch folder for the fixture %s", folder);
    gpu_fixture_folder_remove(dir);
    return rc;
}

/* gpu_fixture_load, printing why not (the file's verdict names the test). */
static inline int gpu_load(eng_model *m, const char *folder)
{
    char msg[1024];
    int rc = gpu_fixture_load(m, folder, msg, sizeof msg);
    if (rc != QL_OK)
        printf("loading %s: %s\n", folder, msg);
    return rc;
}

/* eng_backend_new with o, printing why not. */
static inline int gpu_backend(eng_backend **b, const eng_model *m, const eng_backend_opts *o)
{
    char msg[1024];
    int rc = eng_backend_new(b, m, o, msg, sizeof msg);
    if (rc != QL_OK)
        printf("making the %s backend: %s\n", eng_device_name(o->device), msg);
    return rc;
}

/* Requests in flight together: each answer's on_done calls gpu_pending_done
 * on the gpu_pending its user points at (the first member of a test's
 * answer struct), and gpu_submit_wait returns once all are done. */
typedef struct gpu_pending {
    pthread_mutex_t *mu;
    pthread_cond_t *cv;
    int *left;
} gpu_pending;

static inline void gpu_pending_done(gpu_pending *p)
{
    pthread_mutex_lock(p->mu);
    (*p->left)--;
    pthread_cond_signal(p->cv);
    pthread_mutex_unlock(p->mu);
}

/* reqs[0..n) submitted together to e, request i with user pending[i] (its
 * on_token and on_done as the caller set them), then waits for every
 * submitted one; the first refusal's code (msg says why), later requests
 * not submitted. */
static inline int gpu_submit_wait(eng_engine *e, const eng_request *reqs,
                                  gpu_pending *const *pending, int n, char *msg, size_t msg_len)
{
    pthread_mutex_t mu = PTHREAD_MUTEX_INITIALIZER;
    pthread_cond_t cv = PTHREAD_COND_INITIALIZER;
    int left = n, rc = QL_OK;
    for (int i = 0; i < n && rc == QL_OK; i++) {
        *pending[i] = (gpu_pending){.mu = &mu, .cv = &cv, .left = &left};
        eng_request r = reqs[i];
        r.user = pending[i];
        rc = eng_engine_submit(e, &r, NULL, msg, msg_len);
        if (rc != QL_OK)
            left -= n - i;
    }
    pthread_mutex_lock(&mu);
    while (left > 0)
        pthread_cond_wait(&cv, &mu);
    pthread_mutex_unlock(&mu);
    return rc;
}

#endif

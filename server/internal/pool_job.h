/*
 * pool_job.h - work off the loop (pool_job.c), prefix srv_pool_: a job run on
 * libuv's thread pool with its completion on the loop, and the
 * connection that waits for it. Included by the .c files of server/ only.
 */
#ifndef QL_SERVER_POOL_JOB_H
#define QL_SERVER_POOL_JOB_H

#include "server.h"

/* A job off the loop: run on a pool thread, then done on the loop. What
 * the job works on is data, whose type only its run and done know; the
 * result every job reports (rc, and msg's sentence or an answer's status)
 * is here, so done can answer with srv_req_fail without a struct of its
 * own. */
typedef struct srv_pool_job {
    uv_work_t req;
    srv_server *s;
    srv_conn *conn;                       /* NULL once the client has gone */
    void (*run)(struct srv_pool_job *w);  /* on a pool thread */
    void (*done)(struct srv_pool_job *w); /* on the loop; frees data */
    void *data;                           /* the job's own, owned: done frees it */
    int rc;
    /* the answer's status when not srv_req_status_of(rc) (0: that) */
    int status;
    char msg[1024];
} srv_pool_job;
/* Queue w (calloc'd by the caller) on the pool: 0, and w is freed after
 * its done has run; or uv_queue_work's error, and w is still the
 * caller's. */
int srv_pool_start(srv_pool_job *w);
/* A srv_pool_job for c carrying data, started: 0, and done frees data;
 * or -1 after answering c (503), data still the caller's. */
int srv_pool_begin(srv_conn *c, void *data, void (*run)(srv_pool_job *w),
                   void (*done)(srv_pool_job *w));

#endif

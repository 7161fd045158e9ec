/*
 * pool_job.h - work off the loop (pool_job.c), prefix srv_pool_: a job run on
 * libuv's thread pool with its completion on the loop, and the
 * connection that waits for it. Included by the .c files of server/ only.
 */
#ifndef QL_SERVER_POOL_JOB_H
#define QL_SERVER_POOL_JOB_H

#include "server.h"

/* Work off the loop (uv thread pool) with a completion on the loop. */
typedef struct srv_pool_job {
    uv_work_t req;
    srv_server *s;
    srv_conn *conn;                       /* NULL once the client has gone */
    void (*run)(struct srv_pool_job *w);  /* on a pool thread */
    void (*done)(struct srv_pool_job *w); /* on the loop */
    int rc;
    char msg[1024];
    char name[160];
    char path[4096];
    float scale;
    bool safe_merge;
    qt_kind into;
    bool has_report;
    lora_report report;
    lora_meta meta;
    /* the answer's status when not srv_req_status_of(rc) (0: that) */
    int status;
    /* what other work carries (its run and done know the type; done frees it) */
    void *job;
} srv_pool_job;
/* Queue w (calloc'd by the caller) on the pool: 0, and w is freed after
 * its done has run; or uv_queue_work's error, and w is still the
 * caller's. */
int srv_pool_start(srv_pool_job *w);
/* A srv_pool_job for c carrying job, started: 0; or -1 after answering c
 * (503), job still the caller's. done must free job. */
int srv_pool_begin(srv_conn *c, void *job, void (*run)(srv_pool_job *w),
                   void (*done)(srv_pool_job *w));

#endif

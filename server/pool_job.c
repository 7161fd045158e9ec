/*
 * pool_job.c - work off the loop: a srv_pool_job's run on one of libuv's pool
 * threads, its done on the loop, then the job freed and the drain checked.
 * The connection waiting on it (c->work) forgets it first, so a done whose
 * client has gone sees conn NULL (bridge.c's srv_gen_conn_gone clears it).
 *
 * Offers srv_pool_start and srv_pool_begin (internal/pool_job.h). Owns a
 * srv_pool_job once started. Touches request.c's errors and, after a
 * piece of work ends, the drain check through s->hooks.
 */
#include "internal/pool_job.h"
#include "internal/http.h"
#include "internal/request.h"

#include <stdlib.h>

static void work_run(uv_work_t *req)
{
    srv_pool_job *w = req->data;
    w->run(w);
}

static void work_after(uv_work_t *req, int status)
{
    (void)status;
    srv_pool_job *w = req->data;
    srv_server *s = w->s;
    if (w->conn)
        w->conn->work = NULL;
    w->done(w);
    free(w);
    s->n_work--;
    s->hooks->check_drained(s);
}

int srv_pool_start(srv_pool_job *w)
{
    w->req.data = w;
    int rc = uv_queue_work(w->s->loop, &w->req, work_run, work_after);
    if (rc == 0)
        w->s->n_work++;
    return rc;
}

int srv_pool_begin(srv_conn *c, void *data, void (*run)(srv_pool_job *w),
                   void (*done)(srv_pool_job *w))
{
    srv_pool_job *w = calloc(1, sizeof *w);
    if (!w) {
        srv_req_fail(c, 503, "out of memory");
        return -1;
    }
    w->s = c->s;
    w->conn = c;
    w->data = data;
    w->run = run;
    w->done = done;
    c->work = w;
    if (srv_pool_start(w) != 0) {
        c->work = NULL;
        free(w);
        srv_req_fail(c, 503, "cannot start the work");
        return -1;
    }
    return 0;
}

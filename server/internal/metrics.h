/*
 * metrics.h - the metrics room (metrics.c), prefix srv_metrics_: a
 * histogram observation and the Prometheus text. Included by the .c files of server/
 * only. The counters themselves are srv_metrics in server.h.
 */
#ifndef QL_SERVER_METRICS_H
#define QL_SERVER_METRICS_H

#include "server.h"

void srv_metrics_observe(srv_hist *h, double seconds);
/* The Prometheus text exposition of everything (allocated, free()). */
char *srv_metrics_render(const srv_server *s, size_t *len);

#endif

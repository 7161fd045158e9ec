/*
 * routes.h - the route table (routes.c), prefix srv_route: what a route's
 * handler is, and the one call that answers a complete request. Included
 * by the .c files of server/ only.
 */
#ifndef QL_SERVER_ROUTES_H
#define QL_SERVER_ROUTES_H

#include "server.h"

/* What a route does with c's request. name is what the {name} in the
 * route's path matched (NULL for a path without one); it lives until the
 * handler returns. */
typedef void srv_route_handler(srv_conn *c, const char *name);

/* Answer c's complete request (c->req): a Host not the server's with 403
 * while the Host rule applies (srv_admin_host_rule_applies; not the health
 * checks); a CORS preflight
 * from a listed origin with 204; without the API key (when one is configured; not for
 * /health, GET / or the admin routes, which have their own token) 401;
 * else the route table's row for its path and method, 405 when the path
 * has rows but not for the method, 404 when it has none. The hooks'
 * on_request. */
void srv_route(srv_conn *c);

#endif

/*
 * admin.h - the admin room (admin.c), prefix srv_admin_: who may use the
 * admin routes, the Host rule against DNS rebinding, and the routes under
 * /admin/. Included by the .c files of server/ only.
 */
#ifndef QL_SERVER_ADMIN_H
#define QL_SERVER_ADMIN_H

#include "routes.h"

/* Whether c may use the admin routes (every path under /admin/, a route or
 * not): the bearer token in force (srv_admin_token), or without one a
 * loopback client whose request a web page cannot have sent (for a change:
 * no foreign Origin, Content-Type: application/json but for DELETE), and
 * a registry to work on; otherwise answered (401, 403 naming the reason,
 * 503). */
bool srv_admin_gate(srv_conn *c);
/* The admin token in force: the configured one, else the one serve.c
 * generated (s->generated_token); NULL: none. */
const char *srv_admin_token(const srv_server *s);
/* Whether the Host rule guards every route (routes.c): while --host is
 * loopback, no admin token is in force, or --allowed-hosts is set. */
bool srv_admin_host_rule_applies(const srv_server *s);
/* Whether c's Host is the server's: absent (no browser omits it),
 * localhost, a 127.x.x.x literal or [::1] with the server's port or none,
 * or listed in --allowed-hosts; otherwise answered 403 naming the Host. */
bool srv_admin_host_allowed(srv_conn *c);
/* Whether addr is an IP literal in 127.0.0.0/8 or ::1 (--host, a Host's
 * name). */
bool srv_admin_is_loopback_address(const char *addr);
srv_route_handler srv_admin_state;   /* GET /admin/state */
srv_route_handler srv_admin_list;    /* GET /admin/adapters */
srv_route_handler srv_admin_load;    /* POST /admin/adapters */
srv_route_handler srv_admin_unload;  /* DELETE /admin/adapters/{name} */
srv_route_handler srv_admin_merge;   /* POST /admin/adapters/{name}/merge */
srv_route_handler srv_admin_unmerge; /* POST /admin/adapters/{name}/unmerge */
srv_route_handler srv_admin_engine;  /* GET /admin/engine: the step gate and what runs */
srv_route_handler srv_admin_pause;   /* POST /admin/engine/pause {"after_steps": N} */
srv_route_handler srv_admin_resume;  /* POST /admin/engine/resume */

#endif

/*
 * console.h - the console room (console.c), prefix srv_console_: the
 * operator's web page (GET /console) and its script and style, compiled
 * into the binary from server/console/ (embed.cmake writes the arrays at
 * build time). Included by the .c files of server/ only.
 */
#ifndef QL_SERVER_CONSOLE_H
#define QL_SERVER_CONSOLE_H

#include "routes.h"

#include <stddef.h>

/* The files' bytes (each followed by a NUL that the length leaves out). */
extern const unsigned char srv_console_html[], srv_console_css[], srv_console_js[];
extern const size_t srv_console_html_len, srv_console_css_len, srv_console_js_len;

/* Whether path is one of the console's (/console, /console.js,
 * /console.css): a browser asks for them without credentials, as a
 * navigation or a subresource, so routes.c does not ask them for the API
 * key; they hold no data of the server's. */
bool srv_console_path(const char *path);
srv_route_handler srv_console_page;     /* GET /console */
srv_route_handler srv_console_js_file;  /* GET /console.js */
srv_route_handler srv_console_css_file; /* GET /console.css */

#endif

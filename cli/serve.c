/*
 * serve.c - `qlserve serve`: parses the server's flags, config file and
 * environment (config/) and runs the HTTP server (server/) until it is told
 * to stop. Owns the parsed configuration for the length of the run.
 */
#include "cli.h"
#include "server.h"

int cli_serve(int argc, char **argv)
{
    char msg[1024];
    cfg_serve c;
    int rc = cfg_parse_serve(argc, argv, &c, msg, sizeof msg);
    if (rc != QL_OK)
        return cli_usage_failure("serve", rc, msg);
    rc = srv_serve(&c);
    cfg_serve_free(&c);
    return rc;
}

/*
 * serve.c - `qlserve serve`: parses the server's flags, config file and
 * environment (config/) and runs the HTTP server (server/) until it is told
 * to stop. Owns the parsed configuration for the length of the run, and
 * the allocator's policy for a long-running process (keep_rss_flat).
 */
#include "cli.h"
#include "server.h"

#ifdef __GLIBC__
#include <malloc.h>
#endif

/*
 * glibc raises its mmap threshold (from 128 KiB up to 32 MiB) each time a
 * block it had mmapped is freed, so after the first unmerge frees a merged
 * weight version, the next versions' tensors (hundreds of KiB to MiBs
 * each) come from the heap and its per-thread arenas instead, where
 * freeing them leaves holes the next merge does not fit: VmRSS climbed 25
 * MiB a minute, idle RssAnon 38 -> 304 MiB after 6 minutes of bench/soak
 * (12 clients, a merge and an unmerge every 10 s), with nothing leaked.
 * Setting the threshold fixes it at glibc's own default and turns the
 * adjustment off: large blocks are always mmapped and go back to the
 * system when freed (the same soak: floor slope 0.7 MiB/min, idle RssAnon
 * 30 -> 63 MiB), at one mmap per large allocation, which the engine makes
 * at load and merge time, not per step.
 */
static void keep_rss_flat(void)
{
#ifdef __GLIBC__
    mallopt(M_MMAP_THRESHOLD, 128 * 1024);
#endif
}

int cli_serve(int argc, char **argv)
{
    char msg[1024];
    cfg_serve c;
    int rc = cfg_parse_serve(argc, argv, &c, msg, sizeof msg);
    if (rc != QL_OK)
        return cli_usage_failure("serve", rc, msg);
    keep_rss_flat();
    rc = srv_serve(&c);
    cfg_serve_free(&c);
    return rc;
}

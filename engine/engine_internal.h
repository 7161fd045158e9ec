/*
 * engine_internal.h - what the files of engine/ share among themselves and
 * nobody else includes.
 */
#ifndef QL_ENGINE_INTERNAL_H
#define QL_ENGINE_INTERNAL_H

#include <stddef.h>
#include <stdint.h>

/*
 * Map a whole file read-only (mapped_file.c). Refuses what is not a regular
 * file, and a file shorter than min_len with "too short for a <format>
 * header (truncated?)". On success *map and *len describe the mapping
 * (munmap it); on error nothing is mapped.
 */
int eng_map_file(const char *path, size_t min_len, const char *format, uint8_t **map, size_t *len,
                 char *msg, size_t msg_len);

#endif

/*
 * pattern.h - internal to adapters/: PEFT's Python regular expressions
 * (target_modules, rank_pattern, alpha_pattern, layers_pattern) as POSIX
 * extended ones (pattern.c), for peft.c's config reader. Not part of
 * lora.h: no caller outside adapters/ needs <regex.h> from it. The tests
 * see it on their include path (tests/CMakeLists.txt), as they see the
 * runtime's internal headers.
 */
#ifndef QL_ADAPTERS_PATTERN_H
#define QL_ADAPTERS_PATTERN_H

#include <regex.h>
#include <stddef.h>

/* What all the patterns of one config may cost regcomp together, in
 * characters once counted repeats are expanded (a rank_pattern may hold a
 * key per module: 80 layers x 7 is 560 keys of ~40 characters): ~1 s of
 * regcomp at the rate measured in pattern.c, where a 16 MiB config of
 * keys each within the per-pattern limits would take minutes. */
#define LORA_PATTERN_CONFIG_COPIES 200000

/*
 * Compile prefix + pattern + suffix as a POSIX extended regex (REG_NOSUB):
 * pattern is in Python's syntax (PEFT's target_modules, rank_pattern),
 * translated (\d, escaped characters in brackets, (?:...)); -1 with why set
 * for a construct POSIX cannot express or counted repeats regcomp would
 * expand without bound. What it costs is taken from *copies_left, the
 * budget of all of one config's patterns (start it at
 * LORA_PATTERN_CONFIG_COPIES); past it, -1. *re is the caller's (regfree)
 * on success only.
 */
int lora_pattern_compile_within(regex_t *re, const char *prefix, const char *pattern,
                                const char *suffix, double *copies_left, char *why, size_t why_len);
/* The same for one pattern alone, with a whole config's budget. Also what
 * tests/test_deploy.c checks Kubernetes schema patterns with (Go RE2: the
 * same syntax for what those use). */
int lora_pattern_compile(regex_t *re, const char *prefix, const char *pattern, const char *suffix,
                         char *why, size_t why_len);

#endif

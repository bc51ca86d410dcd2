/* t.h - the smallest test harness that can work.
 *
 * CHECK(cond, fmt, ...) counts a pass or prints the failure with file:line.
 * Each test binary ends with `return t_done("name");`, which prints
 * "name: N passed, M failed" and returns non-zero if anything failed.
 * tests/run.sh sums the lines into the final "N passed, M failed".
 */
#ifndef TANDEM_T_H
#define TANDEM_T_H

#include <stdio.h>
#include <stdlib.h>
#include <string.h>

static int t_pass, t_fail;

#define CHECK(cond, ...) do { \
    if (cond) { t_pass++; } else { \
        t_fail++; fprintf(stderr, "FAIL %s:%d: ", __FILE__, __LINE__); \
        fprintf(stderr, __VA_ARGS__); fputc('\n', stderr); } } while (0)

/* Fixture directory: $TANDEM_FIXTURES or ../shared/fixtures (CI layout). */
static inline const char *t_fixtures(void) {
    const char *e = getenv("TANDEM_FIXTURES");
    return e && *e ? e : "../shared/fixtures";
}
/* Directory of generated models (tools/gen_mini.py output): $TANDEM_MODELS or build/models. */
static inline const char *t_models(void) {
    const char *e = getenv("TANDEM_MODELS");
    return e && *e ? e : "build/models";
}

static inline int t_done(const char *name) {
    printf("%s: %d passed, %d failed\n", name, t_pass, t_fail);
    return t_fail ? 1 : 0;
}

#endif

/* t.h - the smallest test harness that can work.
 *
 * CHECK(cond, fmt, ...) counts a pass or prints the failure with file:line.
 * Each test binary ends with `return t_done("name");`, which prints
 * "name: N passed, M failed" (plus ", K skipped" when checks were skipped)
 * and returns non-zero if anything failed. tests/run.sh sums the lines into
 * the final "N passed, M failed, K skipped".
 * t_rnd_* draw seeded test data (a state per caller).
 */
#ifndef TANDEM_T_H
#define TANDEM_T_H

#include <stdarg.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

#include "base/xorshift.h"

static int t_pass, t_fail, t_skip;

#define CHECK(cond, ...) do { \
    if (cond) { t_pass++; } else { \
        t_fail++; fprintf(stderr, "FAIL %s:%d: ", __FILE__, __LINE__); \
        fprintf(stderr, __VA_ARGS__); fputc('\n', stderr); } } while (0)

/* ==== The environment ====
 * A test sets or clears every TANDEM_* variable it depends on: the user's
 * shell may export TANDEM_SECRET (README, Serving), TANDEM_API_KEY or
 * TANDEM_LOG_LEVEL for their own servers, and a node the test means to be
 * open would then demand signatures (issue 40: 34 checks of test_logs
 * failed with 401). Before main, every TANDEM_* variable not in this list
 * of the harness's own (what tests/run.sh, tools/test.sh, .ci/run and the
 * tools/cuda_check.sh, mlx_check.sh and arm64_check.sh pass on purpose) is unset, in this process and
 * so in every child it starts; a test that needs one of the others sets it
 * itself (setenv). tests/run.sh does the same for the binaries it runs. */
static const char *const t_env_harness[] = {
    "TANDEM_BIN", "TANDEM_MODELS", "TANDEM_REQUIRE", "TANDEM_ASAN", "TANDEM_FIXTURES", "TANDEM_FIXTURES_PARTIAL",
    "TANDEM_REAL_MODELS", "TANDEM_BACKEND", "TANDEM_PREFILL_BACKEND", "TANDEM_DECODE_BACKEND", "TANDEM_GOLDEN",
    "TANDEM_GOLDEN_DUMP", "TANDEM_GOLDEN_SETS", "TANDEM_HANDOFF_ALL", "TANDEM_HANDOFF_ONLY", "TANDEM_KERNELS", NULL};

extern char **environ;

/* 1 when the variable definition "NAME=value" is the harness's to pass. */
static inline int t_env_is_harness(const char *def) {
    size_t n = strcspn(def, "=");
    if (n >= 12 && !strncmp(def, "TANDEM_CUDA_", 12)) return 1;   /* device choice and kernel knobs (tools/cuda_check.sh) */
    if (n >= 11 && !strncmp(def, "TANDEM_MLX_", 11)) return 1;    /* MLX's device, its stats (tools/mlx_check.sh) */
    for (int i = 0; t_env_harness[i]; i++)
        if (strlen(t_env_harness[i]) == n && !strncmp(def, t_env_harness[i], n)) return 1;
    return 0;
}

__attribute__((constructor, unused)) static void t_env_scrub(void) {
    for (int again = 1; again;) {   /* unsetenv reshapes environ: rescan after each */
        again = 0;
        for (char **e = environ; e && *e; e++) {
            if (strncmp(*e, "TANDEM_", 7) || t_env_is_harness(*e)) continue;
            char name[128];
            size_t n = strcspn(*e, "=");
            if (n >= sizeof name) continue;
            memcpy(name, *e, n);
            name[n] = 0;
            unsetenv(name);
            again = 1;
            break;
        }
    }
}

/* ==== Skips ====
 * One rule for every test: a part that cannot run here prints a line of its
 * own, "skipped: WHAT: WHY", and counts a skip, which tests/run.sh and
 * tools/test.sh add to their totals. Where the environment's TANDEM_REQUIRE
 * (names separated by commas, or "all") names WHAT, the same line is a
 * failure instead: .ci/run sets it for what CI must have (the Python
 * clients, jinja2, the real model, the fixture set), so a missing install
 * there fails rather than skips. */
static inline int t_required(const char *what) {
    const char *e = getenv("TANDEM_REQUIRE");
    if (!e || !*e) return 0;
    size_t n = strlen(what);
    for (const char *p = e; *p;) {
        const char *c = strchr(p, ',');
        size_t len = c ? (size_t)(c - p) : strlen(p);
        if ((len == 3 && !strncmp(p, "all", 3)) || (len == n && !strncmp(p, what, n))) return 1;
        p += len + (c ? 1 : 0);
    }
    return 0;
}

/* Counts a named skip of WHAT (or a failure where TANDEM_REQUIRE names it). */
static inline void t_skip_what(const char *what, const char *fmt, ...) {
    char why[512];
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(why, sizeof why, fmt, ap);
    va_end(ap);
    if (t_required(what)) {
        t_fail++;
        fprintf(stderr, "FAIL required (TANDEM_REQUIRE) %s: %s\n", what, why);
        printf("FAIL required (TANDEM_REQUIRE) %s: %s\n", what, why);
    } else {
        t_skip++;
        printf("skipped: %s: %s\n", what, why);
    }
}

/* ==== CUDA ====
 * A CUDA backend that did not start is a counted skip "cuda" only where the
 * machine has no CUDA device: the backend's message says "no CUDA device
 * found" for exactly that (the driver reports zero devices or
 * cudaErrorNoDevice, or there is no driver library at all; see cu_start in
 * src/backend/cuda/backend_cuda.cu). Anything else (a driver that fails,
 * a device number that does not exist, kernels the GPU cannot run, cuBLAS
 * failing, a build without CUDA asked for it) returns 0: the caller counts
 * a failure with that cause. */
static inline int t_cuda_absent(const char *err) {
    const char *e = err ? strstr(err, "no CUDA device found") : NULL;
    if (!e) return 0;
    while (e > err && e[-1] != '\n') e--;   /* the whole line of the reason */
    t_skip_what("cuda", "no CUDA device on this machine (%.*s)", (int)strcspn(e, "\n"), e);
    return 1;
}

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

/* ==== Fixtures ====
 * The fixture set (models, llama.cpp's outputs, tokenizer vectors; about
 * 200 MB, README "Correctness") is not part of the repository, and the F16
 * models in build/models are generated from it. Where its folder is absent
 * (a fresh clone), a test part that needs one of its files prints
 * "skipped: FILE not found (set TANDEM_FIXTURES)" on a line of its own and
 * counts a skip; everything else runs. Where the folder is there, a missing
 * file is not skipped: the test goes on and fails on it, as it should,
 * unless TANDEM_FIXTURES_PARTIAL=1 says the folder holds part of the set on
 * purpose (tools/cuda_pack.sh's copy for a GPU machine: the quantized
 * models are too large to travel with it). */
static inline int t_fixtures_present(void) {
    struct stat st;
    return !stat(t_fixtures(), &st) && S_ISDIR(st.st_mode);
}

static inline int t_fixtures_partial(void) {
    const char *e = getenv("TANDEM_FIXTURES_PARTIAL");
    return e && !strcmp(e, "1");
}

/* 1: use path. 0: path is missing and the fixture set is absent or partial (skip printed). */
static inline int t_need(const char *path) {
    if (!access(path, R_OK) || (t_fixtures_present() && !t_fixtures_partial())) return 1;
    t_skip_what("fixtures", "%s not found (%s)", path,
                t_fixtures_present() ? "TANDEM_FIXTURES_PARTIAL: a partial fixture set" : "set TANDEM_FIXTURES");
    return 0;
}

/* FIXTURES/rel into buf. Where the fixture set is absent, the files the
 * repository carries stand in for it: models/stories260K.gguf is
 * assets/stories260K.gguf (the same bytes), and tests/data/fixtures/ holds
 * stories260K's goldens under their fixture-set names (tests/data/README.md). */
static inline const char *t_fixture_path(char *buf, size_t cap, const char *rel) {
    if (t_fixtures_present())
        snprintf(buf, cap, "%s/%s", t_fixtures(), rel);
    else if (!strcmp(rel, "models/stories260K.gguf"))
        snprintf(buf, cap, "assets/stories260K.gguf");
    else {
        snprintf(buf, cap, "tests/data/fixtures/%s", rel);
        if (access(buf, R_OK)) snprintf(buf, cap, "%s/%s", t_fixtures(), rel);
    }
    return buf;
}

/* t_need for every path of a NULL-terminated list: all, or skip. */
static inline int t_need_all(const char *const *paths) {
    int ok = 1;
    for (int i = 0; paths[i]; i++) ok &= t_need(paths[i]);
    return ok;
}

/* The real SmolLM2-135M-Instruct Q4_1 model that tools/models.sh fetches
 * into $TANDEM_REAL_MODELS (default build/models/real): its path in buf, or
 * NULL after a skip named "smollm2". */
static inline const char *t_smollm2(char *buf, size_t cap) {
    const char *d = getenv("TANDEM_REAL_MODELS");
    snprintf(buf, cap, "%s/SmolLM2-135M-Instruct.Q4_1.gguf", d && *d ? d : "build/models/real");
    if (!access(buf, R_OK)) return buf;
    t_skip_what("smollm2", "%s not found (tools/models.sh fetches it)", buf);
    return NULL;
}

/* ==== Random test data ====
 *
 * Seeded generators, the state the caller's (no global): a fixed seed gives
 * the same values on every machine and every run, so a tolerance measured on
 * a test's data stays measured. xorshift64 (base/xorshift.h, shifts 13, 7, 17);
 * the seed must not be 0 (0 stays 0). */
static inline uint64_t t_rnd_u64(uint64_t *state) { return xorshift64_next(state); }

/* 32 of its bits (16..47). */
static inline uint32_t t_rnd_u32(uint64_t *state) { return xorshift64_u32(state); }

/* Uniform in [0, 1) from its top 53 bits. */
static inline double t_rnd_unit(uint64_t *state) { return (double)(t_rnd_u64(state) >> 11) * 0x1p-53; }

/* Uniform between lo and hi from its top 24 bits (a float's precision). */
static inline float t_rnd_float(uint64_t *state, float lo, float hi) {
    return lo + (hi - lo) * (float)((t_rnd_u64(state) >> 40) / 16777216.0);
}

/* xorshift32 (shifts 13, 17, 5), the generator test_quant's error bounds and
 * test_backend_ops' KV bit patterns were written against: kept so that their
 * data stay the same. */
static inline uint32_t t_rnd32(uint32_t *state) { return xorshift32_next(state); }

/* The summary line. A binary that made no check and counted no skip has
 * tested nothing: that is a failure, not a pass. */
static inline int t_done(const char *name) {
    if (!t_pass && !t_fail && !t_skip) {
        printf("FAIL %s: no check ran and no skip was counted\n", name);
        t_fail = 1;
    }
    if (t_skip) printf("%s: %d passed, %d failed, %d skipped\n", name, t_pass, t_fail, t_skip);
    else printf("%s: %d passed, %d failed\n", name, t_pass, t_fail);
    return t_fail ? 1 : 0;
}

#endif

/* cliopt.h - option parsing, usage and progress helpers shared by
 * every `tandem` subcommand.
 *
 * Conventions (README "Command line"):
 *   - `--help` / `-h` on any subcommand prints its usage on stdout, exit 0;
 *   - a bad option or value prints one line naming the option and the valid
 *     range on stderr, exit 2 (usage error);
 *   - a failure at run time (a model that cannot be opened, a server that
 *     does not answer) exits 1.
 */
#ifndef TANDEM_CLIOPT_H
#define TANDEM_CLIOPT_H

#include <stddef.h>
#include <stdint.h>
#include <stdio.h>

#include "base/version.h"

/* Exit statuses of every subcommand. */
#define CLI_EXIT_OK 0
#define CLI_EXIT_FAIL 1     /* a run-time failure */
#define CLI_EXIT_USAGE 2    /* a bad command line */

/* ==== Values ==== */

/* Each parses `v` (the value after option `opt`) into *out when it is a
 * whole number (a finite float) within [lo, hi]; else prints
 * "CMD: OPT: V is out of range [LO, HI]" (or "needs a value" / "needs a
 * number") on stderr and returns -1. cmd names the subcommand ("tandem run"). */
int cliopt_int(const char *cmd, const char *opt, const char *v, long lo, long hi, int *out);
int cliopt_float(const char *cmd, const char *opt, const char *v, double lo, double hi, float *out);
int cliopt_double(const char *cmd, const char *opt, const char *v, double lo, double hi, double *out);
int cliopt_u64(const char *cmd, const char *opt, const char *v, uint64_t lo, uint64_t hi, uint64_t *out);
/* A string value: NULL with "needs a value" when v is NULL. */
int cliopt_str(const char *cmd, const char *opt, const char *v, const char **out);
/* One of a NULL-terminated list of names; *out gets its index. */
int cliopt_choice(const char *cmd, const char *opt, const char *v, const char *const *names, int *out);

/* --backend NAME: "cpu", "cuda" or "mlx", else "CMD: --backend: 'x' is not
 * one of cpu|cuda|mlx"; *out gets v. */
int cliopt_backend(const char *cmd, const char *v, const char **out);
/* The usage lines of --backend and --device on f, option column `width` wide. */
void cliopt_usage_backend(FILE *f, int width);

/* 1 for -h / --help. */
int cliopt_is_help(const char *a);
/* 1 when any of argv[0..argc) is -h / --help. */
int cliopt_wants_help(int argc, char **argv);

/* ==== Lists ==== */

/* "A,B,C" (the value after `opt`): 1..max items separated by single commas,
 * each within [lo, hi] (a whole number for _int_list, a finite number for
 * _double_list, one of the NULL-terminated names for _choice_list, whose
 * *out gets indices). 0 with out[0..*n) filled; else -1 with out and *n
 * untouched and one line on stderr naming the option and the range: "CMD:
 * OPT: X is out of range [LO, HI]" for an item out of range (or past a long),
 * "CMD: OPT: 'V' is not a list of at most MAX whole numbers in [LO, HI]" for
 * an empty list or item (",", "1,,2", "1,"), too many items, or one that is
 * not a number. max is at most CLIOPT_LIST_MAX. */
#define CLIOPT_LIST_MAX 64
int cliopt_int_list(const char *cmd, const char *opt, const char *v, long lo, long hi, int *out, int max, int *n);
int cliopt_double_list(const char *cmd, const char *opt, const char *v, double lo, double hi, double *out, int max,
                       int *n);
int cliopt_choice_list(const char *cmd, const char *opt, const char *v, const char *const *names, int *out, int max,
                       int *n);

/* ==== Input ==== */

/* A text file read whole (a prompt's `-f PATH`, a rubric, a key), PATH "-"
 * meaning stdin; at most max bytes, more is refused unread, never cut.
 * NUL-terminated, caller frees; NULL with a message (errno EFBIG when the
 * file is longer than max). */
char *cliopt_read_text(const char *path, size_t max, size_t *len, char *err, size_t errlen);

/* The shared node secret from FILE (or the environment's TANDEM_SECRET when
 * file is NULL), at most 4 KiB, trailing whitespace stripped; an empty one is
 * refused. 0 with *out malloc'd (the caller frees it), or -1 with a message. */
int cliopt_load_secret(const char *file, char **out, size_t *len, char *err, size_t errlen);

/* The rule every shared secret meets (cliopt_load_secret applies it; the
 * router's config "secret" too): at least CLIOPT_SECRET_MIN_BYTES bytes once
 * decoded, judged by the smallest alphabet holding all of its characters:
 * hex digits only count 4 bits a character (`openssl rand -hex 32`: 64
 * characters, 32 bytes), the base64/base64url alphabet 6 bits
 * (`openssl rand -base64 32`: 44 characters), anything else 8 bits; and at
 * least CLIOPT_SECRET_MIN_DISTINCT distinct characters, none of them more
 * than a quarter of the whole (no "aaaa...", no "abababab..."). 0, or -1
 * with a message saying how to make one (docs/wire-protocol.md 5.4). */
#define CLIOPT_SECRET_MIN_BYTES 32
#define CLIOPT_SECRET_MIN_DISTINCT 8
int cliopt_check_secret(const char *s, size_t n, char *err, size_t errlen);

/* HOST:PORT (HOST may be [IPv6] or empty for loopback) whose PORT is a
 * decimal number within 1..65535, or 0 too when allow_zero (a listen
 * address: any free port). Ports outside the range used to wrap modulo
 * 65536 in getaddrinfo. 0, or -1 with "WHAT: port P of 'ADDR' is not
 * within 1-65535" (what names the option). */
int cliopt_check_hostport(const char *what, const char *addr, int allow_zero, char *err, size_t errlen);

/* ==== Signals ==== */

/* Makes SIGINT and SIGTERM set the flag returned (no SA_RESTART: blocking
 * calls wake up) and ignores SIGPIPE (a peer that hangs up is an error
 * return, not a death): what every server role does at start-up. */
volatile int *cliopt_stop_on_signals(void);

/* ==== Progress ==== */

/* Progress of a stage that may take seconds, on stderr. On a terminal one
 * line is redrawn (at most every 100 ms); otherwise a line is written at each
 * tenth of the way, and only once the stage has run two seconds, so that
 * quick stages and logs stay quiet; a terminal sees nothing of a stage
 * shorter than half a second. */
typedef struct {
    char label[64];
    uint64_t total;
    double t0, last_draw;
    int tty, last_tenth, drawn, quiet;
} cliopt_progress;

void cliopt_progress_begin(cliopt_progress *p, const char *label, uint64_t total, int quiet);
void cliopt_progress_update(cliopt_progress *p, uint64_t done);
/* Ends the line; prints "LABEL: done in S s" when anything was drawn or the
 * stage took two seconds. */
void cliopt_progress_end(cliopt_progress *p);
/* A model_opts.on_load callback; ud is a cliopt_progress. */
void cliopt_progress_steps(void *ud, int done, int total);

#endif

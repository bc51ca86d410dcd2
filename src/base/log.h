/* log.h - the one log format of every server role (docs/router.md, Logs).
 *
 * Every line a server writes to stderr is
 *
 *   2026-11-23T11:34:20.123Z INFO router req=ab12cd34 message key=value ...
 *
 * UTC time to the millisecond, the level (ERROR, WARN, INFO, DEBUG), the
 * role of the process (router, prefill, decode, local, cli), the request id
 * (8 lowercase hex digits, or "-" for lines about no request) and the
 * message. The message goes through logsafe_escape: text that came from the
 * network cannot forge a line or drive a terminal. A line is one write(2)
 * under a lock, so lines of concurrent threads never interleave.
 *
 * Request ids: the router draws one per request and sends it to the decode
 * node in the X-Request-Id header; the decode node puts it in the low 32
 * bits of the wire request id of its handoff (handoff_set_log_id), so the
 * prefill node logs the same id. A node called directly draws its own.
 */
#ifndef TANDEM_LOG_H
#define TANDEM_LOG_H

#include <stddef.h>
#include <stdint.h>

/* C linkage for the CUDA backend, which nvcc compiles as C++ */
#ifdef __cplusplus
extern "C" {
#endif

enum log_level { LOGL_ERROR = 0, LOGL_WARN, LOGL_INFO, LOGL_DEBUG };

#define LOG_ID_CHARS 8              /* a request id: 32 bits in hex */
#define LOG_LEVEL_NAMES "error, warn, info, debug"

/* ==== Configuration ==== */

/* "error" | "warn" | "info" | "debug" (any case) -> *out; 0, or -1. */
int log_level_parse(const char *s, enum log_level *out);
void log_set_level(enum log_level l);
int log_enabled(enum log_level l);
/* The role named on every line ("router", "prefill", ...; default "cli"). */
void log_set_role(const char *role);

/* Takes `--log-level LEVEL` out of argv (moving the rest down, *argc
 * shrinks) and applies it; without the option, env TANDEM_LOG_LEVEL; else
 * info. 0, or -1 with a message naming the valid values. */
int log_cli_take(int *argc, char **argv, char *err, size_t errlen);

/* ==== Request ids ==== */

/* A fresh non-zero random id. */
uint32_t log_id_new(void);
/* id as 8 hex digits ("-" for 0) into out (LOG_ID_CHARS + 1 bytes). */
void log_id_format(uint32_t id, char *out);
/* Exactly 8 hex digits, not all zero -> *id; 0, or -1. */
int log_id_parse(const char *s, uint32_t *id);

/* ==== Lines ==== */

/* One line at level l for request id req (NULL or "" = "-"); nothing when
 * the level is off. */
void log_line(enum log_level l, const char *req, const char *fmt, ...) __attribute__((format(printf, 3, 4)));
void log_error(const char *req, const char *fmt, ...) __attribute__((format(printf, 2, 3)));
void log_warn(const char *req, const char *fmt, ...) __attribute__((format(printf, 2, 3)));
void log_info(const char *req, const char *fmt, ...) __attribute__((format(printf, 2, 3)));
void log_debug(const char *req, const char *fmt, ...) __attribute__((format(printf, 2, 3)));

/* ==== Rate limits ==== */

/* At most `burst` lines per `window_ms`; the caller serialises calls (its
 * own lock). Zero-initialised state starts a window at the first call. */
typedef struct {
    double window_ms;
    int burst;
    double t0;              /* start of the current window */
    int n;                  /* lines let through in it */
    unsigned long dropped;  /* lines refused since the last one let through */
} log_limit;

/* 1 when a line may go out at now_ms, with *dropped = lines refused since
 * the previous one that went out (to say so); 0 when it must not. */
int log_limit_take(log_limit *l, double now_ms, unsigned long *dropped);

/* "refused status=N error=MSG" at WARN for a request turned away before it
 * was served, at most LOG_REFUSED_PER_S (50) lines a second (log.c): a
 * flood of bad requests cannot grow the log without bound. */
void log_refused(const char *req, int status, const char *msg);

#ifdef __cplusplus
}
#endif

#endif

/* log.c - one log line format for every server role (see log.h). */
#include "base/log.h"

#include <errno.h>
#include <pthread.h>
#include <stdarg.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <strings.h>
#include <time.h>
#include <unistd.h>

#include "base/logsafe.h"
#include "base/platform.h"

/* A message longer than this is cut: the router's per-request line with a
 * long upstream error is about 1 KB. */
#define LOG_MSG_MAX 2048
/* Escaping can grow a message (a control byte becomes \xNN): room for the
 * escaped message and the prefix; logsafe_escape cuts at a whole escape. */
#define LOG_LINE_MAX 4096

/* ==== State ==== */

static atomic_int log_level_now = LOGL_INFO;
static char log_role[16] = "cli";
static pthread_mutex_t log_mu = PTHREAD_MUTEX_INITIALIZER;

static const char *const log_level_name[] = { "ERROR", "WARN", "INFO", "DEBUG" };

/* ==== Configuration ==== */

int log_level_parse(const char *s, enum log_level *out) {
    static const char *const names[] = { "error", "warn", "info", "debug" };
    for (int i = 0; s && i < 4; i++)
        if (!strcasecmp(s, names[i])) { *out = (enum log_level)i; return 0; }
    return -1;
}

void log_set_level(enum log_level l) { atomic_store(&log_level_now, (int)l); }

int log_enabled(enum log_level l) { return (int)l <= atomic_load(&log_level_now); }

void log_set_role(const char *role) { snprintf(log_role, sizeof log_role, "%s", role ? role : "cli"); }

int log_cli_take(int *argc, char **argv, char *err, size_t errlen) {
    const char *v = NULL, *from = "--log-level";
    int found = 0;
    for (int i = 0; i < *argc;) {
        int take = 0;
        if (!strcmp(argv[i], "--log-level")) { v = i + 1 < *argc ? argv[i + 1] : NULL; take = v ? 2 : 1; }
        else if (!strncmp(argv[i], "--log-level=", 12)) { v = argv[i] + 12; take = 1; }
        if (!take) { i++; continue; }
        found = 1;
        memmove(argv + i, argv + i + take, sizeof *argv * (size_t)(*argc - i - take));
        *argc -= take;
        argv[*argc] = NULL;   /* keep argv NULL-terminated like the original */
        if (!v) break;
    }
    if (!found && (v = getenv("TANDEM_LOG_LEVEL")) && *v) from = "TANDEM_LOG_LEVEL";
    else if (!found) v = "info";
    enum log_level l;
    if (log_level_parse(v, &l)) {
        snprintf(err, errlen, "%s must be one of %s (got \"%.40s\")", from, LOG_LEVEL_NAMES, v ? v : "");
        return -1;
    }
    log_set_level(l);
    return 0;
}

/* ==== Request ids ==== */

uint32_t log_id_new(void) {
    static atomic_uint fallback;
    uint32_t id = 0;
    while (id == 0) {
        if (plat_random(&id, sizeof id, 1)) {
            /* no entropy yet (early boot): time and a counter, mixed (splitmix32-like) */
            struct timespec ts;
            clock_gettime(CLOCK_REALTIME, &ts);
            uint32_t x = (uint32_t)ts.tv_nsec ^ (uint32_t)ts.tv_sec * 2654435761u ^ atomic_fetch_add(&fallback, 0x9e3779b9u);
            x ^= x >> 16; x *= 0x85ebca6bu; x ^= x >> 13; x *= 0xc2b2ae35u; x ^= x >> 16;
            id = x;
        }
    }
    return id;
}

void log_id_format(uint32_t id, char *out) {
    if (id) snprintf(out, LOG_ID_CHARS + 1, "%08x", id);
    else snprintf(out, LOG_ID_CHARS + 1, "-");
}

int log_id_parse(const char *s, uint32_t *id) {
    if (!s || strlen(s) != LOG_ID_CHARS) return -1;
    uint32_t v = 0;
    for (int i = 0; i < LOG_ID_CHARS; i++) {
        char c = s[i];
        int d = c >= '0' && c <= '9' ? c - '0' : c >= 'a' && c <= 'f' ? c - 'a' + 10 : c >= 'A' && c <= 'F' ? c - 'A' + 10 : -1;
        if (d < 0) return -1;
        v = v << 4 | (uint32_t)d;
    }
    if (!v) return -1;
    *id = v;
    return 0;
}

/* ==== Lines ==== */

/* "2026-11-23T11:34:20.123Z" into out (>= 25 bytes). */
static void log_format_time(char *out, size_t outlen) {
    struct timespec ts;
    struct tm tm;
    clock_gettime(CLOCK_REALTIME, &ts);
    gmtime_r(&ts.tv_sec, &tm);
    size_t n = strftime(out, outlen, "%Y-%m-%dT%H:%M:%S", &tm);
    snprintf(out + n, outlen - n, ".%03ldZ", ts.tv_nsec / 1000000L);
}

/* A request id as given, if it is one: anything else becomes "-" (an id is
 * ours, but the format must hold whatever a caller passes). */
static const char *log_req_field(const char *req) {
    uint32_t id;
    return req && log_id_parse(req, &id) == 0 ? req : "-";
}

static void log_write_all(const char *s, size_t n) {
    pthread_mutex_lock(&log_mu);
    while (n > 0) {
        ssize_t w = write(STDERR_FILENO, s, n);
        if (w < 0 && errno == EINTR) continue;
        if (w <= 0) break;   /* stderr closed or full: the line is lost, the server goes on */
        s += w;
        n -= (size_t)w;
    }
    pthread_mutex_unlock(&log_mu);
}

static void log_vline(enum log_level l, const char *req, const char *fmt, va_list ap) {
    if (!log_enabled(l)) return;
    char msg[LOG_MSG_MAX], line[LOG_LINE_MAX], ts[40];
    vsnprintf(msg, sizeof msg, fmt, ap);
    log_format_time(ts, sizeof ts);
    int n = snprintf(line, sizeof line, "%s %s %s req=%s ", ts, log_level_name[l], log_role, log_req_field(req));
    if (n < 0 || (size_t)n >= sizeof line - 2) return;
    size_t m = logsafe_escape(line + n, sizeof line - (size_t)n - 1, msg, strlen(msg));
    line[n + m] = '\n';
    log_write_all(line, (size_t)n + m + 1);
}

void log_line(enum log_level l, const char *req, const char *fmt, ...) {
    va_list ap;
    va_start(ap, fmt);
    log_vline(l, req, fmt, ap);
    va_end(ap);
}

#define LOG_AT(name, level)                                   \
    void name(const char *req, const char *fmt, ...) {        \
        va_list ap;                                           \
        va_start(ap, fmt);                                    \
        log_vline(level, req, fmt, ap);                       \
        va_end(ap);                                           \
    }
LOG_AT(log_error, LOGL_ERROR)
LOG_AT(log_warn, LOGL_WARN)
LOG_AT(log_info, LOGL_INFO)
LOG_AT(log_debug, LOGL_DEBUG)

/* ==== Refusals, rate-limited ==== */

/* Refused requests cost an attacker one request each: without a bound, a
 * flood of unsigned or malformed requests grows the log without limit. At
 * most LOG_REFUSED_PER_S such lines a second; the next line that passes says
 * how many were left out. 50/s keeps every refusal of a real client and
 * caps a flood at a few MB an hour. */
#define LOG_REFUSED_PER_S 50

int log_limit_take(log_limit *l, double now_ms, unsigned long *dropped) {
    *dropped = 0;
    if (now_ms - l->t0 > l->window_ms) { l->t0 = now_ms; l->n = 0; }
    if (l->n >= l->burst) { l->dropped++; return 0; }
    l->n++;
    *dropped = l->dropped;
    l->dropped = 0;
    return 1;
}

static pthread_mutex_t log_refused_mu = PTHREAD_MUTEX_INITIALIZER;
static log_limit log_refused_limit = { .window_ms = 1000.0, .burst = LOG_REFUSED_PER_S };

void log_refused(const char *req, int status, const char *msg) {
    if (!log_enabled(LOGL_WARN)) return;
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    unsigned long dropped;
    pthread_mutex_lock(&log_refused_mu);
    int pass = log_limit_take(&log_refused_limit, ts.tv_sec * 1e3 + ts.tv_nsec / 1e6, &dropped);
    pthread_mutex_unlock(&log_refused_mu);
    if (!pass) return;
    /* a 4xx or 5xx is worth an operator's look: warn level */
    if (dropped) log_warn(req, "refused status=%d error=%s (%lu refusal lines left out before this one)", status, msg, dropped);
    else log_warn(req, "refused status=%d error=%s", status, msg);
}

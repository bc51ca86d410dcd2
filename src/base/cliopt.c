/* cliopt.c - see cliopt.h. */
#include "base/cliopt.h"

#include <errno.h>
#include <math.h>
#include <signal.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>

#include <openssl/crypto.h>


/* ==== Values ==== */

static int cliopt_missing(const char *cmd, const char *opt, const char *v) {
    if (v) return 0;
    fprintf(stderr, "%s: %s needs a value\n", cmd, opt);
    return -1;
}

int cliopt_int(const char *cmd, const char *opt, const char *v, long lo, long hi, int *out) {
    if (cliopt_missing(cmd, opt, v)) return -1;
    char *end;
    errno = 0;
    long x = strtol(v, &end, 10);
    if (end == v || *end) { fprintf(stderr, "%s: %s needs a whole number, got '%s'\n", cmd, opt, v); return -1; }
    if (errno || x < lo || x > hi) {
        fprintf(stderr, "%s: %s: %s is out of range [%ld, %ld]\n", cmd, opt, v, lo, hi);
        return -1;
    }
    *out = (int)x;
    return 0;
}

int cliopt_float(const char *cmd, const char *opt, const char *v, double lo, double hi, float *out) {
    double x;
    if (cliopt_double(cmd, opt, v, lo, hi, &x)) return -1;
    *out = (float)x;
    return 0;
}

int cliopt_double(const char *cmd, const char *opt, const char *v, double lo, double hi, double *out) {
    if (cliopt_missing(cmd, opt, v)) return -1;
    char *end;
    errno = 0;
    double x = strtod(v, &end);
    if (end == v || *end) { fprintf(stderr, "%s: %s needs a number, got '%s'\n", cmd, opt, v); return -1; }
    if (errno || !isfinite(x) || x < lo || x > hi) {
        fprintf(stderr, "%s: %s: %s is out of range [%g, %g]\n", cmd, opt, v, lo, hi);
        return -1;
    }
    *out = x;
    return 0;
}

int cliopt_u64(const char *cmd, const char *opt, const char *v, uint64_t lo, uint64_t hi, uint64_t *out) {
    if (cliopt_missing(cmd, opt, v)) return -1;
    char *end;
    errno = 0;
    /* strtoull accepts "-1" and wraps it: refuse a sign outright */
    unsigned long long x = v[0] == '-' ? 0 : strtoull(v, &end, 10);
    if (v[0] == '-' || end == v || *end || errno || x < lo || x > hi) {
        fprintf(stderr, "%s: %s: %s is out of range [%llu, %llu]\n", cmd, opt, v, (unsigned long long)lo,
                (unsigned long long)hi);
        return -1;
    }
    *out = x;
    return 0;
}

int cliopt_str(const char *cmd, const char *opt, const char *v, const char **out) {
    if (cliopt_missing(cmd, opt, v)) return -1;
    *out = v;
    return 0;
}

int cliopt_choice(const char *cmd, const char *opt, const char *v, const char *const *names, int *out) {
    if (cliopt_missing(cmd, opt, v)) return -1;
    for (int i = 0; names[i]; i++)
        if (!strcmp(v, names[i])) { *out = i; return 0; }
    fprintf(stderr, "%s: %s: '%s' is not one of", cmd, opt, v);
    for (int i = 0; names[i]; i++) fprintf(stderr, "%s%s", i ? "|" : " ", names[i]);
    fprintf(stderr, "\n");
    return -1;
}

int cliopt_backend(const char *cmd, const char *v, const char **out) {
    static const char *const names[] = { "cpu", "cuda", "mlx", NULL };
    int k;
    if (cliopt_choice(cmd, "--backend", v, names, &k)) return -1;
    *out = v;
    return 0;
}

void cliopt_usage_backend(FILE *f, int width) {
    fprintf(f, "  %-*s compute on cpu (default), cuda (make CUDA=1) or mlx (make MLX=1 mlx)\n", width, "--backend B");
    fprintf(f, "  %-*s CUDA device, 0..63 (default 0)\n", width, "--device N");
}

int cliopt_is_help(const char *a) { return a && (!strcmp(a, "-h") || !strcmp(a, "--help")); }

int cliopt_wants_help(int argc, char **argv) {
    for (int i = 0; i < argc; i++)
        if (cliopt_is_help(argv[i])) return 1;
    return 0;
}

/* ==== Lists ==== */

/* What a list's items are, and their bounds. */
typedef struct {
    const char *cmd, *opt;
    enum { CLIOPT_WHOLE, CLIOPT_REAL, CLIOPT_NAME } kind;
    double lo, hi;              /* WHOLE, REAL */
    const char *const *names;   /* NAME */
} cliopt_list_spec;

/* An item longer than this is no number in any range an option takes. */
#define CLIOPT_LIST_ITEM 64

/* One NUL-terminated item: 0 with *x, 1 when it is not of the kind, 2 when
 * it is a number out of range. */
static int cliopt_list_item(const cliopt_list_spec *s, const char *one, double *x) {
    char *end;
    errno = 0;
    if (s->kind == CLIOPT_NAME) {
        for (int i = 0; s->names[i]; i++)
            if (!strcmp(one, s->names[i])) { *x = i; return 0; }
        return 1;
    }
    if (s->kind == CLIOPT_WHOLE) {
        long l = strtol(one, &end, 10);
        if (end == one || *end) return 1;
        *x = (double)l;   /* exact: the options' bounds are far below 2^53 */
    } else {
        *x = strtod(one, &end);
        if (end == one || *end) return 1;
    }
    return errno || !isfinite(*x) || *x < s->lo || *x > s->hi ? 2 : 0;
}

/* The one line refusing v (item: the item out of range); whole bounds print
 * as integers, real ones as %g. */
static void cliopt_list_refuse(const cliopt_list_spec *s, const char *v, const char *item, int why, int max) {
    const char *cmd = s->cmd, *opt = s->opt;
    if (why == 2 && s->kind == CLIOPT_WHOLE)
        fprintf(stderr, "%s: %s: %s is out of range [%.0f, %.0f]\n", cmd, opt, item, s->lo, s->hi);
    else if (why == 2) fprintf(stderr, "%s: %s: %s is out of range [%g, %g]\n", cmd, opt, item, s->lo, s->hi);
    else if (s->kind == CLIOPT_WHOLE)
        fprintf(stderr, "%s: %s: '%s' is not a list of at most %d whole numbers in [%.0f, %.0f]\n", cmd, opt, v, max,
                s->lo, s->hi);
    else if (s->kind == CLIOPT_REAL)
        fprintf(stderr, "%s: %s: '%s' is not a list of at most %d numbers in [%g, %g]\n", cmd, opt, v, max, s->lo, s->hi);
    else {
        fprintf(stderr, "%s: %s: '%s' is not a list of at most %d of", cmd, opt, v, max);
        for (int i = 0; s->names[i]; i++) fprintf(stderr, "%s%s", i ? "|" : " ", s->names[i]);
        fprintf(stderr, "\n");
    }
}

/* The items of v into x[0..max): their count, or -1 with the message out. */
static int cliopt_list_scan(const cliopt_list_spec *s, const char *v, int max, double *x) {
    if (cliopt_missing(s->cmd, s->opt, v)) return -1;
    if (max > CLIOPT_LIST_MAX) max = CLIOPT_LIST_MAX;
    int n = 0;
    for (const char *p = v;;) {
        size_t len = strcspn(p, ",");
        char one[CLIOPT_LIST_ITEM] = "";
        int why = len == 0 || len >= sizeof one || n == max;   /* an empty item, a huge one, one too many */
        if (!why) {
            memcpy(one, p, len);
            one[len] = 0;
            why = cliopt_list_item(s, one, &x[n]);
        }
        if (why) { cliopt_list_refuse(s, v, one, why, max); return -1; }
        n++;
        if (!p[len]) return n;
        p += len + 1;
    }
}

/* A list of whole numbers or names' indices into out. */
static int cliopt_list_ints(const cliopt_list_spec *s, const char *v, int *out, int max, int *n) {
    double x[CLIOPT_LIST_MAX];
    int k = cliopt_list_scan(s, v, max, x);
    if (k < 0) return -1;
    for (int i = 0; i < k; i++) out[i] = (int)x[i];
    *n = k;
    return 0;
}

int cliopt_int_list(const char *cmd, const char *opt, const char *v, long lo, long hi, int *out, int max, int *n) {
    cliopt_list_spec s = { cmd, opt, CLIOPT_WHOLE, (double)lo, (double)hi, NULL };
    return cliopt_list_ints(&s, v, out, max, n);
}

int cliopt_double_list(const char *cmd, const char *opt, const char *v, double lo, double hi, double *out, int max,
                       int *n) {
    cliopt_list_spec s = { cmd, opt, CLIOPT_REAL, lo, hi, NULL };
    double x[CLIOPT_LIST_MAX];
    int k = cliopt_list_scan(&s, v, max, x);
    if (k < 0) return -1;
    memcpy(out, x, sizeof x[0] * (size_t)k);
    *n = k;
    return 0;
}

int cliopt_choice_list(const char *cmd, const char *opt, const char *v, const char *const *names, int *out, int max,
                       int *n) {
    cliopt_list_spec s = { cmd, opt, CLIOPT_NAME, 0, 0, names };
    return cliopt_list_ints(&s, v, out, max, n);
}

/* ==== Input ==== */

char *cliopt_read_text(const char *path, size_t max, size_t *len, char *err, size_t errlen) {
    int is_stdin = !strcmp(path, "-");
    FILE *f = is_stdin ? stdin : fopen(path, "rb");
    if (!f) { snprintf(err, errlen, "cannot read %s: %s", path, strerror(errno)); return NULL; }
    /* max + 1 bytes fit (one past max is how "too long" is known) plus the NUL */
    size_t cap = max + 2 < 4096 ? max + 2 : 4096, n = 0;
    char *buf = malloc(cap);
    int fail = !buf;
    while (!fail) {
        if (n + 1 == cap) {
            size_t ncap = cap > (max + 2) / 2 ? max + 2 : cap * 2;
            char *nb = realloc(buf, ncap);
            if (!nb) { fail = 1; break; }
            buf = nb;
            cap = ncap;
        }
        size_t r = fread(buf + n, 1, cap - n - 1, f);
        n += r;
        if (r == 0 || n > max) break;
    }
    if (!fail && ferror(f)) { snprintf(err, errlen, "cannot read %s: %s", is_stdin ? "stdin" : path, strerror(errno)); fail = 2; }
    if (!is_stdin) fclose(f);
    if (fail == 1) snprintf(err, errlen, "out of memory reading %s", path);
    if (!fail && n > max) {
        snprintf(err, errlen, "%s is longer than %zu bytes", is_stdin ? "stdin" : path, max);
        fail = 3;
    }
    if (fail) { free(buf); errno = fail == 3 ? EFBIG : errno; return NULL; }
    buf[n] = 0;
    if (len) *len = n;
    return buf;
}

/* A secret file holds a line of text: a bigger file is the wrong file and
 * is refused unread. */
#define CLIOPT_MAX_SECRET_FILE 4096

int cliopt_load_secret(const char *file, char **out, size_t *len, char *err, size_t errlen) {
    *out = NULL;
    *len = 0;
    char *s = NULL;
    size_t n = 0;
    if (file) {
        char why[512];
        if (!(s = cliopt_read_text(file, CLIOPT_MAX_SECRET_FILE, &n, why, sizeof why))) {
            snprintf(err, errlen, "the secret file: %s", why);
            return -1;
        }
    } else {
        const char *e = getenv("TANDEM_SECRET");
        if (!e || !*e) { snprintf(err, errlen, "no shared secret: give --secret-file FILE or set TANDEM_SECRET"); return -1; }
        if (!(s = strdup(e))) { snprintf(err, errlen, "out of memory"); return -1; }
        n = strlen(s);
    }
    /* A trailing newline is an artefact of how the file was written, not part of the secret. */
    while (n && (s[n - 1] == '\n' || s[n - 1] == '\r' || s[n - 1] == ' ' || s[n - 1] == '\t')) s[--n] = 0;
    if (n == 0) {
        snprintf(err, errlen, "the shared secret%s%s is empty", file ? " in " : "", file ? file : "");
        free(s);
        return -1;
    }
    char why[300];
    if (cliopt_check_secret(s, n, why, sizeof why)) {
        snprintf(err, errlen, "the shared secret %s%s: %s", file ? "in " : "in TANDEM_SECRET", file ? file : "", why);
        OPENSSL_cleanse(s, n);
        free(s);
        return -1;
    }
    *out = s;
    *len = n;
    return 0;
}

/* ==== Checks ==== */

int cliopt_check_secret(const char *s, size_t n, char *err, size_t errlen) {
    static const char hex[] = "0123456789abcdefABCDEF";
    static const char b64[] = "ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789+/-_=";
    size_t count[256] = {0}, distinct = 0, most = 0, pad = 0;
    int is_hex = 1, is_b64 = 1;
    for (size_t i = 0; i < n; i++) {
        unsigned char c = (unsigned char)s[i];
        if (!c || !strchr(hex, c)) is_hex = 0;
        if (!c || !strchr(b64, c)) is_b64 = 0;
        if (c == '=') pad++;
        if (!count[c]++) distinct++;
        if (count[c] > most) most = count[c];
    }
    /* bits per character of the smallest alphabet that holds them all */
    size_t bytes = is_hex ? n / 2 : is_b64 ? (n - pad) * 3 / 4 : n;
    const char *how = "make one with: openssl rand -hex 32 > secret.txt";
    if (bytes < CLIOPT_SECRET_MIN_BYTES) {
        snprintf(err, errlen, "it holds %zu bytes (%zu %s characters); at least %d are needed; %s", bytes, n,
                 is_hex ? "hex" : is_b64 ? "base64" : "other", CLIOPT_SECRET_MIN_BYTES, how);
        return -1;
    }
    if (distinct < CLIOPT_SECRET_MIN_DISTINCT || most * 4 > n) {
        snprintf(err, errlen, "it repeats itself (%zu distinct characters, one of them %zu times in %zu); %s", distinct,
                 most, n, how);
        return -1;
    }
    return 0;
}

int cliopt_check_hostport(const char *what, const char *addr, int allow_zero, char *err, size_t errlen) {
    const char *colon = addr ? strrchr(addr, ':') : NULL;
    if (!colon || !colon[1]) {
        snprintf(err, errlen, "%s: '%s' is not HOST:PORT", what, addr ? addr : "");
        return -1;
    }
    const char *p = colon + 1;
    size_t pl = strlen(p);
    /* digits only, and few enough that the value cannot overflow */
    long v = pl <= 9 && strspn(p, "0123456789") == pl ? strtol(p, NULL, 10) : -1;
    if (v < (allow_zero ? 0 : 1) || v > 65535) {
        snprintf(err, errlen, "%s: port %.32s of '%.200s' is not within %d-65535", what, p, addr, allow_zero ? 0 : 1);
        return -1;
    }
    return 0;
}

/* ==== Signals ==== */

static volatile int cliopt_stop;

static void cliopt_on_signal(int sig) {
    (void)sig;
    cliopt_stop = 1;
}

volatile int *cliopt_stop_on_signals(void) {
    struct sigaction sa;
    memset(&sa, 0, sizeof sa);
    sa.sa_handler = cliopt_on_signal;
    sigemptyset(&sa.sa_mask);
    sigaction(SIGINT, &sa, NULL);
    sigaction(SIGTERM, &sa, NULL);
    signal(SIGPIPE, SIG_IGN);
    return &cliopt_stop;
}

/* ==== Progress ==== */

/* A stage shorter than this prints nothing when stderr is not a terminal. */
#define PROGRESS_QUIET_S 2.0
/* Redraw period on a terminal: smooth enough, cheap enough. */
#define PROGRESS_TTY_S 0.1
/* ... and nothing for a stage shorter than this. */
#define PROGRESS_TTY_FIRST_S 0.5

static double cliopt_now(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double)ts.tv_sec + ts.tv_nsec / 1e9;
}

void cliopt_progress_begin(cliopt_progress *p, const char *label, uint64_t total, int quiet) {
    memset(p, 0, sizeof *p);
    snprintf(p->label, sizeof p->label, "%s", label);
    p->total = total ? total : 1;
    p->t0 = p->last_draw = cliopt_now();
    p->tty = isatty(STDERR_FILENO);
    p->quiet = quiet;
}

void cliopt_progress_update(cliopt_progress *p, uint64_t done) {
    if (p->quiet) return;
    if (done > p->total) done = p->total;
    double now = cliopt_now(), el = now - p->t0;
    int pct = (int)(done * 100 / p->total);
    if (p->tty) {
        if (el < PROGRESS_TTY_FIRST_S || (now - p->last_draw < PROGRESS_TTY_S && done < p->total)) return;
        fprintf(stderr, "\r%s: %3d%% (%.1f s)", p->label, pct, el);
        p->last_draw = now;
        p->drawn = 1;
        return;
    }
    int tenth = pct / 10;
    if (tenth <= p->last_tenth || el < PROGRESS_QUIET_S) return;
    p->last_tenth = tenth;
    fprintf(stderr, "%s: %d%% (%.1f s)\n", p->label, pct, el);
    p->drawn = 1;
}

void cliopt_progress_end(cliopt_progress *p) {
    if (p->quiet) return;
    double el = cliopt_now() - p->t0;
    if (p->tty && p->drawn) fprintf(stderr, "\r%s: 100%% (%.1f s)\n", p->label, el);
    else if (p->drawn || el >= PROGRESS_QUIET_S) fprintf(stderr, "%s: done in %.1f s\n", p->label, el);
}

void cliopt_progress_steps(void *ud, int done, int total) {
    cliopt_progress *p = ud;
    if (total > 0) p->total = (uint64_t)total;
    cliopt_progress_update(p, done > 0 ? (uint64_t)done : 0);
}

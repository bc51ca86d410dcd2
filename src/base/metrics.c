/* metrics.c - Prometheus counters, gauges and histograms (see metrics.h). */
#include "base/metrics.h"

#include <math.h>
#include <pthread.h>
#include <stdarg.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "base/strbuf.h"
#include "base/unicode.h"

const double metrics_buckets_latency[METRICS_N_LATENCY] = {0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1,
                                                           2.5, 5, 10, 30, 60, 120, 300};
const double metrics_buckets_fast[METRICS_N_FAST] = {0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05,
                                                     0.1, 0.25, 0.5, 1, 2.5, 5};

/* ==== Types ==== */

enum mt_kind { MT_COUNTER, MT_GAUGE, MT_HISTOGRAM };

typedef struct {
    char *lv[METRICS_MAX_LABELS];
    double value;                        /* counter, gauge */
    double sum;                          /* histogram */
    unsigned long long count;
    unsigned long long *b;               /* [n_bounds], per bucket (not cumulative) */
} mt_series;

struct metrics_family {
    metrics *m;
    enum mt_kind kind;
    char *name, *help;
    char *labels[METRICS_MAX_LABELS];
    int n_labels;
    double bounds[METRICS_MAX_BUCKETS];
    int n_bounds;
    mt_series **s;
    int n, cap;
};

struct metrics {
    pthread_mutex_t mu;
    metrics_family **f;
    int n, cap;
};

static mt_series *mt_series_get(metrics_family *f, const char *const *lv);
static void mt_errf(char *err, size_t errlen, const char *fmt, ...) __attribute__((format(printf, 3, 4)));
static void mt_errf(char *err, size_t errlen, const char *fmt, ...) {
    if (!err || !errlen) return;
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(err, errlen, fmt, ap);
    va_end(ap);
}

/* ==== Registry ==== */

metrics *metrics_new(void) {
    metrics *m = calloc(1, sizeof *m);
    if (m) pthread_mutex_init(&m->mu, NULL);
    return m;
}

static void mt_series_free(mt_series *s) {
    if (!s) return;
    for (int i = 0; i < METRICS_MAX_LABELS; i++) free(s->lv[i]);
    free(s->b);
    free(s);
}

static void mt_family_free(metrics_family *f) {
    if (!f) return;
    for (int i = 0; i < f->n; i++) mt_series_free(f->s[i]);
    for (int i = 0; i < f->n_labels; i++) free(f->labels[i]);
    free(f->s);
    free(f->name);
    free(f->help);
    free(f);
}

void metrics_free(metrics *m) {
    if (!m) return;
    for (int i = 0; i < m->n; i++) mt_family_free(m->f[i]);
    free(m->f);
    pthread_mutex_destroy(&m->mu);
    free(m);
}

static int mt_ends_with(const char *s, const char *suffix) {
    size_t a = strlen(s), b = strlen(suffix);
    return a >= b && !strcmp(s + a - b, suffix);
}

/* [a-zA-Z_:][a-zA-Z0-9_:]* (metric names) or, without ':', label names. */
static int mt_valid_name(const char *s, int colon) {
    if (!s || !*s || (*s >= '0' && *s <= '9')) return 0;
    for (; *s; s++) {
        int ok = (*s >= 'a' && *s <= 'z') || (*s >= 'A' && *s <= 'Z') || (*s >= '0' && *s <= '9') || *s == '_' ||
                 (colon && *s == ':');
        if (!ok) return 0;
    }
    return 1;
}

static int mt_check_name(metrics *m, enum mt_kind kind, const char *name, char *err, size_t errlen) {
    if (!mt_valid_name(name, 1)) { mt_errf(err, errlen, "metric name \"%s\" is not valid", name ? name : ""); return -1; }
    if (mt_ends_with(name, "_ms")) { mt_errf(err, errlen, "%s: durations are in seconds (_seconds), not _ms", name); return -1; }
    if (kind == MT_COUNTER && !mt_ends_with(name, "_total")) {
        mt_errf(err, errlen, "%s: a counter's name ends in _total", name);
        return -1;
    }
    if (kind != MT_COUNTER && mt_ends_with(name, "_total")) {
        mt_errf(err, errlen, "%s: only counters end in _total", name);
        return -1;
    }
    if (kind == MT_HISTOGRAM && (mt_ends_with(name, "_bucket") || mt_ends_with(name, "_sum") || mt_ends_with(name, "_count"))) {
        mt_errf(err, errlen, "%s: a histogram's name must not end in a series suffix", name);
        return -1;
    }
    for (int i = 0; i < m->n; i++)
        if (!strcmp(m->f[i]->name, name)) { mt_errf(err, errlen, "%s: registered twice", name); return -1; }
    return 0;
}

static int mt_check_labels(enum mt_kind kind, const char *name, const char *const *labels, int *n, char *err, size_t errlen) {
    *n = 0;
    for (; labels && labels[*n]; (*n)++) {
        const char *l = labels[*n];
        if (*n == METRICS_MAX_LABELS) { mt_errf(err, errlen, "%s: more than %d labels", name, METRICS_MAX_LABELS); return -1; }
        if (!mt_valid_name(l, 0) || !strncmp(l, "__", 2) || (kind == MT_HISTOGRAM && !strcmp(l, "le"))) {
            mt_errf(err, errlen, "%s: label name \"%s\" is not valid", name, l);
            return -1;
        }
        for (int k = 0; k < *n; k++)
            if (!strcmp(labels[k], l)) { mt_errf(err, errlen, "%s: label \"%s\" given twice", name, l); return -1; }
    }
    return 0;
}

static int mt_check_bounds(const char *name, const double *b, int n, char *err, size_t errlen) {
    if (n < 1 || n > METRICS_MAX_BUCKETS || !b) {
        mt_errf(err, errlen, "%s: a histogram has 1 to %d bounds", name, METRICS_MAX_BUCKETS);
        return -1;
    }
    for (int i = 0; i < n; i++)
        if (!isfinite(b[i]) || (i && !(b[i] > b[i - 1]))) {
            mt_errf(err, errlen, "%s: bounds must be finite and strictly increasing", name);
            return -1;
        }
    return 0;
}

static metrics_family *mt_register(metrics *m, enum mt_kind kind, const char *name, const char *help,
                                   const char *const *labels, const double *bounds, int n_bounds,
                                   char *err, size_t errlen) {
    if (!m) { mt_errf(err, errlen, "no registry"); return NULL; }
    int nl;
    pthread_mutex_lock(&m->mu);
    metrics_family *f = NULL;
    if (mt_check_name(m, kind, name, err, errlen) || mt_check_labels(kind, name, labels, &nl, err, errlen) ||
        (kind == MT_HISTOGRAM && mt_check_bounds(name, bounds, n_bounds, err, errlen)))
        goto out;
    if (m->n == m->cap) {
        int cap = m->cap ? m->cap * 2 : 16;
        metrics_family **p = realloc(m->f, sizeof *p * (size_t)cap);
        if (!p) { mt_errf(err, errlen, "out of memory"); goto out; }
        m->f = p;
        m->cap = cap;
    }
    f = calloc(1, sizeof *f);
    if (!f || !(f->name = strdup(name)) || !(f->help = strdup(help ? help : ""))) goto oom;
    f->m = m;
    f->kind = kind;
    for (f->n_labels = 0; f->n_labels < nl; f->n_labels++)
        if (!(f->labels[f->n_labels] = strdup(labels[f->n_labels]))) goto oom;
    if (kind == MT_HISTOGRAM) {
        memcpy(f->bounds, bounds, sizeof *bounds * (size_t)n_bounds);
        f->n_bounds = n_bounds;
    }
    /* a family without labels has exactly one series, from the start */
    if (!nl && !mt_series_get(f, NULL)) goto oom;
    m->f[m->n++] = f;
    goto out;
oom:
    mt_family_free(f);
    f = NULL;
    mt_errf(err, errlen, "out of memory");
out:
    pthread_mutex_unlock(&m->mu);
    return f;
}

metrics_family *metrics_counter(metrics *m, const char *name, const char *help, const char *const *labels,
                                char *err, size_t errlen) {
    return mt_register(m, MT_COUNTER, name, help, labels, NULL, 0, err, errlen);
}

metrics_family *metrics_gauge(metrics *m, const char *name, const char *help, const char *const *labels,
                              char *err, size_t errlen) {
    return mt_register(m, MT_GAUGE, name, help, labels, NULL, 0, err, errlen);
}

metrics_family *metrics_histogram(metrics *m, const char *name, const char *help, const char *const *labels,
                                  const double *bounds, int n_bounds, char *err, size_t errlen) {
    return mt_register(m, MT_HISTOGRAM, name, help, labels, bounds, n_bounds, err, errlen);
}

/* ==== Series ==== */

static int mt_valid_value(const char *v) {
    if (!v) return 0;
    size_t n = strlen(v);
    if (n > METRICS_MAX_VALUE) return 0;
    for (size_t i = 0; i < n;) {
        uint32_t cp;
        size_t l = unicode_strict_seq((const unsigned char *)v + i, n - i, &cp);
        if (!l) return 0;
        i += l;
    }
    return 1;
}

/* The series for lv, created when missing (caller holds mu); NULL when it
 * cannot be (bad value, cap, memory). */
static mt_series *mt_series_get(metrics_family *f, const char *const *lv) {
    for (int i = 0; i < f->n; i++) {
        int same = 1;
        for (int k = 0; k < f->n_labels && same; k++) same = !strcmp(f->s[i]->lv[k], lv[k]);
        if (same) return f->s[i];
    }
    if (f->n >= METRICS_MAX_SERIES) return NULL;
    for (int k = 0; k < f->n_labels; k++)
        if (!mt_valid_value(lv[k])) return NULL;
    if (f->n == f->cap) {
        int cap = f->cap ? f->cap * 2 : 8;
        mt_series **p = realloc(f->s, sizeof *p * (size_t)cap);
        if (!p) return NULL;
        f->s = p;
        f->cap = cap;
    }
    mt_series *s = calloc(1, sizeof *s);
    if (!s) return NULL;
    for (int k = 0; k < f->n_labels; k++)
        if (!(s->lv[k] = strdup(lv[k]))) { mt_series_free(s); return NULL; }
    if (f->kind == MT_HISTOGRAM && !(s->b = calloc((size_t)f->n_bounds, sizeof *s->b))) { mt_series_free(s); return NULL; }
    f->s[f->n++] = s;
    return s;
}

enum { MT_OP_ADD, MT_OP_SET, MT_OP_OBSERVE, MT_OP_TOUCH };

static int mt_apply(metrics_family *f, const char *const *lv, int op, double v) {
    if (!f || (f->n_labels && !lv)) return -1;
    if (op == MT_OP_OBSERVE ? f->kind != MT_HISTOGRAM : op != MT_OP_TOUCH && f->kind == MT_HISTOGRAM) return -1;
    if (op == MT_OP_ADD && f->kind == MT_COUNTER && !(v >= 0)) return -1;
    if (op == MT_OP_SET ? isnan(v) : op != MT_OP_TOUCH && !isfinite(v)) return -1;   /* a sum never becomes Inf */
    pthread_mutex_lock(&f->m->mu);
    mt_series *s = mt_series_get(f, lv);
    if (s) {
        if (op == MT_OP_ADD) s->value += v;
        else if (op == MT_OP_SET) s->value = v;
        else if (op == MT_OP_OBSERVE) {
            s->sum += v;
            s->count++;
            for (int i = 0; i < f->n_bounds; i++)
                if (v <= f->bounds[i]) { s->b[i]++; break; }
        }
    }
    pthread_mutex_unlock(&f->m->mu);
    return s ? 0 : -1;
}

int metrics_add(metrics_family *f, const char *const *lv, double v) { return mt_apply(f, lv, MT_OP_ADD, v); }
int metrics_set(metrics_family *f, const char *const *lv, double v) { return mt_apply(f, lv, MT_OP_SET, v); }
int metrics_observe(metrics_family *f, const char *const *lv, double x) { return mt_apply(f, lv, MT_OP_OBSERVE, x); }
int metrics_touch(metrics_family *f, const char *const *lv) { return mt_apply(f, lv, MT_OP_TOUCH, 0); }

void metrics_clear(metrics_family *f) {
    if (!f || !f->n_labels) return;   /* the one series of a family without labels stays */
    pthread_mutex_lock(&f->m->mu);
    for (int i = 0; i < f->n; i++) mt_series_free(f->s[i]);
    f->n = 0;
    pthread_mutex_unlock(&f->m->mu);
}

/* ==== Exposition text ==== */

/* Help text escapes '\' and newline; label values also '"'. */
static void mt_put_escaped(strbuf *b, const char *s, int quote) {
    for (; *s; s++) {
        if (*s == '\\') strbuf_puts(b, "\\\\");
        else if (*s == '\n') strbuf_puts(b, "\\n");
        else if (quote && *s == '"') strbuf_puts(b, "\\\"");
        else strbuf_put(b, s, 1);
    }
}

/* A float as Prometheus reads it: integers plainly, others in the fewest
 * digits (15, else 17) that read back the same value. */
static void mt_put_num(strbuf *b, double v) {
    char s[40];
    if (isnan(v)) snprintf(s, sizeof s, "NaN");
    else if (isinf(v)) snprintf(s, sizeof s, v > 0 ? "+Inf" : "-Inf");
    else if (v == floor(v) && fabs(v) < 1e15) snprintf(s, sizeof s, "%.0f", v);
    else {
        snprintf(s, sizeof s, "%.15g", v);
        if (strtod(s, NULL) != v) snprintf(s, sizeof s, "%.17g", v);
    }
    strbuf_puts(b, s);
}

/* name{l1="v1",...[,le="x"]} value */
static void mt_put_sample(strbuf *b, const metrics_family *f, const char *suffix, const mt_series *s,
                          const char *le, double v) {
    strbuf_puts(b, f->name);
    strbuf_puts(b, suffix);
    if (f->n_labels || le) {
        strbuf_puts(b, "{");
        for (int k = 0; k < f->n_labels; k++) {
            if (k) strbuf_puts(b, ",");
            strbuf_puts(b, f->labels[k]);
            strbuf_puts(b, "=\"");
            mt_put_escaped(b, s->lv[k], 1);
            strbuf_puts(b, "\"");
        }
        if (le) {
            strbuf_puts(b, f->n_labels ? ",le=\"" : "le=\"");
            strbuf_puts(b, le);
            strbuf_puts(b, "\"");
        }
        strbuf_puts(b, "}");
    }
    strbuf_puts(b, " ");
    mt_put_num(b, v);
    strbuf_puts(b, "\n");
}

static void mt_render_histogram(strbuf *b, const metrics_family *f, const mt_series *s) {
    unsigned long long cum = 0;
    for (int i = 0; i < f->n_bounds; i++) {
        strbuf le = { 0 };
        mt_put_num(&le, f->bounds[i]);
        cum += s->b[i];
        mt_put_sample(b, f, "_bucket", s, le.p ? le.p : "", (double)cum);
        strbuf_free(&le);
    }
    mt_put_sample(b, f, "_bucket", s, "+Inf", (double)s->count);
    mt_put_sample(b, f, "_sum", s, NULL, s->sum);
    mt_put_sample(b, f, "_count", s, NULL, (double)s->count);
}

static void mt_render_family(strbuf *b, const metrics_family *f) {
    static const char *const kinds[] = {"counter", "gauge", "histogram"};
    strbuf_puts(b, "# HELP ");
    strbuf_puts(b, f->name);
    strbuf_puts(b, " ");
    mt_put_escaped(b, f->help, 0);
    strbuf_puts(b, "\n# TYPE ");
    strbuf_puts(b, f->name);
    strbuf_puts(b, " ");
    strbuf_puts(b, kinds[f->kind]);
    strbuf_puts(b, "\n");
    for (int i = 0; i < f->n; i++) {
        if (f->kind == MT_HISTOGRAM) mt_render_histogram(b, f, f->s[i]);
        else mt_put_sample(b, f, "", f->s[i], NULL, f->s[i]->value);
    }
}

char *metrics_render(metrics *m, size_t *len) {
    strbuf b = { 0 };
    pthread_mutex_lock(&m->mu);
    for (int i = 0; i < m->n; i++) mt_render_family(&b, m->f[i]);
    pthread_mutex_unlock(&m->mu);
    return strbuf_take(&b, len);
}

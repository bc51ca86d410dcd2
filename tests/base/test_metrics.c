/* test_metrics.c - Prometheus metrics: the metrics module in-process (name
 * rules, escaping, cumulative buckets, lazy series, caps, threads), then
 * real processes on loopback: a prefill node (with --metrics-listen), a
 * decode node and two routers (split always; auto without a prefill node).
 * Every /metrics page goes through a strict parser of the text format
 * 0.0.4 written here; the test checks HELP and TYPE for every family, no
 * _ms names, the model label on every histogram, counters that move by
 * what the requests did, and no decision series that cannot occur. */
#include "proc.h"

#include <math.h>
#include <pthread.h>

#include "base/metrics.h"

#define TM_DIR "build/test_metrics.d"

/* ==== A strict parser of the exposition text ==== */

typedef struct { char *key; char *name; char *labels; double value; } tm_sample;   /* key: name{labels} */
typedef struct { char *name, *type; int help, samples; } tm_family;

typedef struct {
    tm_sample *s;
    int n, cap;
    tm_family f[256];
    int nf;
    char err[300];
} tm_page;

static void tm_page_free(tm_page *p) {
    for (int i = 0; i < p->n; i++) { free(p->s[i].key); free(p->s[i].name); free(p->s[i].labels); }
    for (int i = 0; i < p->nf; i++) { free(p->f[i].name); free(p->f[i].type); }
    free(p->s);
    memset(p, 0, sizeof *p);
}

static int tm_name_char(char c, int first, int colon) {
    return (c >= 'a' && c <= 'z') || (c >= 'A' && c <= 'Z') || c == '_' || (colon && c == ':') || (!first && c >= '0' && c <= '9');
}

/* A metric or label name at *p; its length, 0 if none. */
static size_t tm_name(const char *p, int colon) {
    size_t n = 0;
    while (tm_name_char(p[n], n == 0, colon)) n++;
    return n;
}

static int tm_fail(tm_page *pg, int line, const char *what) {
    snprintf(pg->err, sizeof pg->err, "line %d: %s", line, what);
    return -1;
}

static tm_family *tm_family_get(tm_page *pg, const char *name, size_t len) {
    for (int i = 0; i < pg->nf; i++)
        if (strlen(pg->f[i].name) == len && !strncmp(pg->f[i].name, name, len)) return &pg->f[i];
    return NULL;
}

/* The family a sample name belongs to: itself, or a histogram's base. */
static tm_family *tm_sample_family(tm_page *pg, const char *name, size_t len) {
    tm_family *f = tm_family_get(pg, name, len);
    if (f) return f;
    static const char *const suf[] = {"_bucket", "_sum", "_count"};
    for (int k = 0; k < 3; k++) {
        size_t sl = strlen(suf[k]);
        if (len > sl && !strncmp(name + len - sl, suf[k], sl) && (f = tm_family_get(pg, name, len - sl)) &&
            !strcmp(f->type, "histogram"))
            return f;
    }
    return NULL;
}

/* Label values: '\\', '\"' and '\n' escapes only. Copies the {...} text. */
static int tm_labels(tm_page *pg, int ln, const char **pp, char **out) {
    const char *p = *pp, *start = p;
    if (*p != '{') { *out = strdup(""); return 0; }
    p++;
    while (*p != '}') {
        size_t n = tm_name(p, 0);
        if (!n) return tm_fail(pg, ln, "bad label name");
        p += n;
        if (p[0] != '=' || p[1] != '"') return tm_fail(pg, ln, "label without =\"");
        p += 2;
        for (; *p != '"'; p++) {
            if (!*p || *p == '\n') return tm_fail(pg, ln, "unterminated label value");
            if (*p == '\\') {
                p++;
                if (*p != '\\' && *p != '"' && *p != 'n') return tm_fail(pg, ln, "bad escape in a label value");
            }
        }
        p++;
        if (*p == ',') p++;
        else if (*p != '}') return tm_fail(pg, ln, "expected , or }");
    }
    p++;
    *out = strndup(start + 1, (size_t)(p - start - 2));
    *pp = p;
    return 0;
}

static int tm_value(const char *s, double *v) {
    if (!strcmp(s, "NaN")) { *v = NAN; return 0; }
    if (!strcmp(s, "+Inf")) { *v = INFINITY; return 0; }
    if (!strcmp(s, "-Inf")) { *v = -INFINITY; return 0; }
    char *end;
    *v = strtod(s, &end);
    return end == s || *end || isinf(*v) || isnan(*v) ? -1 : 0;
}

static int tm_comment(tm_page *pg, int ln, const char *l, tm_family **cur) {
    int help = !strncmp(l, "# HELP ", 7), type = !strncmp(l, "# TYPE ", 7);
    if (!help && !type) return tm_fail(pg, ln, "comment that is neither HELP nor TYPE");
    const char *p = l + 7;
    size_t n = tm_name(p, 1);
    if (!n || p[n] != ' ') return tm_fail(pg, ln, "HELP/TYPE without a valid name");
    tm_family *f = tm_family_get(pg, p, n);
    if (f && f != *cur) return tm_fail(pg, ln, "family appears twice (not contiguous)");
    if (!f) {
        if (pg->nf == 256) return tm_fail(pg, ln, "too many families");
        f = &pg->f[pg->nf++];
        f->name = strndup(p, n);
        f->type = NULL;
        *cur = f;
    }
    if (f->samples) return tm_fail(pg, ln, "HELP/TYPE after the family's samples");
    const char *rest = p + n + 1;
    if (help) {
        if (f->help++) return tm_fail(pg, ln, "HELP twice");
        for (const char *q = rest; *q; q++)
            if (*q == '\\' && (q[1] == '\\' || q[1] == 'n')) q++;
            else if (*q == '\\') return tm_fail(pg, ln, "bad escape in HELP");
        return 0;
    }
    if (f->type) return tm_fail(pg, ln, "TYPE twice");
    if (strcmp(rest, "counter") && strcmp(rest, "gauge") && strcmp(rest, "histogram") && strcmp(rest, "summary") &&
        strcmp(rest, "untyped"))
        return tm_fail(pg, ln, "unknown TYPE");
    f->type = strdup(rest);
    return 0;
}

static int tm_sample_line(tm_page *pg, int ln, const char *l, tm_family *cur) {
    size_t n = tm_name(l, 1);
    if (!n) return tm_fail(pg, ln, "sample without a name");
    tm_family *f = tm_sample_family(pg, l, n);
    if (!f || f != cur || !f->type) return tm_fail(pg, ln, "sample outside its family's HELP/TYPE block");
    const char *p = l + n;
    char *labels = NULL;
    if (tm_labels(pg, ln, &p, &labels)) return -1;
    double v;
    if (*p != ' ' || tm_value(p + 1, &v)) { free(labels); return tm_fail(pg, ln, "bad value (or a timestamp)"); }
    if (pg->n == pg->cap) {
        pg->cap = pg->cap ? pg->cap * 2 : 256;
        pg->s = realloc(pg->s, sizeof *pg->s * (size_t)pg->cap);
    }
    tm_sample *s = &pg->s[pg->n];
    s->name = strndup(l, n);
    s->labels = labels;
    s->key = strndup(l, (size_t)(p - l));
    s->value = v;
    for (int i = 0; i < pg->n; i++)
        if (!strcmp(pg->s[i].key, s->key)) {
            free(s->name); free(s->labels); free(s->key);
            return tm_fail(pg, ln, "the same series twice");
        }
    pg->n++;
    f->samples++;
    return 0;
}

/* Parses text; 0, or -1 with pg->err. */
static int tm_parse(tm_page *pg, const char *text) {
    memset(pg, 0, sizeof *pg);
    size_t len = strlen(text);
    if (!len || text[len - 1] != '\n') return tm_fail(pg, 0, "does not end with a newline");
    char *copy = strdup(text);
    tm_family *cur = NULL;
    int ln = 0, rc = 0;
    for (char *save = NULL, *l = strtok_r(copy, "\n", &save); l && !rc; l = strtok_r(NULL, "\n", &save)) {
        ln++;
        rc = l[0] == '#' ? tm_comment(pg, ln, l, &cur) : tm_sample_line(pg, ln, l, cur);
    }
    free(copy);
    return rc;
}

static const tm_sample *tm_find(const tm_page *pg, const char *key) {
    for (int i = 0; i < pg->n; i++) if (!strcmp(pg->s[i].key, key)) return &pg->s[i];
    return NULL;
}

static double tm_val(const tm_page *pg, const char *key) {
    const tm_sample *s = tm_find(pg, key);
    return s ? s->value : -1;
}

/* The labels of a sample without its le="..." member. */
static void tm_strip_le(const char *labels, char *out, size_t outlen) {
    snprintf(out, outlen, "%s", labels);
    char *le = strstr(out, "le=\"");
    if (!le) return;
    char *end = strchr(le + 4, '"');
    if (!end) return;
    memmove(le > out && le[-1] == ',' ? le - 1 : le, end + 1 + (le == out && end[1] == ','), strlen(end + 1) + 1);
}

/* Histogram rules: buckets increasing in le and cumulative, +Inf last and
 * equal to _count, a _sum, and a non-empty model label. */
static int tm_check_histograms(tm_page *pg) {
    for (int fi = 0; fi < pg->nf; fi++) {
        const tm_family *f = &pg->f[fi];
        if (strcmp(f->type, "histogram")) continue;
        char bucket[200], count[200], sum[200];
        snprintf(bucket, sizeof bucket, "%s_bucket", f->name);
        snprintf(count, sizeof count, "%s_count", f->name);
        snprintf(sum, sizeof sum, "%s_sum", f->name);
        for (int i = 0; i < pg->n; i++) {
            const tm_sample *s = &pg->s[i];
            if (strcmp(s->name, count)) continue;
            if (!strstr(s->labels, "model=\"") || strstr(s->labels, "model=\"\""))
                return tm_fail(pg, 0, "a histogram series without a model label");
            double prev_le = -INFINITY, prev = 0, inf = -1;
            int buckets = 0, have_sum = 0;
            for (int k = 0; k < pg->n; k++) {
                const tm_sample *b = &pg->s[k];
                char stripped[512];
                if (!strcmp(b->name, sum) && !strcmp(b->labels, s->labels)) have_sum = 1;
                if (strcmp(b->name, bucket)) continue;
                tm_strip_le(b->labels, stripped, sizeof stripped);
                if (strcmp(stripped, s->labels)) continue;
                const char *le = strstr(b->labels, "le=\"");
                double lv;
                char lebuf[64];
                snprintf(lebuf, sizeof lebuf, "%s", le ? le + 4 : "");
                if (strchr(lebuf, '"')) *strchr(lebuf, '"') = 0;
                if (!le || tm_value(lebuf, &lv) || !(lv > prev_le) || b->value < prev)
                    return tm_fail(pg, 0, "histogram buckets not increasing or not cumulative");
                if (inf >= 0) return tm_fail(pg, 0, "a bucket after +Inf");
                if (isinf(lv)) inf = b->value;
                prev_le = lv;
                prev = b->value;
                buckets++;
            }
            if (!buckets || inf != s->value || !have_sum) return tm_fail(pg, 0, "histogram without +Inf == _count, or _sum");
        }
    }
    return 0;
}

/* The page rules beyond syntax: HELP and TYPE on every family, no _ms. */
static void tm_check_page(tm_page *pg, const char *what) {
    int bad = 0;
    for (int i = 0; i < pg->nf; i++) {
        const tm_family *f = &pg->f[i];
        size_t n = strlen(f->name);
        if (!f->help || !f->type) { bad++; fprintf(stderr, "%s: %s lacks HELP or TYPE\n", what, f->name); }
        if (n > 3 && !strcmp(f->name + n - 3, "_ms")) { bad++; fprintf(stderr, "%s: %s ends in _ms\n", what, f->name); }
        if (f->type && !strcmp(f->type, "counter") && (n < 6 || strcmp(f->name + n - 6, "_total"))) {
            bad++;
            fprintf(stderr, "%s: counter %s does not end in _total\n", what, f->name);
        }
    }
    for (int i = 0; i < pg->n; i++) {
        size_t n = strlen(pg->s[i].name);
        if (n > 3 && !strcmp(pg->s[i].name + n - 3, "_ms")) { bad++; fprintf(stderr, "%s: sample %s\n", what, pg->s[i].key); }
    }
    CHECK(pg->nf > 0 && !bad, "%s: every family has HELP and TYPE, no _ms names (%d families)", what, pg->nf);
    CHECK(tm_check_histograms(pg) == 0, "%s: histograms: %s", what, pg->err);
}

/* Scrapes and parses a /metrics page; 0 on success. */
static int tm_scrape(int port, const char *what, tm_page *pg) {
    char *body = NULL;
    int st = http(port, "GET", "/metrics", NULL, &body);
    int ok = st == 200 && body && tm_parse(pg, body) == 0;
    CHECK(ok, "%s: /metrics answered %d and parses: %s", what, st, pg->err);
    free(body);
    if (ok) tm_check_page(pg, what);
    return ok ? 0 : -1;
}

/* ==== The module in-process ==== */

static void test_parser_rejects(void) {
    static const char *const bad[] = {
        "x 1\n",                                                    /* no TYPE */
        "# TYPE x counter\n# HELP x h\nx 1\n",                     /* fine, checked below as good */
        "# HELP x h\n# TYPE x gauge\nx{a=\"b\\q\"} 1\n",          /* bad escape */
        "# HELP x h\n# TYPE x gauge\nx 1 2\n",                     /* timestamp: not ours */
        "# HELP x h\n# TYPE x gauge\nx 1\nx 2\n",                  /* same series twice */
        "# HELP x h\n# TYPE x gauge\nx 1\n# HELP y h\n# TYPE y gauge\ny 1\nx{a=\"1\"} 1\n",   /* not contiguous */
        "# HELP x h\n# TYPE x gauge\nx 1",                         /* no final newline */
        "# HELP x h\n# TYPE x gauge\nx one\n",
    };
    for (size_t i = 0; i < sizeof bad / sizeof bad[0]; i++) {
        tm_page pg;
        int rc = tm_parse(&pg, bad[i]);
        CHECK(i == 1 ? rc == 0 : rc == -1, "parser on case %zu: %d (%s)", i, rc, pg.err);
        tm_page_free(&pg);
    }
}

static void test_registry(void) {
    char err[200];
    metrics *m = metrics_new();
    static const char *const lm[] = {"model", NULL};
    CHECK(!metrics_counter(m, "tandem_x", "h", NULL, err, sizeof err), "counter without _total refused");
    CHECK(!metrics_histogram(m, "tandem_x_ms", "h", lm, metrics_buckets_fast, METRICS_N_FAST, err, sizeof err),
          "_ms refused");
    CHECK(!metrics_gauge(m, "tandem_g_total", "h", NULL, err, sizeof err), "gauge with _total refused");
    CHECK(!metrics_gauge(m, "9bad", "h", NULL, err, sizeof err), "bad name refused");
    CHECK(!metrics_histogram(m, "tandem_h_seconds", "h", (const char *[]){"le", NULL}, metrics_buckets_fast,
                             METRICS_N_FAST, err, sizeof err), "le label refused");
    CHECK(!metrics_histogram(m, "tandem_h_seconds", "h", lm, (const double[]){1, 1}, 2, err, sizeof err),
          "bounds not increasing refused");
    metrics_family *c = metrics_counter(m, "tandem_c_total", "Help with \\ and\nnewline.",
                                        (const char *[]){"a", "b", NULL}, err, sizeof err);
    CHECK(c != NULL, "counter: %s", err);
    CHECK(!metrics_counter(m, "tandem_c_total", "again", NULL, err, sizeof err), "duplicate refused");
    metrics_family *g = metrics_gauge(m, "tandem_g", "gauge", NULL, err, sizeof err);
    metrics_family *h = metrics_histogram(m, "tandem_h_seconds", "hist", lm, (const double[]){0.1, 1, 10}, 3, err, sizeof err);
    CHECK(g && h, "gauge and histogram: %s", err);
    CHECK(metrics_add(c, (const char *[]){"q\"uote", "back\\slash\nnl"}, 2) == 0, "add with odd label values");
    CHECK(metrics_add(c, (const char *[]){"x", "y"}, -1) == -1, "negative counter increment refused");
    CHECK(metrics_add(c, (const char *[]){"x", "\xff"}, 1) == -1, "invalid UTF-8 label value refused");
    CHECK(metrics_observe(c, (const char *[]){"x", "y"}, 1) == -1, "observe on a counter refused");
    CHECK(metrics_observe(h, (const char *[]){"m1"}, INFINITY) == -1 && metrics_add(c, (const char *[]){"x", "y"}, NAN) == -1,
          "infinite observation and NaN increment refused");
    metrics_set(g, NULL, -2.5);
    metrics_observe(h, (const char *[]){"m1"}, 0.05);
    metrics_observe(h, (const char *[]){"m1"}, 0.5);
    metrics_observe(h, (const char *[]){"m1"}, 50);
    char *text = metrics_render(m, NULL);
    tm_page pg;
    CHECK(text && tm_parse(&pg, text) == 0, "module output parses: %s\n%s", pg.err, text ? text : "");
    tm_check_page(&pg, "module");
    CHECK(tm_val(&pg, "tandem_c_total{a=\"q\\\"uote\",b=\"back\\\\slash\\nnl\"}") == 2, "escaped label values:\n%s", text);
    CHECK(tm_val(&pg, "tandem_g") == -2.5, "gauge value");
    CHECK(tm_val(&pg, "tandem_h_seconds_bucket{model=\"m1\",le=\"0.1\"}") == 1 &&
          tm_val(&pg, "tandem_h_seconds_bucket{model=\"m1\",le=\"1\"}") == 2 &&
          tm_val(&pg, "tandem_h_seconds_bucket{model=\"m1\",le=\"10\"}") == 2 &&
          tm_val(&pg, "tandem_h_seconds_bucket{model=\"m1\",le=\"+Inf\"}") == 3 &&
          fabs(tm_val(&pg, "tandem_h_seconds_sum{model=\"m1\"}") - 50.55) < 1e-9, "cumulative buckets:\n%s", text);
    CHECK(strstr(text, "# HELP tandem_c_total Help with \\\\ and\\nnewline.\n") != NULL, "help escaped");
    CHECK(!tm_find(&pg, "tandem_c_total{a=\"x\",b=\"y\"}"), "refused observations create no series");
    tm_page_free(&pg);
    free(text);
    /* the series cap */
    int dropped = 0;
    char v[32];
    for (int i = 0; i < METRICS_MAX_SERIES + 10; i++) {
        snprintf(v, sizeof v, "%d", i);
        dropped += metrics_add(c, (const char *[]){"cap", v}, 1) != 0;
    }
    CHECK(dropped == 10 + 1, "series beyond the cap dropped (%d)", dropped);   /* one series existed already */
    metrics_free(m);
}

typedef struct { metrics_family *f; int n; } tm_thr;

static void *tm_thread(void *arg) {
    tm_thr *t = arg;
    char v[8];
    for (int i = 0; i < t->n; i++) {
        snprintf(v, sizeof v, "%d", i % 4);
        metrics_add(t->f, (const char *[]){v}, 1);
    }
    return NULL;
}

static void test_threads(void) {
    char err[200];
    metrics *m = metrics_new();
    metrics_family *c = metrics_counter(m, "tandem_t_total", "t", (const char *[]){"k", NULL}, err, sizeof err);
    pthread_t th[4];
    tm_thr t = { c, 20000 };
    for (int i = 0; i < 4; i++) pthread_create(&th[i], NULL, tm_thread, &t);
    for (int i = 0; i < 4; i++) pthread_join(th[i], NULL);
    char *text = metrics_render(m, NULL);
    tm_page pg;
    double sum = 0;
    if (text && !tm_parse(&pg, text)) {
        for (int i = 0; i < pg.n; i++) sum += pg.s[i].value;
        CHECK(pg.n == 4, "four series: %d", pg.n);
        tm_page_free(&pg);
    }
    CHECK(sum == 80000, "no lost increments across threads: %.0f", sum);
    free(text);
    metrics_free(m);
}

/* ==== Real processes ==== */

typedef struct {
    pid_t pf, d, ra, rb;
    int ppf, pfm, pd, pra, prb;
    int served;                  /* generation requests answered through the routers */
} tm_env;

/* Its --port-file is TM_DIR/name.port; its log a new one. */
static int tm_start(pid_t *pid, int *port, char *const argv[], const char *name) {
    *port = start_named(pid, argv, TM_DIR, name, 1, 60000);
    return *port > 0 ? 0 : -1;
}

static int tm_setup(tm_env *e) {
    char b[512], pp[64], dp[64], ppr[64];
    snprintf(b, sizeof b, "%s", bin());
    FILE *f = fopen(TM_DIR "/secret", "w");
    if (!f) return -1;
    fputs("metrics-test-secret-5f0c2a9e7b1d4c3a8e6f9b2d1c0a7e5f\n", f);
    fclose(f);
    unlink(TM_DIR "/pfm.port");
    char *pf[] = {b, "serve", "--role", "prefill", "-m", "assets/stories260K.gguf", "-t", "1", "--secret-file",
                  TM_DIR "/secret", "--model-name", "stories", "--port-file", TM_DIR "/pf.port",
                  "--metrics-listen", "127.0.0.1:0", "--metrics-port-file", TM_DIR "/pfm.port", NULL};
    if (tm_start(&e->pf, &e->ppf, pf, "pf")) return -1;
    e->pfm = wait_port(TM_DIR "/pfm.port", e->pf, 10000);
    CHECK(e->pfm > 0, "prefill metrics port");
    snprintf(pp, sizeof pp, "127.0.0.1:%d", e->ppf);
    char *d[] = {b, "serve", "--role", "decode", "-m", "assets/stories260K.gguf", "-t", "1", "--secret-file",
                 TM_DIR "/secret", "--model-name", "stories", "--listen", "127.0.0.1:0", "--prefill-node", pp,
                 "--parallel", "2", "--port-file", TM_DIR "/d.port", NULL};
    if (tm_start(&e->d, &e->pd, d, "d")) return -1;
    snprintf(dp, sizeof dp, "stories=127.0.0.1:%d", e->pd);
    snprintf(ppr, sizeof ppr, "stories=127.0.0.1:%d", e->ppf);
    char *ra[] = {b, "serve", "--role", "router", "--listen", "127.0.0.1:0", "--secret-file", TM_DIR "/secret",
                  "--decode", dp, "--prefill", ppr, "--split", "always", "--quiet", "--port-file", TM_DIR "/ra.port", NULL};
    if (tm_start(&e->ra, &e->pra, ra, "ra")) return -1;
    char *rb[] = {b, "serve", "--role", "router", "--listen", "127.0.0.1:0", "--secret-file", TM_DIR "/secret",
                  "--decode", dp, "--quiet", "--port-file", TM_DIR "/rb.port", NULL};
    return tm_start(&e->rb, &e->prb, rb, "rb");
}

/* The last "prompt_tokens" and "completion_tokens" numbers of a response
 * (the usage object, streamed or not). */
static void tm_usage(const char *body, int *prompt, int *completion) {
    const char *p = NULL, *c = NULL;
    for (const char *q = body; (q = strstr(q, "\"prompt_tokens\":")); q++) p = q;
    for (const char *q = body; (q = strstr(q, "\"completion_tokens\":")); q++) c = q;
    *prompt = p ? atoi(p + 16) : -1;
    *completion = c ? atoi(c + 20) : -1;
}

typedef struct { int requests, prompt, completion; } tm_sent;

/* Each request starts with another name, so that no prompt is a cached
 * prefix of another (a cached prompt is not prefilled again). */
static void tm_send(int port, int stream, tm_sent *s) {
    static const char *const names[] = {"Tom", "Anna", "Sam", "Lucy", "Ben", "Mia", "Max", "Zoe"};
    static int k;
    char body[600], *resp = NULL;
    snprintf(body, sizeof body,
             "{\"model\":\"stories\",\"max_tokens\":4,\"temperature\":0,%s\"prompt\":\"%s was a little child. "
             "Once upon a time there was a girl named Lily. She loved to play in the park with her big red ball.\"}",
             stream ? "\"stream\":true,\"stream_options\":{\"include_usage\":true}," : "", names[k++ % 8]);
    int st = http(port, "POST", "/v1/completions", body, &resp);
    int p = -1, c = -1;
    if (resp) tm_usage(resp, &p, &c);
    CHECK(st == 200 && p > 0 && c > 0, "completion (stream %d): %d usage %d/%d", stream, st, p, c);
    if (st == 200 && p > 0 && c > 0) { s->requests++; s->prompt += p; s->completion += c; }
    free(resp);
}

/* Differences between two scrapes of one page. */
static double tm_delta(const tm_page *a, const tm_page *b, const char *key) {
    const tm_sample *x = tm_find(a, key), *y = tm_find(b, key);
    return (y ? y->value : 0) - (x ? x->value : 0);
}

/* Waits for a series to reach a value (an end observed when the server
 * lets go of the response, a moment after the client has it all). */
static int tm_wait_value(int port, const char *what, const char *key, double want, tm_page *out) {
    for (int i = 0; i < 40; i++) {
        if (tm_scrape(port, what, out)) return -1;
        if (tm_val(out, key) >= want) return 0;
        tm_page_free(out);
        sleep_ms(50);
    }
    return tm_scrape(port, what, out);
}

/* No (decision, reason) series that did not occur: each has a count > 0,
 * and each carries the decision the router's policy allows. */
static void tm_check_decisions(const tm_page *pg, const char *what, const char *allowed, int total) {
    double sum = 0;
    int bad = 0;
    for (int i = 0; i < pg->n; i++) {
        const tm_sample *s = &pg->s[i];
        if (strcmp(s->name, "tandem_router_decisions_total")) continue;
        char want[40];
        snprintf(want, sizeof want, "decision=\"%s\"", allowed);
        if (s->value <= 0 || !strstr(s->labels, want)) { bad++; fprintf(stderr, "%s: impossible series %s %g\n", what, s->key, s->value); }
        sum += s->value;
    }
    CHECK(!bad, "%s: only decision=\"%s\" series, each observed", what, allowed);
    CHECK(sum == total, "%s: decisions add up to the requests: %.0f want %d", what, sum, total);
    CHECK(!tm_find(pg, "tandem_router_decisions_total{decision=\"split\",reason=\"short_prompt\"}"),
          "%s: no split/short_prompt series", what);
}

static void test_split_router(tm_env *e) {
    tm_page r0, d0, p0, r1, d1, p1;
    if (tm_scrape(e->pra, "router A", &r0) | tm_scrape(e->pd, "decode", &d0) | tm_scrape(e->pfm, "prefill", &p0)) return;
    tm_sent s = {0};
    tm_send(e->pra, 0, &s);
    tm_send(e->pra, 1, &s);
    tm_send(e->pra, 0, &s);
    if (tm_wait_value(e->pra, "router A", "tandem_router_request_duration_seconds_count{model=\"stories\",outcome=\"ok\"}",
                      s.requests, &r1) ||
        tm_wait_value(e->pd, "decode", "tandem_decode_request_duration_seconds_count{model=\"stories\"}",
                      tm_val(&d0, "tandem_decode_request_duration_seconds_count{model=\"stories\"}") + s.requests, &d1) ||
        /* the prefill node counts a request once its DONE is out, which can
         * be after the decode node has answered */
        tm_wait_value(e->pfm, "prefill", "tandem_prefill_requests_total{model=\"stories\",outcome=\"ok\"}",
                      tm_val(&p0, "tandem_prefill_requests_total{model=\"stories\",outcome=\"ok\"}") + s.requests, &p1))
        return;
    CHECK(s.requests == 3, "three requests served");
    e->served += s.requests;
    /* router */
    CHECK(tm_delta(&r0, &r1, "tandem_router_requests_total{endpoint=\"completions\",status=\"200\"}") == s.requests,
          "router: requests_total moved by %d", s.requests);
    CHECK(tm_delta(&r0, &r1, "tandem_router_prompt_tokens_total") == s.prompt &&
          tm_delta(&r0, &r1, "tandem_router_completion_tokens_total") == s.completion,
          "router: tokens moved by the usage (%d, %d)", s.prompt, s.completion);
    CHECK(tm_delta(&r0, &r1, "tandem_router_prefill_total{mode=\"split\"}") == s.requests, "router: all prefilled remotely");
    CHECK(tm_delta(&r0, &r1, "tandem_router_ttft_seconds_count{model=\"stories\"}") == s.requests &&
          tm_delta(&r0, &r1, "tandem_router_queue_seconds_count{model=\"stories\"}") == s.requests &&
          tm_delta(&r0, &r1, "tandem_router_kv_transfer_seconds_count{model=\"stories\"}") == s.requests,
          "router: ttft, queue and kv_transfer histograms counted each request");
    double kv = tm_delta(&r0, &r1, "tandem_router_kv_bytes_total");
    CHECK(kv > 0, "router: kv bytes counted");
    tm_check_decisions(&r1, "router A (split always)", "split", s.requests);
    /* decode node */
    CHECK(tm_delta(&d0, &d1, "tandem_decode_requests_total{model=\"stories\",outcome=\"ok\"}") == s.requests,
          "decode: ok requests moved by %d", s.requests);
    CHECK(tm_delta(&d0, &d1, "tandem_decode_prompt_tokens_total{model=\"stories\"}") == s.prompt &&
          tm_delta(&d0, &d1, "tandem_decode_completion_tokens_total{model=\"stories\"}") == s.completion,
          "decode: tokens moved by the usage");
    CHECK(tm_delta(&d0, &d1, "tandem_decode_prefills_total{model=\"stories\",mode=\"remote\"}") == s.requests,
          "decode: remote prefills counted");
    CHECK(tm_delta(&d0, &d1, "tandem_decode_kv_received_bytes_total{model=\"stories\"}") == kv,
          "decode: kv received equals the router's kv bytes (%.0f)", kv);
    CHECK(tm_delta(&d0, &d1, "tandem_decode_queue_seconds_count{model=\"stories\"}") == s.requests &&
          tm_delta(&d0, &d1, "tandem_decode_ttft_seconds_count{model=\"stories\"}") == s.requests,
          "decode: queue and ttft histograms counted each request");
    CHECK(tm_delta(&d0, &d1, "tandem_decode_batch_steps_total{model=\"stories\"}") >= s.completion - s.requests,
          "decode: batch steps moved");
    double kt = tm_val(&d1, "tandem_decode_kv_cache_tokens{model=\"stories\"}");
    double kc = tm_val(&d1, "tandem_decode_kv_cache_capacity_tokens{model=\"stories\"}");
    CHECK(kt > 0 && kc == 2 * 512 && tm_val(&d1, "tandem_decode_slots{model=\"stories\"}") == 2 &&
          tm_val(&d1, "tandem_decode_slots_busy{model=\"stories\"}") == 0 &&
          fabs(tm_val(&d1, "tandem_decode_kv_cache_usage_ratio{model=\"stories\"}") - kt / kc) < 1e-12,
          "decode: KV cache gauges (%.0f of %.0f tokens)", kt, kc);
    /* prefill node */
    CHECK(tm_delta(&p0, &p1, "tandem_prefill_requests_total{model=\"stories\",outcome=\"ok\"}") == s.requests,
          "prefill: ok requests moved by %d", s.requests);
    CHECK(tm_delta(&p0, &p1, "tandem_prefill_kv_sent_bytes_total{model=\"stories\"}") == kv,
          "prefill: kv bytes sent equal the bytes received");
    CHECK(tm_delta(&p0, &p1, "tandem_prefill_tokens_computed_total{model=\"stories\"}") > 0 &&
          tm_delta(&p0, &p1, "tandem_prefill_handoff_seconds_count{model=\"stories\"}") == s.requests,
          "prefill: tokens computed and handoff histogram");
    CHECK(tm_val(&p1, "tandem_prefill_connections{model=\"stories\"}") >= 1, "prefill: the decode node's connection");
    tm_page_free(&r0); tm_page_free(&d0); tm_page_free(&p0);
    tm_page_free(&r1); tm_page_free(&d1); tm_page_free(&p1);
}

static void test_local_router(tm_env *e) {
    tm_sent s = {0};
    tm_send(e->prb, 0, &s);
    tm_send(e->prb, 1, &s);
    tm_page r;
    if (tm_wait_value(e->prb, "router B", "tandem_router_request_duration_seconds_count{model=\"stories\",outcome=\"ok\"}",
                      s.requests, &r))
        return;
    e->served += s.requests;
    tm_check_decisions(&r, "router B (no prefill node)", "local", s.requests);
    CHECK(!tm_find(&r, "tandem_router_kv_transfer_seconds_count{model=\"stories\"}"),
          "router B: no kv_transfer series without a split");
    tm_page_free(&r);
}

/* A request the decode node refuses (unsigned) is counted as rejected;
 * /metrics itself needs no signature. */
static void test_decode_rejected(tm_env *e) {
    tm_page a, b;
    /* a stream is counted when the node lets go of it, after the router has it all */
    if (tm_wait_value(e->pd, "decode", "tandem_decode_requests_total{model=\"stories\",outcome=\"ok\"}", e->served, &a))
        return;
    CHECK(tm_val(&a, "tandem_decode_requests_total{model=\"stories\",outcome=\"ok\"}") == e->served,
          "decode: every request through the routers counted ok (%d)", e->served);
    char *resp = NULL;
    int st = http(e->pd, "POST", "/v1/generate", "{\"tokens\":[1,2,3],\"max_tokens\":2}", &resp);
    free(resp);
    CHECK(st == 401, "unsigned generate refused: %d", st);
    if (tm_scrape(e->pd, "decode", &b)) { tm_page_free(&a); return; }
    CHECK(tm_delta(&a, &b, "tandem_decode_requests_total{model=\"stories\",outcome=\"rejected\"}") == 1,
          "decode: rejected moved by 1");
    CHECK(tm_delta(&a, &b, "tandem_decode_requests_total{model=\"stories\",outcome=\"ok\"}") == 0, "decode: ok unchanged");
    tm_page_free(&a);
    tm_page_free(&b);
    st = http(e->pfm, "GET", "/nope", NULL, &resp);
    free(resp);
    CHECK(st == 404, "prefill metrics listener: other paths 404 (%d)", st);
}

int main(void) {
    signal(SIGPIPE, SIG_IGN);
    test_parser_rejects();
    test_registry();
    test_threads();
    mkdir("build", 0755);
    mkdir(TM_DIR, 0755);
    tm_env e = {0};
    if (tm_setup(&e) == 0) {
        test_split_router(&e);
        test_local_router(&e);
        test_decode_rejected(&e);
    }
    pid_t all[] = {e.ra, e.rb, e.d, e.pf};
    for (int i = 0; i < 4; i++)
        if (all[i] > 0) CHECK(stop_proc(all[i], 20000) == 0, "process %d exits cleanly", i);
    return t_done("test_metrics");
}

/* grade_summary.c - what `tandem grade` shows while and after it runs:
 * the progress line, the router's split/local counters read from its
 * /metrics before and after, and the closing summary (latency and
 * per-request timing percentiles, tokens, cache hits).
 */
#include "grade/grade_internal.h"

#include <curl/curl.h>
#include <math.h>
#include <stdio.h>
#include <string.h>

/* ==== Progress and summary ==== */

static void grade_fmt_dur(double s, char *out, size_t n) {
    if (!isfinite(s) || s < 0) { snprintf(out, n, "?"); return; }
    long t = (long)(s + 0.5);
    if (t >= 3600) snprintf(out, n, "%ldh%02ldm", t / 3600, t / 60 % 60);
    else snprintf(out, n, "%ldm%02lds", t / 60, t % 60);
}

/* One progress line on stderr (rewritten in place on a terminal). Under g->mu. */
void grade_progress(grade_class *g, int tty) {
    double el = (grade_now_ms() - g->t0) / 1e3;
    double rate = g->finished && el > 0 ? g->graded / el * 3600 : 0;
    char eta[32];
    grade_fmt_dur(g->finished ? (g->to_do - g->finished) * el / g->finished : NAN, eta, sizeof eta);
    fprintf(stderr, "%sgrade: %d/%d done, %d failed, %d in flight, %.1f submissions/h, ETA %s%s",
            tty ? "\r" : "", g->graded + g->failed + g->skipped, g->n, g->failed, g->running, rate,
            g->finished < g->to_do ? eta : "0m00s", tty ? "   " : "\n");
    fflush(stderr);
}

static size_t grade_sink(char *p, size_t sz, size_t nm, void *ud) {
    strbuf *b = ud;
    size_t n = sz * nm;
    if (b->len + n > (4u << 20) || strbuf_put(b, p, n)) return 0;
    return n;
}

/* The router's prefill counters from GET /metrics (a tandem router only). */
grade_router_counts grade_router_metrics(const grade_opts *o) {
    grade_router_counts rc = {0};
    char url[2048], auth[600];
    snprintf(url, sizeof url, "%s/metrics", o->router);
    CURL *h = curl_easy_init();
    strbuf b = {0};
    struct curl_slist *hl = NULL;
    if (o->api_key) { snprintf(auth, sizeof auth, "Authorization: Bearer %s", o->api_key); hl = curl_slist_append(hl, auth); }
    long st = 0;
    if (h) {
        curl_easy_setopt(h, CURLOPT_URL, url);
        curl_easy_setopt(h, CURLOPT_HTTPHEADER, hl);
        curl_easy_setopt(h, CURLOPT_WRITEFUNCTION, grade_sink);
        curl_easy_setopt(h, CURLOPT_WRITEDATA, &b);
        curl_easy_setopt(h, CURLOPT_NOSIGNAL, 1L);
        curl_easy_setopt(h, CURLOPT_TIMEOUT, 10L);
        if (curl_easy_perform(h) == CURLE_OK) curl_easy_getinfo(h, CURLINFO_RESPONSE_CODE, &st);
    }
    for (char *l = st == 200 ? b.p : NULL; l && *l;) {
        char *e = strchr(l, '\n');
        if (e) *e = 0;
        char *sp = strrchr(l, ' ');
        double v = sp ? atof(sp + 1) : 0;
        /* a tandem router: the family is there even before a series is (series appear when first observed) */
        if (!strcmp(l, "# TYPE tandem_router_prefill_total counter")) rc.ok = 1;
        else if (!strncmp(l, "tandem_router_prefill_total{mode=\"split\"}", 41)) rc.split += v;
        else if (!strncmp(l, "tandem_router_prefill_total{mode=\"local\"}", 41)) rc.local += v;
        else if (!strncmp(l, "tandem_router_decisions_total{decision=\"split\"", 46)) rc.dec_split += v;
        else if (!strncmp(l, "tandem_router_decisions_total{decision=\"local\"", 46)) rc.dec_local += v;
        l = e ? e + 1 : NULL;
    }
    curl_easy_cleanup(h);
    curl_slist_free_all(hl);
    strbuf_free(&b);
    return rc;
}

static double grade_mean(const grade_series *s) {
    double t = 0;
    for (int i = 0; i < s->n; i++) t += s->v[i];
    return s->n ? t / s->n : NAN;
}

/* "12.3" with the given decimals and unit, or "-" without data. */
static const char *grade_fmt(char *buf, size_t n, double v, int decimals, const char *unit) {
    if (!isfinite(v)) snprintf(buf, n, "-");
    else snprintf(buf, n, "%.*f%s", decimals, v, unit);
    return buf;
}

/* How much of this run's prompts the servers had cached (a rubric held in a
 * slot or a decode node's KV store). */
static void grade_print_cached(const grade_class *g) {
    long long p = g->ptok_sum[0] + g->ptok_sum[1], k = g->cached_sum[0] + g->cached_sum[1];
    char a[32], b[32], c[32];
    printf("prompt tokens from the KV cache (usage.prompt_tokens_details.cached_tokens): %lld of %lld (%s); "
           "analysis %s, feedback %s\n", k, p, grade_fmt(a, sizeof a, p ? 100.0 * (double)k / (double)p : NAN, 1, "%"),
           grade_fmt(b, sizeof b, g->ptok_sum[0] ? 100.0 * (double)g->cached_sum[0] / (double)g->ptok_sum[0] : NAN, 1, "%"),
           grade_fmt(c, sizeof c, g->ptok_sum[1] ? 100.0 * (double)g->cached_sum[1] / (double)g->ptok_sum[1] : NAN, 1, "%"));
}

void grade_summary(grade_class *g, double wall_s, grade_router_counts before, grade_router_counts after) {
    const grade_opts *o = g->o;
    char a[32], b[32], c[32], d[32], e[32], f[32];
    printf("tandem grade: %d submissions: %d graded (%d with an analysis that does not follow the schema), %d failed, "
           "%d flagged (empty or binary, not graded), %d skipped (already graded)\n", g->n, g->graded, g->invalid, g->failed,
           g->flagged, g->skipped);
    printf("wall time %.1f s, %s submissions/hour (graded ones, --parallel %d)\n", wall_s,
           grade_fmt(a, sizeof a, wall_s > 0 && g->finished ? g->graded / wall_s * 3600 : NAN, 1, ""), o->parallel);
    printf("latency per submission: p50 %s, p90 %s, max %s\n", grade_fmt(a, sizeof a, grade_pct(&g->latency, 0.5) / 1e3, 2, " s"),
           grade_fmt(b, sizeof b, grade_pct(&g->latency, 0.9) / 1e3, 2, " s"),
           grade_fmt(c, sizeof c, grade_pct(&g->latency, 1.0) / 1e3, 2, " s"));
    for (int w = 0; w < 2; w++) {
        printf("%s (%s): TTFT p50 %s, p90 %s; TPOT p50 %s, p90 %s; tokens per request: prompt %s, completion %s (mean of %d)\n",
               w ? "feedback" : "analysis", w ? o->model_b : o->model_a,
               grade_fmt(a, sizeof a, grade_pct(&g->ttft[w], 0.5), 0, " ms"), grade_fmt(b, sizeof b, grade_pct(&g->ttft[w], 0.9), 0, " ms"),
               grade_fmt(c, sizeof c, grade_pct(&g->tpot[w], 0.5), 1, " ms"), grade_fmt(d, sizeof d, grade_pct(&g->tpot[w], 0.9), 1, " ms"),
               grade_fmt(e, sizeof e, grade_mean(&g->ptok[w]), 0, ""), grade_fmt(f, sizeof f, grade_mean(&g->ctok[w]), 0, ""),
               g->ptok[w].n);
    }
    grade_print_cached(g);
    printf("prefill plans of this run's requests (X-Tandem-Prefill-Plan): split %d, local %d\n", g->plan_split, g->plan_local);
    if (before.ok && after.ok)
        printf("router during the run (/metrics, all clients): prefilled split %.0f, local %.0f; decisions split %.0f, local %.0f\n",
               after.split - before.split, after.local - before.local, after.dec_split - before.dec_split,
               after.dec_local - before.dec_local);
    else
        printf("router during the run: no tandem /metrics at %s\n", o->router);
    printf("report: %s/report.md, %s/report.html\n", o->out, o->out);
}

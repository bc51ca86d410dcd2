/* grade_report.c - the class report of `tandem grade`: report.md,
 * report.html (self-contained: inline CSS and SVG, no script, no external
 * resource), totals.svg and one feedback/STEM.md per student, all rendered
 * from the per-submission records. Every string from a record (names,
 * model output, error messages) is escaped for where it goes. */
#include "grade/grade.h"
#include "base/strbuf.h"

#include <errno.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <time.h>
#include <unistd.h>

/* ==== Escaping ==== */

static void rp_html(strbuf *b, const char *s) {
    for (; s && *s; s++) {
        switch (*s) {
        case '&': strbuf_puts(b, "&amp;"); break;
        case '<': strbuf_puts(b, "&lt;"); break;
        case '>': strbuf_puts(b, "&gt;"); break;
        case '"': strbuf_puts(b, "&quot;"); break;
        case '\'': strbuf_puts(b, "&#39;"); break;
        default: strbuf_put(b, s, 1);
        }
    }
}

/* One Markdown table cell: no line breaks, no pipes, no raw HTML. */
static void rp_md_cell(strbuf *b, const char *s, size_t max) {
    size_t n = 0;
    for (; s && *s && n < max; s++, n++) {
        if (*s == '|') strbuf_puts(b, "\\|");
        else if (*s == '\n' || *s == '\r') strbuf_puts(b, " ");
        else if (*s == '<') strbuf_puts(b, "&lt;");
        else if (*s == '>') strbuf_puts(b, "&gt;");
        else strbuf_put(b, s, 1);
    }
    if (s && *s) strbuf_puts(b, "...");
}

static int rp_write(const char *dir, const char *name, const strbuf *b, char *err, size_t errlen) {
    char path[4200], tmp[4300];
    snprintf(path, sizeof path, "%s/%s", dir, name);
    snprintf(tmp, sizeof tmp, "%s.tmp", path);
    if (b->oom) { snprintf(err, errlen, "out of memory rendering %s", name); return -1; }
    FILE *f = grade_create_file(tmp);
    int ok = f && fwrite(b->p ? b->p : "", 1, b->len, f) == b->len;
    if (f) ok &= fclose(f) == 0;
    if (!ok || rename(tmp, path)) {
        snprintf(err, errlen, "cannot write %s: %s", path, strerror(errno));
        unlink(tmp);
        return -1;
    }
    return 0;
}

/* ==== Record access ==== */

static const char *rp_get_str(json_t *o, const char *k) {
    const char *s = json_string_value(json_object_get(o, k));
    return s ? s : "";
}

static int rp_graded(json_t *rec) { return !strcmp(rp_get_str(rec, "status"), "graded"); }
static int rp_has_total(json_t *rec) { return rp_graded(rec) && json_is_integer(json_object_get(rec, "total")); }

static void rp_stem(json_t *rec, char *out, size_t n) { grade_file_stem(rp_get_str(rec, "submission"), out, n); }

/* ==== Chart ==== */

/* Bins of the histogram: one per point value up to 12 values, else ten. */
static int rp_bins(int max_total) { return max_total + 1 <= 12 ? max_total + 1 : 10; }

static int rp_bin_of(int total, int max_total, int nb) {
    int b = (int)((double)total * nb / (max_total + 1));
    return b < 0 ? 0 : b >= nb ? nb - 1 : b;
}

char *grade_report_svg(const grade_rubric *r, json_t *const *recs, int n) {
    enum { W = 640, H = 260, L = 44, R = 16, T = 34, B = 44 };
    int nb = rp_bins(r->max_total), counts[16] = {0}, peak = 0, graded = 0;
    for (int i = 0; i < n; i++) {
        if (!rp_has_total(recs[i])) continue;
        int t = (int)json_integer_value(json_object_get(recs[i], "total"));
        counts[rp_bin_of(t, r->max_total, nb)]++;
        graded++;
    }
    for (int k = 0; k < nb; k++) if (counts[k] > peak) peak = counts[k];
    strbuf b = {0};
    strbuf_printf(&b, "<svg xmlns=\"http://www.w3.org/2000/svg\" width=\"%d\" height=\"%d\" viewBox=\"0 0 %d %d\" "
                  "role=\"img\" aria-label=\"Distribution of totals\" font-family=\"sans-serif\" font-size=\"12\">\n",
              W, H, W, H);
    strbuf_printf(&b, "<rect width=\"%d\" height=\"%d\" fill=\"#ffffff\"/>\n", W, H);
    strbuf_printf(&b, "<text x=\"%d\" y=\"20\" font-size=\"14\" font-weight=\"bold\">Distribution of totals "
                  "(%d %s, out of %d points)</text>\n", L, graded, graded == 1 ? "total" : "totals", r->max_total);
    int ph = H - T - B, pw = W - L - R;
    strbuf_printf(&b, "<line x1=\"%d\" y1=\"%d\" x2=\"%d\" y2=\"%d\" stroke=\"#333\"/>\n", L, T + ph, L + pw, T + ph);
    strbuf_printf(&b, "<line x1=\"%d\" y1=\"%d\" x2=\"%d\" y2=\"%d\" stroke=\"#333\"/>\n", L, T, L, T + ph);
    strbuf_printf(&b, "<text x=\"%d\" y=\"%d\" text-anchor=\"end\">%d</text>\n", L - 6, T + 4, peak);
    strbuf_printf(&b, "<text x=\"%d\" y=\"%d\" text-anchor=\"end\">0</text>\n", L - 6, T + ph + 4);
    double bw = (double)pw / nb;
    for (int k = 0; k < nb; k++) {
        int lo = (int)ceil((double)k * (r->max_total + 1) / nb);
        int hi = (int)ceil((double)(k + 1) * (r->max_total + 1) / nb) - 1;
        double h = peak ? (double)counts[k] / peak * (ph - 4) : 0;
        double x = L + k * bw + 3;
        strbuf_printf(&b, "<rect class=\"bar\" x=\"%.1f\" y=\"%.1f\" width=\"%.1f\" height=\"%.1f\" fill=\"#3b6ea8\"><title>%d-%d: %d</title></rect>\n",
                  x, T + ph - h, bw - 6, h, lo, hi, counts[k]);
        if (counts[k]) strbuf_printf(&b, "<text x=\"%.1f\" y=\"%.1f\" text-anchor=\"middle\">%d</text>\n", x + (bw - 6) / 2, T + ph - h - 4, counts[k]);
        if (lo == hi) strbuf_printf(&b, "<text x=\"%.1f\" y=\"%d\" text-anchor=\"middle\">%d</text>\n", x + (bw - 6) / 2, T + ph + 16, lo);
        else strbuf_printf(&b, "<text x=\"%.1f\" y=\"%d\" text-anchor=\"middle\">%d-%d</text>\n", x + (bw - 6) / 2, T + ph + 16, lo, hi);
    }
    strbuf_printf(&b, "<text x=\"%d\" y=\"%d\" text-anchor=\"middle\">total points</text>\n", L + pw / 2, H - 8);
    if (!graded) strbuf_printf(&b, "<text x=\"%d\" y=\"%d\" text-anchor=\"middle\" fill=\"#888\">no totals yet</text>\n", L + pw / 2, T + ph / 2);
    strbuf_puts(&b, "</svg>\n");
    return strbuf_take(&b, NULL);
}

/* ==== Figures ==== */

typedef struct {
    int graded, failed, invalid, with_total;
    double mean, median;
    int min, max;
    long long prompt_tokens, cached_tokens;   /* over every request of the records (timings) */
} rp_stats;

/* A record's requests' prompt and cached tokens (timings.analysis and
 * .feedback) into s; a record read back from disk is not trusted: a count
 * outside [0, 2^30] or cached past the prompt is left out. */
static void rp_add_cached(rp_stats *s, json_t *rec) {
    static const char *const half[2] = {"analysis", "feedback"};
    for (int w = 0; w < 2; w++) {
        json_t *t = json_object_get(json_object_get(rec, "timings"), half[w]);
        json_int_t p = json_integer_value(json_object_get(t, "prompt_tokens"));
        json_int_t c = json_integer_value(json_object_get(t, "cached_tokens"));
        if (p <= 0 || p > (1 << 30) || c < 0 || c > p) continue;
        s->prompt_tokens += p;
        s->cached_tokens += c;
    }
}

/* "Prompt tokens from the KV cache: ..." (one sentence, no markup). */
static void rp_cached_line(strbuf *b, const rp_stats *s) {
    if (!s->prompt_tokens) return;
    strbuf_printf(b, "Prompt tokens from the KV cache (usage.prompt_tokens_details.cached_tokens): %lld of %lld (%.1f%%).",
                  s->cached_tokens, s->prompt_tokens, 100.0 * (double)s->cached_tokens / (double)s->prompt_tokens);
}

static int rp_cmp_int(const void *a, const void *b) { return *(const int *)a - *(const int *)b; }

static rp_stats rp_figures(json_t *const *recs, int n) {
    rp_stats s = {0};
    int *t = calloc((size_t)(n > 0 ? n : 1), sizeof *t);
    for (int i = 0; i < n; i++) {
        if (!rp_graded(recs[i])) { s.failed++; continue; }
        s.graded++;
        rp_add_cached(&s, recs[i]);
        if (!rp_has_total(recs[i])) { s.invalid++; continue; }
        if (t) t[s.with_total++] = (int)json_integer_value(json_object_get(recs[i], "total"));
    }
    if (t && s.with_total) {
        qsort(t, (size_t)s.with_total, sizeof *t, rp_cmp_int);
        double sum = 0;
        for (int i = 0; i < s.with_total; i++) sum += t[i];
        s.mean = sum / s.with_total;
        s.median = s.with_total % 2 ? t[s.with_total / 2] : (t[s.with_total / 2 - 1] + t[s.with_total / 2]) / 2.0;
        s.min = t[0];
        s.max = t[s.with_total - 1];
    }
    free(t);
    return s;
}

/* ==== Markdown ==== */

static void rp_md_row(strbuf *b, const grade_rubric *r, json_t *rec) {
    char stem[256];
    rp_stem(rec, stem, sizeof stem);
    strbuf_puts(b, "| ");
    rp_md_cell(b, rp_get_str(rec, "submission"), 120);
    json_t *scores = json_object_get(rec, "scores");
    for (int k = 0; k < r->n_items; k++) {
        json_t *sc = json_object_get(json_object_get(scores, r->items[k].key), "score");
        if (json_is_integer(sc)) strbuf_printf(b, " | %lld", (long long)json_integer_value(sc));
        else strbuf_puts(b, " | -");
    }
    if (rp_has_total(rec)) strbuf_printf(b, " | **%lld**", (long long)json_integer_value(json_object_get(rec, "total")));
    else strbuf_puts(b, " | -");
    strbuf_puts(b, " | ");
    if (!rp_graded(rec)) {   /* a flagged record's error says "flagged: ..." itself */
        if (strcmp(rp_get_str(rec, "status"), "flagged")) strbuf_puts(b, "failed: ");
        rp_md_cell(b, rp_get_str(rec, "error"), 160);
    }
    else {
        if (json_is_string(json_object_get(rec, "feedback"))) strbuf_printf(b, "[feedback](feedback/%s.md)", stem);
        if (!json_is_true(json_object_get(rec, "analysis_valid"))) {
            strbuf_puts(b, "; analysis invalid: ");
            rp_md_cell(b, rp_get_str(json_object_get(rec, "analysis_error"), "message"), 120);
        }
    }
    strbuf_puts(b, " |\n");
}

static void rp_markdown(strbuf *b, const grade_rubric *r, json_t *const *recs, int n, const rp_stats *s, const char *when) {
    strbuf_puts(b, "# Class report");
    if (r->title[0]) { strbuf_puts(b, ": "); rp_md_cell(b, r->title, 160); }
    strbuf_printf(b, "\n\n%d submissions: %d graded, %d failed", n, s->graded, s->failed);
    if (s->invalid) strbuf_printf(b, " (%d graded without valid scores: the analysis did not follow the schema)", s->invalid);
    strbuf_printf(b, ". Generated %s.\n\n", when);
    if (s->prompt_tokens) { rp_cached_line(b, s); strbuf_puts(b, "\n\n"); }
    strbuf_puts(b, "| Student");
    for (int k = 0; k < r->n_items; k++) {
        strbuf_puts(b, " | ");
        rp_md_cell(b, r->items[k].name, 60);
        strbuf_printf(b, " (%d)", r->items[k].max_points);
    }
    strbuf_printf(b, " | Total (%d) | Feedback |\n|---", r->max_total);
    for (int k = 0; k < r->n_items; k++) strbuf_puts(b, "|---:");
    strbuf_puts(b, "|---:|---|\n");
    for (int i = 0; i < n; i++) rp_md_row(b, r, recs[i]);
    strbuf_puts(b, "\n## Distribution of totals\n\n![Distribution of totals](totals.svg)\n\n");
    if (s->with_total)
        strbuf_printf(b, "Mean %.1f, median %.1f, lowest %d, highest %d (of %d points; %d totals).\n",
                  s->mean, s->median, s->min, s->max, r->max_total, s->with_total);
    else
        strbuf_puts(b, "No totals yet.\n");
}

static void rp_feedback_md(strbuf *b, const grade_rubric *r, json_t *rec) {
    strbuf_puts(b, "# Feedback: ");
    rp_md_cell(b, rp_get_str(rec, "submission"), 200);
    strbuf_puts(b, "\n\n");
    strbuf_puts(b, rp_get_str(rec, "feedback"));
    strbuf_puts(b, "\n");
    json_t *scores = json_object_get(rec, "scores");
    if (!json_is_object(scores)) return;
    strbuf_puts(b, "\n## Scores\n\n");
    for (int k = 0; k < r->n_items; k++) {
        json_t *x = json_object_get(scores, r->items[k].key);
        strbuf_puts(b, "- ");
        rp_md_cell(b, r->items[k].name, 80);
        strbuf_printf(b, ": %lld / %d. ", (long long)json_integer_value(json_object_get(x, "score")), r->items[k].max_points);
        rp_md_cell(b, rp_get_str(x, "justification"), 2000);
        strbuf_puts(b, "\n");
    }
    strbuf_printf(b, "\nTotal: %lld / %d\n", (long long)json_integer_value(json_object_get(rec, "total")), r->max_total);
}

/* ==== HTML ==== */

static const char rp_css[] =
    "body{font-family:system-ui,sans-serif;margin:2em auto;max-width:72em;padding:0 1em;color:#222}"
    "table{border-collapse:collapse;margin:1em 0}th,td{border:1px solid #ccc;padding:.3em .6em}"
    "th{background:#eef2f7}td.n{text-align:right}tr.failed td{background:#fdecea}tr.invalid td{background:#fff8e1}"
    "section.student{border-top:1px solid #ccc;margin-top:1.5em}.feedback{white-space:pre-wrap;background:#f7f7f7;"
    "padding:.8em;border-radius:4px}.muted{color:#666}";

static void rp_html_row(strbuf *b, const grade_rubric *r, json_t *rec) {
    char stem[256];
    rp_stem(rec, stem, sizeof stem);
    int graded = rp_graded(rec), total = rp_has_total(rec);
    strbuf_printf(b, "<tr class=\"%s\"><td><a href=\"#student-", !graded ? "failed" : total ? "ok" : "invalid");
    rp_html(b, stem);
    strbuf_puts(b, "\">");
    rp_html(b, rp_get_str(rec, "submission"));
    strbuf_puts(b, "</a></td>");
    json_t *scores = json_object_get(rec, "scores");
    for (int k = 0; k < r->n_items; k++) {
        json_t *sc = json_object_get(json_object_get(scores, r->items[k].key), "score");
        if (json_is_integer(sc)) strbuf_printf(b, "<td class=\"n\">%lld</td>", (long long)json_integer_value(sc));
        else strbuf_puts(b, "<td class=\"n muted\">-</td>");
    }
    if (total) strbuf_printf(b, "<td class=\"n\"><b>%lld</b></td><td>", (long long)json_integer_value(json_object_get(rec, "total")));
    else strbuf_puts(b, "<td class=\"n muted\">-</td><td>");
    if (!graded) {
        if (strcmp(rp_get_str(rec, "status"), "flagged")) strbuf_puts(b, "failed: ");
        rp_html(b, rp_get_str(rec, "error"));
    }
    else if (!total) strbuf_puts(b, "analysis did not follow the schema");
    else strbuf_puts(b, "graded");
    strbuf_puts(b, "</td></tr>\n");
}

static void rp_html_student(strbuf *b, const grade_rubric *r, json_t *rec) {
    char stem[256];
    rp_stem(rec, stem, sizeof stem);
    strbuf_puts(b, "<section class=\"student\" id=\"student-");
    rp_html(b, stem);
    strbuf_puts(b, "\"><h3>");
    rp_html(b, rp_get_str(rec, "submission"));
    strbuf_puts(b, "</h3>\n");
    if (!rp_graded(rec)) {
        strbuf_puts(b, "<p>Not graded: ");
        rp_html(b, rp_get_str(rec, "error"));
        strbuf_puts(b, "</p>\n");
    }
    if (json_is_string(json_object_get(rec, "feedback"))) {
        strbuf_puts(b, "<h4>Feedback</h4>\n<div class=\"feedback\">");
        rp_html(b, rp_get_str(rec, "feedback"));
        strbuf_puts(b, "</div>\n");
    }
    json_t *scores = json_object_get(rec, "scores");
    if (json_is_object(scores)) {
        strbuf_puts(b, "<h4>Scores</h4>\n<ul>\n");
        for (int k = 0; k < r->n_items; k++) {
            json_t *x = json_object_get(scores, r->items[k].key);
            strbuf_puts(b, "<li><b>");
            rp_html(b, r->items[k].name);
            strbuf_printf(b, "</b>: %lld / %d. ", (long long)json_integer_value(json_object_get(x, "score")), r->items[k].max_points);
            rp_html(b, rp_get_str(x, "justification"));
            strbuf_puts(b, "</li>\n");
        }
        strbuf_puts(b, "</ul>\n");
        json_t *probs = json_object_get(json_object_get(rec, "analysis"), "problems");
        if (json_array_size(probs)) {
            strbuf_puts(b, "<h4>Problems found</h4>\n<ul>\n");
            size_t i;
            json_t *p;
            json_array_foreach(probs, i, p) {
                strbuf_puts(b, "<li>");
                rp_html(b, rp_get_str(p, "file"));
                strbuf_printf(b, ":%lld: ", (long long)json_integer_value(json_object_get(p, "line")));
                rp_html(b, rp_get_str(p, "description"));
                strbuf_puts(b, "</li>\n");
            }
            strbuf_puts(b, "</ul>\n");
        }
    } else if (rp_graded(rec)) {
        strbuf_puts(b, "<p class=\"muted\">No scores: the analysis did not follow the schema (");
        rp_html(b, rp_get_str(json_object_get(rec, "analysis_error"), "message"));
        strbuf_puts(b, ").</p>\n");
    }
    strbuf_puts(b, "<p class=\"muted\">Record: <a href=\"");
    rp_html(b, stem);
    strbuf_puts(b, ".json\">");
    rp_html(b, stem);
    strbuf_puts(b, ".json</a> &middot; <a href=\"#top\">back to the table</a></p>\n</section>\n");
}

static void rp_html_page(strbuf *b, const grade_rubric *r, json_t *const *recs, int n, const rp_stats *s,
                         const char *svg, const char *when) {
    strbuf_puts(b, "<!DOCTYPE html>\n<html lang=\"en\"><head><meta charset=\"utf-8\">\n<title>Class report");
    if (r->title[0]) { strbuf_puts(b, ": "); rp_html(b, r->title); }
    strbuf_printf(b, "</title>\n<style>%s</style>\n</head><body>\n<h1 id=\"top\">Class report", rp_css);
    if (r->title[0]) { strbuf_puts(b, ": "); rp_html(b, r->title); }
    strbuf_printf(b, "</h1>\n<p>%d submissions: %d graded, %d failed", n, s->graded, s->failed);
    if (s->invalid) strbuf_printf(b, " (%d graded without valid scores)", s->invalid);
    strbuf_printf(b, ". Generated %s.</p>\n", when);
    if (s->prompt_tokens) { strbuf_puts(b, "<p>"); rp_cached_line(b, s); strbuf_puts(b, "</p>\n"); }
    strbuf_puts(b, "<table>\n<tr><th>Student</th>");
    for (int k = 0; k < r->n_items; k++) {
        strbuf_puts(b, "<th>");
        rp_html(b, r->items[k].name);
        strbuf_printf(b, " (%d)</th>", r->items[k].max_points);
    }
    strbuf_printf(b, "<th>Total (%d)</th><th>Status</th></tr>\n", r->max_total);
    for (int i = 0; i < n; i++) rp_html_row(b, r, recs[i]);
    strbuf_puts(b, "</table>\n<h2>Distribution of totals</h2>\n<figure id=\"chart\">\n");
    strbuf_puts(b, svg ? svg : "");
    if (s->with_total)
        strbuf_printf(b, "<figcaption>Mean %.1f, median %.1f, lowest %d, highest %d (of %d points).</figcaption>\n",
                  s->mean, s->median, s->min, s->max, r->max_total);
    strbuf_puts(b, "</figure>\n<h2>Students</h2>\n");
    for (int i = 0; i < n; i++) rp_html_student(b, r, recs[i]);
    strbuf_puts(b, "</body></html>\n");
}

/* ==== Entry ==== */

int grade_report_write(const char *dir, const grade_rubric *r, json_t *const *recs, int n, char *err, size_t errlen) {
    char when[32], fdir[4200];
    time_t now = time(NULL);
    struct tm tm;
    strftime(when, sizeof when, "%Y-%m-%d %H:%M UTC", gmtime_r(&now, &tm));
    rp_stats s = rp_figures(recs, n);
    char *svg = grade_report_svg(r, recs, n);
    strbuf md = {0}, html = {0}, svgb = {0};
    rp_markdown(&md, r, recs, n, &s, when);
    rp_html_page(&html, r, recs, n, &s, svg, when);
    if (svg) strbuf_puts(&svgb, svg);
    else svgb.oom = 1;
    int rc = rp_write(dir, "report.md", &md, err, errlen) || rp_write(dir, "report.html", &html, err, errlen) ||
             rp_write(dir, "totals.svg", &svgb, err, errlen) ? -1 : 0;
    snprintf(fdir, sizeof fdir, "%s/feedback", dir);
    struct stat fst;
    if (!rc && mkdir(fdir, 0755) && errno != EEXIST) { snprintf(err, errlen, "cannot create %s: %s", fdir, strerror(errno)); rc = -1; }
    /* an existing feedback/ must be a folder, not a link to one elsewhere */
    if (!rc && (lstat(fdir, &fst) || !S_ISDIR(fst.st_mode))) {
        snprintf(err, errlen, "%s is not a folder (a symbolic link is not followed)", fdir);
        rc = -1;
    }
    for (int i = 0; i < n && !rc; i++) {
        if (!rp_graded(recs[i]) || !json_is_string(json_object_get(recs[i], "feedback"))) continue;
        strbuf fb = {0};
        char stem[256], name[300];
        rp_stem(recs[i], stem, sizeof stem);
        snprintf(name, sizeof name, "%s.md", stem);
        rp_feedback_md(&fb, r, recs[i]);
        rc = rp_write(fdir, name, &fb, err, errlen);
        strbuf_free(&fb);
    }
    free(svg);
    strbuf_free(&md);
    strbuf_free(&html);
    strbuf_free(&svgb);
    return rc;
}

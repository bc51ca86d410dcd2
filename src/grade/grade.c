/* grade.c - `tandem grade`: grade a class of submissions through a tandem
 * router (or any OpenAI-compatible server).
 *
 * K worker threads each take the next submission and send its two chat
 * requests at once (the analysis on this thread, the feedback on a helper
 * thread), both streamed so that time to first token and time per output
 * token are measured. A request answered 429 or 503, or a router that cannot
 * be reached, is retried with exponential back-off; anything else that fails
 * is recorded as the submission's failure and the class goes on. Each
 * submission's record is written atomically to DIR/STEM.json; a rerun skips
 * records already graded with the same rubric, submission and models.
 * `--bench N` grades a synthetic class of fixed-length requests.
 *
 * This file holds the options, the class (one submission's two requests, the
 * workers, resuming), setup and cli_grade; grade_files.c the files and
 * submissions, grade_call.c one streamed request, grade_summary.c progress
 * and the summary, grade_bench.c the synthetic class; grade_internal.h the
 * types they share.
 */
#include "grade/grade_internal.h"
#include "base/cliopt.h"
#include "grade/grade_check.h"

#include <curl/curl.h>
#include <errno.h>
#include <math.h>
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>

/* ==== Options ==== */

static void grade_usage(FILE *f) {
    fprintf(f,
        "usage: tandem grade --router URL --rubric RUBRIC.md --analysis-model A --feedback-model B\n"
        "                    --out DIR [options] SUBMISSION...\n"
        "       tandem grade --bench N --router URL --analysis-model A --feedback-model B --out DIR [options]\n"
        "       tandem grade --write-templates DIR\n"
        "  SUBMISSION            a code file, or a folder (one submission, every text file in it)\n"
        "  --parallel K          submissions in flight (default 4)\n"
        "  --analysis-template F, --feedback-template F   prompt templates (defaults built in)\n"
        "  --analysis-tokens N   max_tokens of the analysis (default 1024; bench 384)\n"
        "  --feedback-tokens N   max_tokens of the feedback (default 768; bench 512)\n"
        "  --analysis-temp T, --feedback-temp T   temperatures (default 0: greedy)\n"
        "  --retries N           retries of a request answered 429/503 (default 6)\n"
        "  --backoff S           first retry delay in seconds, doubled each time (default 0.5)\n"
        "  --timeout S           per-request time limit (default 600)\n"
        "  --max-bytes N         largest submission listing in bytes (default 200000)\n"
        "  --api-key KEY         Bearer token (or env TANDEM_API_KEY)\n"
        "  --force               regrade submissions already graded\n"
        "  --regrade-invalid     regrade submissions whose analysis did not follow the schema\n"
        "  --ignore-eos          generate exactly max_tokens (fixed lengths; --bench sets it)\n"
        "  --no-schema           send no response_format (--bench sets it)\n"
        "  --quiet               no progress line\n"
        "  --bench N             grade a synthetic class of N submissions (3,000-6,000 prompt tokens\n"
        "                        with the rubric) written to DIR/bench-input; regrades every run\n");
}

#define GRADE "tandem grade"

static int grade_int(const char *opt, const char *v, int lo, int hi, int *out) {
    return cliopt_int(GRADE, opt, v, lo, hi, out);
}

static int grade_double(const char *opt, const char *v, double lo, double hi, double *out) {
    return cliopt_double(GRADE, opt, v, lo, hi, out);
}

/* Flags without a value; 1 if a was one. */
static int grade_flag(const char *a, grade_opts *o) {
    if (!strcmp(a, "--force")) o->force = 1;
    else if (!strcmp(a, "--regrade-invalid")) o->regrade_invalid = 1;
    else if (!strcmp(a, "--ignore-eos")) o->ignore_eos = 1;
    else if (!strcmp(a, "--no-schema")) o->no_schema = 1;
    else if (!strcmp(a, "--quiet")) o->quiet = 1;
    else return 0;
    return 1;
}

static int grade_parse(int argc, char **argv, grade_opts *o) {
    memset(o, 0, sizeof *o);
    o->parallel = 4; o->retries = 6; o->timeout_s = 600; o->max_bytes = 200000; o->backoff_s = 0.5;
    o->api_key = getenv("TANDEM_API_KEY");
    o->subs = calloc((size_t)argc + 1, sizeof *o->subs);
    if (!o->subs) return -1;
    for (int i = 0; i < argc; i++) {
        const char *a = argv[i], *v = i + 1 < argc ? argv[i + 1] : NULL;
        if (a[0] != '-') { o->subs[o->n_subs++] = argv[i]; continue; }
        if (grade_flag(a, o)) continue;
        int bad = 0;
        if (!strcmp(a, "--router")) bad = cliopt_str(GRADE, a, v, &o->router);
        else if (!strcmp(a, "--rubric")) bad = cliopt_str(GRADE, a, v, &o->rubric_path);
        else if (!strcmp(a, "--analysis-model")) bad = cliopt_str(GRADE, a, v, &o->model_a);
        else if (!strcmp(a, "--feedback-model")) bad = cliopt_str(GRADE, a, v, &o->model_b);
        else if (!strcmp(a, "--out")) bad = cliopt_str(GRADE, a, v, &o->out);
        else if (!strcmp(a, "--api-key")) bad = cliopt_str(GRADE, a, v, &o->api_key);
        else if (!strcmp(a, "--analysis-template")) bad = cliopt_str(GRADE, a, v, &o->tmpl_a_path);
        else if (!strcmp(a, "--feedback-template")) bad = cliopt_str(GRADE, a, v, &o->tmpl_b_path);
        else if (!strcmp(a, "--write-templates")) bad = cliopt_str(GRADE, a, v, &o->write_templates);
        else if (!strcmp(a, "--parallel")) bad = grade_int(a, v, 1, 256, &o->parallel);
        else if (!strcmp(a, "--analysis-tokens")) bad = grade_int(a, v, 1, 1 << 20, &o->tokens_a);
        else if (!strcmp(a, "--feedback-tokens")) bad = grade_int(a, v, 1, 1 << 20, &o->tokens_b);
        else if (!strcmp(a, "--retries")) bad = grade_int(a, v, 0, 100, &o->retries);
        else if (!strcmp(a, "--timeout")) bad = grade_int(a, v, 1, 86400, &o->timeout_s);
        else if (!strcmp(a, "--max-bytes")) bad = grade_int(a, v, 1, 64 << 20, &o->max_bytes);
        else if (!strcmp(a, "--bench")) bad = grade_int(a, v, 1, 10000, &o->bench);
        else if (!strcmp(a, "--analysis-temp")) bad = grade_double(a, v, 0, 2, &o->temp_a);
        else if (!strcmp(a, "--feedback-temp")) bad = grade_double(a, v, 0, 2, &o->temp_b);
        else if (!strcmp(a, "--backoff")) bad = grade_double(a, v, 0, 60, &o->backoff_s);
        else if (cliopt_is_help(a)) { grade_usage(stdout); return 1; }
        else { fprintf(stderr, GRADE ": unknown option %s (see tandem grade --help)\n", a); return -1; }
        if (bad) return -1;   /* the message is out */
        i++;
    }
    if (o->write_templates) return 0;
    if (!o->router || !o->model_a || !o->model_b || !o->out || (!o->bench && (!o->rubric_path || !o->n_subs))) {
        grade_usage(stderr);
        return -1;
    }
    if (o->bench && (o->rubric_path || o->n_subs)) {
        fprintf(stderr, "tandem grade: --bench makes its own rubric and class; give neither --rubric nor submissions\n");
        return -1;
    }
    if (o->bench) { o->force = 1; o->ignore_eos = 1; o->no_schema = 1; }
    if (!o->tokens_a) o->tokens_a = o->bench ? 384 : 1024;
    if (!o->tokens_b) o->tokens_b = o->bench ? 512 : 768;
    return 0;
}

/* ==== The class ==== */

static void grade_series_add(grade_series *s, double x) {
    if (s->n == s->cap) {
        int cap = s->cap ? s->cap * 2 : 64;
        double *v = realloc(s->v, (size_t)cap * sizeof *v);
        if (!v) return;
        s->v = v;
        s->cap = cap;
    }
    s->v[s->n++] = x;
}

static int grade_cmp_double(const void *a, const void *b) {
    double x = *(const double *)a, y = *(const double *)b;
    return x < y ? -1 : x > y;
}

/* Nearest-rank percentile (p in 0..1); NAN when empty. Sorts in place. */
double grade_pct(grade_series *s, double p) {
    if (!s->n) return NAN;
    qsort(s->v, (size_t)s->n, sizeof *s->v, grade_cmp_double);
    int i = (int)ceil(p * s->n) - 1;
    return s->v[i < 0 ? 0 : i >= s->n ? s->n - 1 : i];
}

static char *grade_request_body(const grade_class *g, int which, const grade_sub *s) {
    const grade_opts *o = g->o;
    grade_vars v = { g->rubric.text, g->schema_text, g->items_text, g->max_total_text, s->name, s->listing };
    char *sys = grade_template_render(g->tmpl[which].system, &v), *usr = grade_template_render(g->tmpl[which].user, &v);
    char *body = NULL;
    json_t *msgs = json_array();
    if (sys && usr && msgs) {
        if (*sys) json_array_append_new(msgs, json_pack("{s:s, s:s}", "role", "system", "content", sys));
        json_array_append_new(msgs, json_pack("{s:s, s:s}", "role", "user", "content", usr));
        json_t *req = json_pack("{s:s, s:O, s:i, s:f, s:b, s:{s:b}}", "model", which ? o->model_b : o->model_a,
                                "messages", msgs, "max_tokens", which ? o->tokens_b : o->tokens_a,
                                "temperature", which ? o->temp_b : o->temp_a, "stream", 1,
                                "stream_options", "include_usage", 1);
        if (req && which == GRADE_A && !o->no_schema)
            json_object_set_new(req, "response_format",
                                json_pack("{s:s, s:{s:s, s:b, s:o}}", "type", "json_schema", "json_schema",
                                          "name", "rubric_analysis", "strict", 1, "schema",
                                          json_loads(g->schema_text, 0, NULL)));   /* a private copy per thread */
        if (req && o->ignore_eos) json_object_set_new(req, "ignore_eos", json_true());
        body = req ? json_dumps(req, JSON_COMPACT) : NULL;
        json_decref(req);
    }
    json_decref(msgs);
    free(sys);
    free(usr);
    return body;
}

/* Per-request figures; start_ms/end_ms count from the start of the run (t0). */
static json_t *grade_call_timing(const grade_call *c, double t0) {
    double ttft = c->chunks ? c->t_first - c->t_send : -1;
    double tpot = c->completion_tokens > 1 && c->chunks > 1 ? (c->t_last - c->t_first) / (c->completion_tokens - 1) : -1;
    json_t *t = json_pack("{s:i, s:f, s:i, s:i, s:i}", "attempts", c->attempts, "total_ms", c->t_end - c->t_send,
                          "prompt_tokens", c->prompt_tokens, "cached_tokens", c->cached_tokens,
                          "completion_tokens", c->completion_tokens);
    json_object_set_new(t, "ttft_ms", ttft >= 0 ? json_real(ttft) : json_null());
    json_object_set_new(t, "tpot_ms", tpot >= 0 ? json_real(tpot) : json_null());
    json_object_set_new(t, "finish_reason", c->finish[0] ? json_string(c->finish) : json_null());
    json_object_set_new(t, "start_ms", json_real(c->t_send - t0));
    json_object_set_new(t, "end_ms", json_real(c->t_end - t0));
    return t;
}

static json_t *grade_call_nodes(const grade_call *c) {
    json_t *n = json_pack("{s:s}", "model", c->model);
    json_object_set_new(n, "decode_node", c->decode_node[0] ? json_string(c->decode_node) : json_null());
    json_object_set_new(n, "prefill_plan", c->plan[0] ? json_string(c->plan) : json_null());
    json_object_set_new(n, "prefill_node", c->prefill_node[0] ? json_string(c->prefill_node) : json_null());
    json_object_set_new(n, "split", c->plan[0] ? json_boolean(!strcmp(c->plan, "split")) : json_null());
    return n;
}

/* Scores, total and the analysis (or the analysis error) into rec. */
static void grade_fill_analysis(const grade_class *g, json_t *rec, const grade_call *c, json_t *files) {
    char err[512];
    json_t *a = grade_analysis_parse(&g->rubric, g->schema, c->text.p ? c->text.p : "", err, sizeof err);
    json_object_set_new(rec, "analysis_valid", json_boolean(a != NULL));
    if (!a) {
        if (!strcmp(c->finish, "length")) strncat(err, " (the answer was cut at max_tokens)", sizeof err - strlen(err) - 1);
        json_object_set_new(rec, "analysis", json_null());
        json_object_set_new(rec, "analysis_error", json_pack("{s:o, s:o}", "message", grade_json_text(err),
                                                             "raw", grade_json_text(c->text.p ? c->text.p : "")));
        json_object_set_new(rec, "scores", json_null());
        json_object_set_new(rec, "total", json_null());
        return;
    }
    json_t *scores = json_object(), *as = json_object_get(a, "scores");
    json_int_t sum = 0;
    for (int i = 0; i < g->rubric.n_items; i++) {
        const grade_item *it = &g->rubric.items[i];
        json_t *x = json_object_get(as, it->key);
        json_int_t sc = (json_int_t)json_number_value(json_object_get(x, "score"));
        sum += sc;
        json_object_set_new(scores, it->key, json_pack("{s:s, s:I, s:i, s:O}", "item", it->name, "score", sc,
                                                       "max", it->max_points, "justification",
                                                       json_object_get(x, "justification")));
    }
    json_t *mt = json_object_get(a, "total");
    /* a problem must point at a line the submission has */
    int unlocated = 0;
    json_object_set_new(rec, "problem_checks", grade_check_problems(a, files, &unlocated));
    json_object_set_new(rec, "problems_unlocated", json_integer(unlocated));
    json_object_set_new(rec, "scores", scores);
    /* the total is the sum of the item scores; the model's own sum is kept when it differs */
    json_object_set_new(rec, "total", json_integer(sum));
    if ((json_int_t)json_number_value(mt) != sum) json_object_set_new(rec, "model_total", json_integer((json_int_t)json_number_value(mt)));
    json_object_set_new(rec, "analysis", a);
}

static json_t *grade_record_base(const grade_class *g, const grade_sub *s) {
    const grade_opts *o = g->o;
    char when[32];
    time_t now = time(NULL);
    struct tm tm;
    strftime(when, sizeof when, "%Y-%m-%dT%H:%M:%SZ", gmtime_r(&now, &tm));
    return json_pack("{s:s, s:o, s:s, s:s, s:s, s:s, s:O, s:{s:s, s:s}, s:i}", "submission", s->name, "path", grade_json_text(s->path),
                     "status", "failed", "graded_at", when, "rubric_sha256", g->rubric_sha, "submission_sha256", s->sha,
                     "files", s->files, "models", "analysis", o->model_a, "feedback", o->model_b,
                     "max_total", g->rubric.max_total);
}

static int grade_record_write(const grade_class *g, const grade_sub *s, json_t *rec) {
    char path[4096], *text = json_dumps(rec, JSON_INDENT(2));
    snprintf(path, sizeof path, "%s/%s.json", g->o->out, s->stem);
    int rc = text ? grade_write_text(path, text) : -1;
    free(text);
    if (rc) fprintf(stderr, "\ntandem grade: cannot write %s: %s\n", path, strerror(errno));
    return rc;
}

static void grade_count(grade_class *g, const grade_call *c, int which) {
    if (c->failed) return;
    if (c->chunks) grade_series_add(&g->ttft[which], c->t_first - c->t_send);
    if (c->completion_tokens > 1 && c->chunks > 1) grade_series_add(&g->tpot[which], (c->t_last - c->t_first) / (c->completion_tokens - 1));
    grade_series_add(&g->ptok[which], c->prompt_tokens);
    g->ptok_sum[which] += c->prompt_tokens;
    g->cached_sum[which] += c->cached_tokens;
    grade_series_add(&g->ctok[which], c->completion_tokens);
    if (!strcmp(c->plan, "split")) g->plan_split++;
    else if (c->plan[0]) g->plan_local++;
}

static void *grade_call_thread(void *arg) {
    grade_call_run(arg);
    return NULL;
}

/* Grades one submission: both requests at once, then its record. */
static void grade_one(grade_class *g, grade_sub *s) {
    double t0 = grade_now_ms();
    json_t *rec = grade_record_base(g, s);
    grade_call c[2] = { { .o = g->o, .model = g->o->model_a }, { .o = g->o, .model = g->o->model_b } };
    int ok = 0, need[2] = {1, 1};
    if (s->prev) {   /* a half an earlier run finished is kept: only the other is asked for */
        int have_a, have_b;
        grade_prev_halves(s->prev, g->o->regrade_invalid, &have_a, &have_b);
        need[GRADE_A] = !have_a;
        need[GRADE_B] = !have_b;
    }
    if (!s->error[0]) {
        if (need[GRADE_A]) c[0].body = grade_request_body(g, GRADE_A, s);
        if (need[GRADE_B]) c[1].body = grade_request_body(g, GRADE_B, s);
        if ((need[GRADE_A] && !c[0].body) || (need[GRADE_B] && !c[1].body)) snprintf(s->error, sizeof s->error, "out of memory");
    }
    if (!s->error[0]) {
        pthread_t th;
        int threaded = need[GRADE_B] && need[GRADE_A] && pthread_create(&th, NULL, grade_call_thread, &c[GRADE_B]) == 0;
        if (need[GRADE_A]) grade_call_run(&c[GRADE_A]);
        if (threaded) pthread_join(th, NULL);
        else if (need[GRADE_B]) grade_call_run(&c[GRADE_B]);
        int fa = need[GRADE_A] && c[0].failed, fb = need[GRADE_B] && c[1].failed;
        ok = !fa && !fb;
        if (!ok) snprintf(s->error, sizeof s->error, "%s%.240s%s%s%.240s", fa ? "analysis: " : "", fa ? c[0].error : "",
                          fa && fb ? "; " : "", fb ? "feedback: " : "", fb ? c[1].error : "");
        if (need[GRADE_A] && !fa) grade_fill_analysis(g, rec, &c[0], s->files);
        json_object_set_new(rec, "feedback", need[GRADE_B] && !fb && c[1].text.p ? json_string(c[1].text.p) : json_null());
        json_object_set_new(rec, "timings", json_pack("{s:f, s:o, s:o}", "latency_ms", grade_now_ms() - t0,
                                                      "analysis", grade_call_timing(&c[0], g->t0),
                                                      "feedback", grade_call_timing(&c[1], g->t0)));
        json_object_set_new(rec, "nodes", json_pack("{s:o, s:o}", "analysis", grade_call_nodes(&c[0]), "feedback", grade_call_nodes(&c[1])));
        for (int w = 0; w < 2; w++)
            if (!need[w]) grade_reuse_half(rec, s->prev, w);
    }
    json_object_set_new(rec, "status", json_string(ok ? "graded" : s->flag[0] ? "flagged" : "failed"));
    if (s->flag[0]) json_object_set_new(rec, "flag", json_string(s->flag));
    if (!ok) json_object_set_new(rec, "error", grade_json_text(s->error));
    if (grade_record_write(g, s, rec) && ok) {
        ok = 0;
        json_object_set_new(rec, "status", json_string("failed"));
        json_object_set_new(rec, "error", json_string("cannot write the record"));
    }
    pthread_mutex_lock(&g->mu);
    if (ok) {
        g->graded++;
        g->invalid += !json_is_true(json_object_get(rec, "analysis_valid"));
        grade_series_add(&g->latency, grade_now_ms() - t0);
    } else if (s->flag[0]) {
        g->flagged++;
    } else {
        g->failed++;
    }
    for (int w = 0; w < 2; w++) if (need[w] && c[w].attempts) grade_count(g, &c[w], w);
    s->record = rec;
    pthread_mutex_unlock(&g->mu);
    for (int w = 0; w < 2; w++) grade_call_free(&c[w]);
}

static void *grade_worker(void *arg) {
    grade_class *g = arg;
    for (;;) {
        pthread_mutex_lock(&g->mu);
        while (g->next < g->n && g->subs[g->next].skipped) g->next++;
        int i = g->next < g->n ? g->next++ : -1;
        if (i >= 0) g->running++;
        pthread_mutex_unlock(&g->mu);
        if (i < 0) return NULL;
        grade_one(g, &g->subs[i]);
        pthread_mutex_lock(&g->mu);
        g->running--;
        g->finished++;
        pthread_cond_signal(&g->cv);
        pthread_mutex_unlock(&g->mu);
    }
}

/* ==== Resuming ==== */

/* 1 when DIR/STEM.json already holds this submission graded with the same
 * rubric, files and models (its record is then kept). */
static int grade_already_done(grade_class *g, grade_sub *s) {
    const grade_opts *o = g->o;
    if (o->force || s->error[0]) return 0;
    char path[4096];
    snprintf(path, sizeof path, "%s/%s.json", o->out, s->stem);
    json_t *r = json_load_file(path, 0, NULL);
    const char *st = json_string_value(json_object_get(r, "status"));
    const char *rs = json_string_value(json_object_get(r, "rubric_sha256"));
    const char *ss = json_string_value(json_object_get(r, "submission_sha256"));
    json_t *m = json_object_get(r, "models");
    const char *ma = json_string_value(json_object_get(m, "analysis")), *mb = json_string_value(json_object_get(m, "feedback"));
    int same = st && !strcmp(st, "graded") && rs && !strcmp(rs, g->rubric_sha) && ss && !strcmp(ss, s->sha) &&
               ma && !strcmp(ma, o->model_a) && mb && !strcmp(mb, o->model_b);
    if (same && o->regrade_invalid && !json_is_true(json_object_get(r, "analysis_valid"))) same = 0;
    int same_but_failed = st && !strcmp(st, "failed") && rs && !strcmp(rs, g->rubric_sha) && ss && !strcmp(ss, s->sha) &&
                          ma && !strcmp(ma, o->model_a) && mb && !strcmp(mb, o->model_b);
    if (same_but_failed) { s->prev = r; return 0; }   /* its finished half is kept (grade_one) */
    if (!same) { json_decref(r); return 0; }
    s->record = r;
    s->skipped = 1;
    return 1;
}

/* ==== Setup ==== */

static int grade_write_templates(const char *dir) {
    char a[4200], b[4200];
    snprintf(a, sizeof a, "%s/analysis.tmpl", dir);
    snprintf(b, sizeof b, "%s/feedback.tmpl", dir);
    if (grade_mkdirs(dir) || grade_write_text(a, grade_default_analysis_template) ||
        grade_write_text(b, grade_default_feedback_template)) {
        fprintf(stderr, "tandem grade: cannot write templates in %s: %s\n", dir, strerror(errno));
        return 1;
    }
    printf("%s\n%s\n", a, b);
    return 0;
}

static int grade_load_template(const char *path, const char *def, grade_template *t) {
    char err[512];
    char *text = path ? cliopt_read_text(path, GRADE_MAX_CONFIG_BYTES, NULL, err, sizeof err) : NULL;
    if (path && !text) { fprintf(stderr, "tandem grade: the template: %s\n", err); return -1; }
    int rc = grade_template_parse(text ? text : def, t, err, sizeof err);
    if (rc) fprintf(stderr, "tandem grade: template %s: %s\n", path ? path : "(built-in)", err);
    free(text);
    return rc;
}

static int grade_setup_rubric(grade_class *g, const char *path) {
    size_t n = 0;
    char err[512];
    char *text = cliopt_read_text(path, GRADE_MAX_CONFIG_BYTES, &n, err, sizeof err);
    if (!text) { fprintf(stderr, "tandem grade: the rubric: %s\n", err); return -1; }
    int rc = grade_rubric_parse(text, n, &g->rubric, err, sizeof err);
    free(text);
    if (rc) { fprintf(stderr, "tandem grade: rubric %s: %s\n", path, err); return -1; }
    g->schema = grade_rubric_schema(&g->rubric);
    g->schema_text = g->schema ? json_dumps(g->schema, JSON_COMPACT) : NULL;
    strbuf items = {0};
    for (int i = 0; i < g->rubric.n_items; i++)
        strbuf_printf(&items, "%s\"%s\" for %s, %d points", i ? "; " : "", g->rubric.items[i].key,
                        g->rubric.items[i].name, g->rubric.items[i].max_points);
    g->items_text = strbuf_take(&items, NULL);
    snprintf(g->max_total_text, sizeof g->max_total_text, "%d", g->rubric.max_total);
    grade_sha256_str(g->rubric.text, g->rubric_sha);
    if (!g->schema_text || !g->items_text) { fprintf(stderr, "tandem grade: out of memory\n"); return -1; }
    char sp[4200];
    snprintf(sp, sizeof sp, "%s/schema.json", g->o->out);
    char *pretty = json_dumps(g->schema, JSON_INDENT(2));
    rc = pretty ? grade_write_text(sp, pretty) : -1;
    free(pretty);
    if (rc) fprintf(stderr, "tandem grade: cannot write %s\n", sp);
    return rc;
}

/* Names, listings and resume state of every submission; -1 on a clash. */
static int grade_setup_subs(grade_class *g) {
    g->subs = calloc((size_t)g->n, sizeof *g->subs);
    if (!g->subs) return -1;
    for (int i = 0; i < g->n; i++) {
        grade_sub *s = &g->subs[i];
        s->path = g->o->subs[i];
        grade_sub_name(s);
        for (int k = 0; k < i; k++)
            if (!strcmp(g->subs[k].stem, s->stem)) {
                fprintf(stderr, "tandem grade: %s and %s would both be written to %s.json; rename one\n",
                        g->subs[k].path, s->path, s->stem);
                return -1;
            }
        if (!strcmp(s->stem, "schema") || !strcmp(s->stem, "report")) {
            fprintf(stderr, "tandem grade: a submission may not be called %s (the name of an output file)\n", s->stem);
            return -1;
        }
        grade_sub_load(s, (size_t)g->o->max_bytes);
        if (grade_already_done(g, s)) g->skipped++;
    }
    return 0;
}

static void grade_class_free(grade_class *g) {
    for (int i = 0; g->subs && i < g->n; i++) {
        free(g->subs[i].listing);
        json_decref(g->subs[i].files);
        json_decref(g->subs[i].record);
        json_decref(g->subs[i].prev);
    }
    free(g->subs);
    grade_rubric_free(&g->rubric);
    json_decref(g->schema);
    free(g->schema_text);
    free(g->items_text);
    for (int w = 0; w < 2; w++) {
        grade_template_free(&g->tmpl[w]);
        free(g->ttft[w].v); free(g->tpot[w].v); free(g->ptok[w].v); free(g->ctok[w].v);
    }
    free(g->latency.v);
    pthread_mutex_destroy(&g->mu);
    pthread_cond_destroy(&g->cv);
}

/* ==== Running ==== */

static void grade_run_workers(grade_class *g) {
    int k = g->o->parallel < g->to_do ? g->o->parallel : g->to_do;
    pthread_t *th = calloc((size_t)(k > 0 ? k : 1), sizeof *th);
    int started = 0;
    for (int i = 0; th && i < k; i++) started += pthread_create(&th[started], NULL, grade_worker, g) == 0;
    if (!started && g->to_do) { grade_worker(g); }   /* no thread could start: grade here, one at a time */
    int tty = isatty(2);
    pthread_mutex_lock(&g->mu);
    int shown = -1;
    double last = 0;
    while (g->finished < g->to_do) {
        struct timespec ts;
        clock_gettime(CLOCK_REALTIME, &ts);
        ts.tv_sec += 1;
        pthread_cond_timedwait(&g->cv, &g->mu, &ts);
        /* a terminal gets a fresh line every second; a log one line per finished
         * submission (and one every 30 s while nothing finishes) */
        double now = grade_now_ms();
        if (!g->o->quiet && (tty || g->finished != shown || now - last > 30e3)) {
            grade_progress(g, tty);
            shown = g->finished;
            last = now;
        }
    }
    pthread_mutex_unlock(&g->mu);
    for (int i = 0; i < started; i++) pthread_join(th[i], NULL);
    if (!g->o->quiet && tty) fputc('\n', stderr);
    free(th);
}

/* Records in class order for the report; a missing one becomes a failure. */
static int grade_report(grade_class *g) {
    json_t **recs = calloc((size_t)g->n, sizeof *recs);
    if (!recs) return -1;
    for (int i = 0; i < g->n; i++) {
        recs[i] = g->subs[i].record;
        if (!recs[i]) recs[i] = g->subs[i].record = json_pack("{s:s, s:s, s:s}", "submission", g->subs[i].name,
                                                              "status", "failed", "error", "not graded");
    }
    char err[512];
    int rc = grade_report_write(g->o->out, &g->rubric, recs, g->n, err, sizeof err);
    if (rc) fprintf(stderr, "tandem grade: report: %s\n", err);
    free(recs);
    return rc;
}

int cli_grade(int argc, char **argv) {
    grade_opts o;
    int pr = grade_parse(argc, argv, &o);
    if (pr) { free(o.subs); return pr > 0 ? CLI_EXIT_OK : CLI_EXIT_USAGE; }
    if (o.write_templates) { int rc = grade_write_templates(o.write_templates); free(o.subs); return rc; }
    grade_class g;
    memset(&g, 0, sizeof g);
    g.o = &o;
    pthread_mutex_init(&g.mu, NULL);
    pthread_cond_init(&g.cv, NULL);
    char *bench_rubric = NULL;
    int rc = 2;
    curl_global_init(CURL_GLOBAL_DEFAULT);
    if (grade_mkdirs(o.out)) { fprintf(stderr, "tandem grade: cannot create %s: %s\n", o.out, strerror(errno)); goto out; }
    char terr[600];
    long seen = 0;
    if (grade_check_out_tree(o.out, 0, &seen, terr, sizeof terr)) { fprintf(stderr, "tandem grade: %s\n", terr); goto out; }
    if (o.bench && grade_bench_setup(&o, &bench_rubric)) goto out;
    if (grade_setup_rubric(&g, o.bench ? bench_rubric : o.rubric_path)) goto out;
    if (grade_load_template(o.tmpl_a_path, grade_default_analysis_template, &g.tmpl[GRADE_A]) ||
        grade_load_template(o.tmpl_b_path, grade_default_feedback_template, &g.tmpl[GRADE_B])) goto out;
    g.n = o.n_subs;
    if (grade_setup_subs(&g)) goto out;
    g.to_do = g.n - g.skipped;
    char perr[1024];
    int to_send = 0;   /* submissions that will send requests: none (all failed to load, flagged), no router needed */
    for (int i = 0; i < g.n; i++) to_send += !g.subs[i].skipped && !g.subs[i].error[0];
    if (to_send > 0 && grade_preflight(o.router, o.api_key, o.model_a, o.model_b, o.no_schema ? NULL : g.schema_text,
                                       o.timeout_s, o.retries < 3 ? o.retries + 1 : 3, o.backoff_s > 0 ? o.backoff_s : 0.5,
                                       perr, sizeof perr)) {
        /* before any submission: nothing is spent on a class that cannot be graded */
        fprintf(stderr, "tandem grade: stopped before the first submission: %s\n", perr);
        rc = 1;
        goto out;
    }
    grade_router_counts before = grade_router_metrics(&o);
    if (!o.quiet)
        fprintf(stderr, "grade: %d submissions (%d already graded), rubric of %d items (%d points), %d in flight\n",
                g.n, g.skipped, g.rubric.n_items, g.rubric.max_total, o.parallel);
    g.t0 = grade_now_ms();
    grade_run_workers(&g);
    double wall = (grade_now_ms() - g.t0) / 1e3;
    grade_router_counts after = grade_router_metrics(&o);
    int rep = grade_report(&g);
    grade_summary(&g, wall, before, after);
    rc = g.failed || rep ? 1 : 0;
out:
    grade_class_free(&g);
    if (o.bench) for (int i = 0; i < o.n_subs; i++) free(o.subs[i]);
    free(o.subs);
    free(bench_rubric);
    curl_global_cleanup();
    return rc;
}

/* grade_check.c - preflight, text and location checks, finished halves
 * (grade_check.h). */
#include "grade/grade_check.h"

#include <curl/curl.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "base/strbuf.h"

/* ==== Preflight ==== */

/* A preflight answer is a model list or one token: bound what is kept. */
#define GC_MAX_REPLY (256 << 10)

static size_t gc_sink(char *p, size_t sz, size_t nm, void *ud) {
    strbuf *b = ud;
    size_t n = sz * nm;
    if (b->len + n <= GC_MAX_REPLY) strbuf_put(b, p, n);
    return n;
}

/* One request (GET when body is NULL): the HTTP status, or -1 with the
 * transport's error in err; the reply in *out (caller frees). */
static long gc_http(const char *router, const char *path, const char *api_key, const char *body, int timeout_s,
                    strbuf *out, char *err, size_t errlen) {
    char url[2048], auth[600];
    snprintf(url, sizeof url, "%s%s", router, path);
    CURL *h = curl_easy_init();
    struct curl_slist *hl = curl_slist_append(NULL, "Content-Type: application/json");
    if (api_key) { snprintf(auth, sizeof auth, "Authorization: Bearer %s", api_key); hl = curl_slist_append(hl, auth); }
    long code = -1;
    char cerr[CURL_ERROR_SIZE] = "";
    if (h && hl) {
        curl_easy_setopt(h, CURLOPT_URL, url);
        curl_easy_setopt(h, CURLOPT_HTTPHEADER, hl);
        if (body) curl_easy_setopt(h, CURLOPT_POSTFIELDS, body);
        curl_easy_setopt(h, CURLOPT_WRITEFUNCTION, gc_sink);
        curl_easy_setopt(h, CURLOPT_WRITEDATA, out);
        curl_easy_setopt(h, CURLOPT_NOSIGNAL, 1L);
        curl_easy_setopt(h, CURLOPT_TIMEOUT, (long)timeout_s);
        curl_easy_setopt(h, CURLOPT_CONNECTTIMEOUT, 10L);
        curl_easy_setopt(h, CURLOPT_ERRORBUFFER, cerr);
        if (curl_easy_perform(h) == CURLE_OK) curl_easy_getinfo(h, CURLINFO_RESPONSE_CODE, &code);
        else snprintf(err, errlen, "%s", cerr[0] ? cerr : "the request failed");
    } else {
        snprintf(err, errlen, "out of memory");
    }
    curl_slist_free_all(hl);
    curl_easy_cleanup(h);
    return code;
}

/* The "error.message" of an error body, or the body's start. */
static void gc_error_text(const strbuf *b, char *out, size_t n) {
    json_t *o = b->p ? json_loadb(b->p, b->len, 0, NULL) : NULL;
    const char *m = json_string_value(json_object_get(json_object_get(o, "error"), "message"));
    snprintf(out, n, "%.300s", m ? m : b->p ? b->p : "");
    json_decref(o);
}

/* One pass of the checks: 0, 1 transient (worth another try), -1 final. */
static int gc_preflight_once(const char *router, const char *api_key, const char *model_a, const char *model_b,
                             const char *schema_text, int timeout_s, char *err, size_t errlen) {
    strbuf b = {0};
    char why[400] = "";
    long st = gc_http(router, "/v1/models", api_key, NULL, timeout_s, &b, why, sizeof why);
    if (st < 0) {
        snprintf(err, errlen, "cannot reach the router at %s: %s", router, why);
        strbuf_free(&b);
        return 1;
    }
    if (st != 200) {
        gc_error_text(&b, why, sizeof why);
        snprintf(err, errlen, "the router at %s answered GET /v1/models with HTTP %ld%s: %s", router, st,
                 st == 401 ? " (give its API key: --api-key or TANDEM_API_KEY)" : "", why);
        strbuf_free(&b);
        return st == 429 || st == 503 ? 1 : -1;
    }
    json_t *o = json_loadb(b.p ? b.p : "", b.len, 0, NULL), *data = json_object_get(o, "data");
    strbuf_free(&b);
    int have[2] = {0, 0};
    strbuf names = {0};
    for (size_t i = 0; i < json_array_size(data); i++) {
        const char *id = json_string_value(json_object_get(json_array_get(data, i), "id"));
        if (!id) continue;
        have[0] |= !strcmp(id, model_a);
        have[1] |= !strcmp(id, model_b);
        strbuf_printf(&names, "%s%s", names.len ? ", " : "", id);
    }
    json_decref(o);
    if (!have[0] || !have[1]) {
        snprintf(err, errlen, "the router at %s serves no model '%s' (it serves: %s)", router, !have[0] ? model_a : model_b,
                 names.p ? names.p : "none");
        strbuf_free(&names);
        return 1;   /* its nodes may still be starting */
    }
    strbuf_free(&names);
    for (int w = 0; w < 2; w++) {
        const char *model = w ? model_b : model_a;
        json_t *req = json_pack("{s:s, s:[{s:s, s:s}], s:i, s:f}", "model", model, "messages", "role", "user", "content",
                                "Reply with OK.", "max_tokens", 1, "temperature", 0.0);
        if (req && !w && schema_text)
            json_object_set_new(req, "response_format",
                                json_pack("{s:s, s:{s:s, s:b, s:o}}", "type", "json_schema", "json_schema", "name",
                                          "rubric_analysis", "strict", 1, "schema", json_loads(schema_text, 0, NULL)));
        char *body = req ? json_dumps(req, JSON_COMPACT) : NULL;
        json_decref(req);
        if (!body) { snprintf(err, errlen, "out of memory"); return -1; }
        strbuf r = {0};
        st = gc_http(router, "/v1/chat/completions", api_key, body, timeout_s, &r, why, sizeof why);
        free(body);
        if (st == 200) { strbuf_free(&r); continue; }
        if (st > 0) gc_error_text(&r, why, sizeof why);
        strbuf_free(&r);
        snprintf(err, errlen, "the %s model '%s' cannot serve %s: %s%ld: %s", w ? "feedback" : "analysis", model,
                 w ? "a chat request" : "a chat request with the rubric's schema", st > 0 ? "HTTP " : "", st, why);
        return st < 0 || st == 429 || st == 503 ? 1 : -1;
    }
    return 0;
}

int grade_preflight(const char *router, const char *api_key, const char *model_a, const char *model_b,
                    const char *schema_text, int timeout_s, int tries, double wait_s, char *err, size_t errlen) {
    for (int t = 1;; t++) {
        int rc = gc_preflight_once(router, api_key, model_a, model_b, schema_text, timeout_s, err, errlen);
        if (rc <= 0 || t >= tries) return rc ? -1 : 0;
        struct timespec ts = { (time_t)wait_s, (long)((wait_s - (time_t)wait_s) * 1e9) };
        nanosleep(&ts, NULL);
    }
}

/* ==== Text ==== */

int grade_is_text(const char *p, size_t n) {
    size_t ctl = 0;
    for (size_t i = 0; i < n; i++) {
        unsigned char c = (unsigned char)p[i];
        if (!c) return 0;
        ctl += (c < 0x20 && c != '\t' && c != '\n' && c != '\r' && c != '\f') || c == 0x7f;
    }
    return ctl * 64 <= n;
}

int grade_is_blank(const char *p, size_t n) {
    for (size_t i = 0; i < n; i++)
        if (!strchr(" \t\r\n\f\v", p[i])) return 0;
    return 1;
}

/* ==== Problems' locations ==== */

static json_t *gc_find_file(json_t *files, const char *name) {
    while (name[0] == '.' && name[1] == '/') name += 2;
    json_t *only = NULL;
    int n_text = 0;
    for (size_t i = 0; i < json_array_size(files); i++) {
        json_t *f = json_array_get(files, i);
        const char *p = json_string_value(json_object_get(f, "path"));
        if (!p || !json_is_integer(json_object_get(f, "lines"))) continue;   /* skipped files have no lines */
        n_text++;
        only = f;
        if (!strcmp(p, name)) return f;
        const char *slash = strrchr(p, '/');   /* "src/x.py" named as "x.py" when no other file has that name */
        if (slash && !strcmp(slash + 1, name)) return f;
    }
    return n_text == 1 && !strchr(name, '/') && !strcmp(name, json_string_value(json_object_get(only, "path"))) ? only : NULL;
}

json_t *grade_check_problems(json_t *analysis, json_t *files, int *n_bad) {
    json_t *ps = json_object_get(analysis, "problems"), *out = json_array();
    int bad = 0;
    for (size_t i = 0; i < json_array_size(ps); i++) {
        json_t *p = json_array_get(ps, i);
        const char *file = json_string_value(json_object_get(p, "file"));
        json_int_t line = json_integer_value(json_object_get(p, "line"));
        json_t *f = file ? gc_find_file(files, file) : NULL;
        json_int_t lines = json_integer_value(json_object_get(f, "lines"));
        char why[400] = "";
        if (!f) snprintf(why, sizeof why, "the submission has no file '%.200s'", file ? file : "");
        else if (line < 1 || line > lines)
            snprintf(why, sizeof why, "line %lld is not in %.200s (%lld lines)", (long long)line, file, (long long)lines);
        json_t *c = json_pack("{s:s, s:I, s:b}", "file", file ? file : "", "line", line, "located", !why[0]);
        if (why[0]) { json_object_set_new(c, "error", json_string(why)); bad++; }
        json_array_append_new(out, c);
    }
    *n_bad = bad;
    return out;
}

/* ==== Finished halves ==== */

void grade_prev_halves(json_t *prev, int regrade_invalid, int *have_a, int *have_b) {
    json_t *valid = json_object_get(prev, "analysis_valid");
    *have_a = json_is_boolean(valid) && (json_is_true(valid) || !regrade_invalid);
    *have_b = json_is_string(json_object_get(prev, "feedback"));
}

static void gc_copy(json_t *rec, json_t *prev, const char *key) {
    json_t *v = json_object_get(prev, key);
    if (v) json_object_set(rec, key, v);
}

void grade_reuse_half(json_t *rec, json_t *prev, int which) {
    static const char *const a_keys[] = {"analysis_valid", "analysis", "analysis_error", "scores", "total", "model_total",
                                         "problems_unlocated", "problem_checks", NULL};
    if (which == 0)
        for (int i = 0; a_keys[i]; i++) gc_copy(rec, prev, a_keys[i]);
    else
        gc_copy(rec, prev, "feedback");
    const char *half = which ? "feedback" : "analysis";
    json_t *t = json_object_get(json_object_get(prev, "timings"), half), *n = json_object_get(json_object_get(prev, "nodes"), half);
    json_t *tc = json_is_object(t) ? json_deep_copy(t) : json_object();
    json_object_set_new(tc, "reused", json_true());
    json_t *timings = json_object_get(rec, "timings"), *nodes = json_object_get(rec, "nodes");
    if (json_is_object(timings)) json_object_set_new(timings, half, tc);
    else json_decref(tc);
    if (json_is_object(nodes) && json_is_object(n)) json_object_set(nodes, half, n);
}

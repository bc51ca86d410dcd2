/* grade_call.c - one streamed chat request of `tandem grade`: the body
 * POSTed with curl, the server-sent events read (text, usage, timing of the
 * first and last chunk, the router's plan headers), a 429/503 or an
 * unreachable router retried with exponential back-off (Retry-After obeyed).
 */
#include "grade/grade_internal.h"

#include <curl/curl.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <strings.h>

/* ==== One streamed chat request ==== */

/* Bounds on what the server may send: an SSE event (one chunk of a few
 * tokens is ~300 bytes), the answer text, an error body. */
#define GRADE_MAX_EVENT (1 << 20)
#define GRADE_MAX_TEXT (8 << 20)
#define GRADE_MAX_ERRBODY (64 << 10)

static void grade_hdr_value(const char *line, size_t n, const char *name, char *out, size_t outlen) {
    size_t nl = strlen(name);
    if (n <= nl || strncasecmp(line, name, nl) || line[nl] != ':') return;
    const char *v = line + nl + 1;
    size_t vn = n - nl - 1;
    while (vn && (*v == ' ' || *v == '\t')) { v++; vn--; }
    while (vn && (v[vn - 1] == '\r' || v[vn - 1] == '\n' || v[vn - 1] == ' ')) vn--;
    if (vn >= outlen) vn = outlen - 1;
    memcpy(out, v, vn);
    out[vn] = 0;
}

static size_t grade_on_header(char *p, size_t sz, size_t nm, void *ud) {
    grade_call *c = ud;
    size_t n = sz * nm;
    char ra[32] = "";
    grade_hdr_value(p, n, "X-Tandem-Decode-Node", c->decode_node, sizeof c->decode_node);
    grade_hdr_value(p, n, "X-Tandem-Prefill-Plan", c->plan, sizeof c->plan);
    grade_hdr_value(p, n, "X-Tandem-Prefill-Node", c->prefill_node, sizeof c->prefill_node);
    grade_hdr_value(p, n, "Retry-After", ra, sizeof ra);
    if (ra[0]) c->retry_after_s = atof(ra);
    return n;
}

/* One SSE event's data. */
static void grade_on_event(grade_call *c, const char *data) {
    if (!strcmp(data, "[DONE]")) { c->done = 1; return; }
    json_t *o = json_loads(data, 0, NULL);
    if (!o) { snprintf(c->error, sizeof c->error, "malformed stream event"); c->failed = 1; return; }
    json_t *e = json_object_get(o, "error");
    if (e) {
        const char *m = json_string_value(json_object_get(e, "message"));
        snprintf(c->error, sizeof c->error, "stream error: %s", m ? m : "unknown");
        c->failed = 1;
    }
    json_t *ch = json_array_get(json_object_get(o, "choices"), 0);
    const char *t = json_string_value(json_object_get(json_object_get(ch, "delta"), "content"));
    if (t && *t) {
        double now = grade_now_ms();
        if (!c->chunks) c->t_first = now;
        c->t_last = now;
        c->chunks++;
        if (c->text.len + strlen(t) > GRADE_MAX_TEXT) { snprintf(c->error, sizeof c->error, "answer too long"); c->failed = 1; }
        else strbuf_put(&c->text, t, strlen(t));
    }
    const char *fr = json_string_value(json_object_get(ch, "finish_reason"));
    if (fr) snprintf(c->finish, sizeof c->finish, "%s", fr);
    json_t *u = json_object_get(o, "usage");
    if (json_is_object(u)) {
        c->prompt_tokens = (int)json_integer_value(json_object_get(u, "prompt_tokens"));
        c->completion_tokens = (int)json_integer_value(json_object_get(u, "completion_tokens"));
        json_int_t ct = json_integer_value(json_object_get(json_object_get(u, "prompt_tokens_details"), "cached_tokens"));
        /* another server's figure is not trusted past the prompt it counts */
        c->cached_tokens = ct > 0 && ct <= c->prompt_tokens ? (int)ct : 0;
    }
    json_decref(o);
}

static void grade_sse_drain(grade_call *c) {
    char *ev;
    while (!c->failed && c->buf.p && (ev = strstr(c->buf.p, "\n\n"))) {
        *ev = 0;
        for (char *line = c->buf.p; line && *line;) {
            char *nl = strchr(line, '\n');
            if (nl) *nl = 0;
            if (!strncmp(line, "data: ", 6)) grade_on_event(c, line + 6);
            line = nl ? nl + 1 : NULL;
        }
        size_t used = (size_t)(ev + 2 - c->buf.p);
        memmove(c->buf.p, ev + 2, c->buf.len - used + 1);
        c->buf.len -= used;
    }
}

/* The body: SSE events are parsed as they arrive (TTFT is the arrival of
 * the first text), an error reply is kept whole (bounded). */
static size_t grade_on_body(char *p, size_t sz, size_t nm, void *ud) {
    grade_call *c = ud;
    size_t n = sz * nm;
    if (c->status == 0) curl_easy_getinfo(c->h, CURLINFO_RESPONSE_CODE, &c->status);
    if (c->buf.len + n > (c->status == 200 ? GRADE_MAX_EVENT : GRADE_MAX_ERRBODY)) {
        snprintf(c->error, sizeof c->error, "the server sent an oversized %s", c->status == 200 ? "event" : "error body");
        c->failed = 1;
        return 0;
    }
    int oom = 0;
    if (c->status != 200) oom = strbuf_put(&c->buf, p, n);
    /* SSE lines may end in CRLF (other servers): events are parsed without CR */
    for (size_t i = 0, j; c->status == 200 && i < n && !oom; i = j) {
        for (j = i; j < n && p[j] != '\r'; j++) {}
        oom = strbuf_put(&c->buf, p + i, j - i);
        if (j < n) j++;
    }
    if (oom || c->text.oom) { snprintf(c->error, sizeof c->error, "out of memory"); c->failed = 1; return 0; }
    if (c->status == 200) grade_sse_drain(c);
    return c->failed ? 0 : n;
}

/* One attempt; fills c. */
static void grade_attempt(grade_call *c, CURL *h, const char *url, struct curl_slist *hl) {
    c->status = 0;
    strbuf_reset(&c->text);
    strbuf_reset(&c->buf);
    c->prompt_tokens = c->completion_tokens = c->cached_tokens = c->chunks = c->done = c->failed = 0;
    c->t_first = c->t_last = 0;
    c->retry_after_s = 0;
    c->finish[0] = c->decode_node[0] = c->plan[0] = c->prefill_node[0] = c->error[0] = 0;
    c->h = h;
    curl_easy_reset(h);
    curl_easy_setopt(h, CURLOPT_URL, url);
    curl_easy_setopt(h, CURLOPT_HTTPHEADER, hl);
    curl_easy_setopt(h, CURLOPT_POSTFIELDS, c->body);
    curl_easy_setopt(h, CURLOPT_WRITEFUNCTION, grade_on_body);
    curl_easy_setopt(h, CURLOPT_WRITEDATA, c);
    curl_easy_setopt(h, CURLOPT_HEADERFUNCTION, grade_on_header);
    curl_easy_setopt(h, CURLOPT_HEADERDATA, c);
    curl_easy_setopt(h, CURLOPT_NOSIGNAL, 1L);
    curl_easy_setopt(h, CURLOPT_TIMEOUT, (long)c->o->timeout_s);
    curl_easy_setopt(h, CURLOPT_CONNECTTIMEOUT, 10L);
    c->t_send = grade_now_ms();
    CURLcode rc = curl_easy_perform(h);
    c->t_end = grade_now_ms();
    curl_easy_getinfo(h, CURLINFO_RESPONSE_CODE, &c->status);
    if (rc != CURLE_OK && !c->failed) {
        snprintf(c->error, sizeof c->error, "%s", curl_easy_strerror(rc));
        c->failed = rc == CURLE_COULDNT_CONNECT ? 2 : 1;   /* 2: the router is not there (retried) */
        return;
    }
    if (c->failed) return;
    if (c->status != 200) {
        json_t *o = c->buf.p ? json_loads(c->buf.p, 0, NULL) : NULL;
        const char *m = json_string_value(json_object_get(json_object_get(o, "error"), "message"));
        snprintf(c->error, sizeof c->error, "HTTP %ld: %.400s", c->status, m ? m : c->buf.p ? c->buf.p : "");
        json_decref(o);
        c->failed = 1;
        return;
    }
    if (c->buf.len) { strbuf_put(&c->buf, "\n\n", 2); grade_sse_drain(c); }
    if (!c->failed && !c->done) { snprintf(c->error, sizeof c->error, "the stream ended before [DONE]"); c->failed = 1; }
    if (!c->completion_tokens) c->completion_tokens = c->chunks;
}

static int grade_retryable(const grade_call *c) {
    return c->failed == 2 || c->status == 429 || c->status == 503;
}

/* Runs the request with retries; 0 when it completed. */
int grade_call_run(grade_call *c) {
    char url[2048], auth[600];
    snprintf(url, sizeof url, "%s/v1/chat/completions", c->o->router);
    CURL *h = curl_easy_init();
    struct curl_slist *hl = curl_slist_append(NULL, "Content-Type: application/json");
    if (c->o->api_key) { snprintf(auth, sizeof auth, "Authorization: Bearer %s", c->o->api_key); hl = curl_slist_append(hl, auth); }
    if (!h || !hl) { snprintf(c->error, sizeof c->error, "out of memory"); c->failed = 1; curl_easy_cleanup(h); curl_slist_free_all(hl); return -1; }
    double delay = c->o->backoff_s * 1e3;
    for (c->attempts = 1;; c->attempts++) {
        grade_attempt(c, h, url, hl);
        if (!c->failed || !grade_retryable(c) || c->attempts > c->o->retries) break;
        /* exponential back-off with jitter; a server's Retry-After wins (capped) */
        unsigned seed = (unsigned)c->t_end ^ (unsigned)(uintptr_t)c;
        double wait = c->retry_after_s > 0 ? fmin(c->retry_after_s, 60) * 1e3 : delay * (0.75 + 0.5 * (rand_r(&seed) / (double)RAND_MAX));
        grade_sleep_ms(wait);
        delay = fmin(delay * 2, 30e3);
    }
    curl_easy_cleanup(h);
    curl_slist_free_all(hl);
    if (c->failed && c->attempts > 1 && grade_retryable(c)) {
        size_t l = strlen(c->error);
        snprintf(c->error + l, sizeof c->error - l, " (after %d attempts)", c->attempts);
    }
    return c->failed ? -1 : 0;
}

void grade_call_free(grade_call *c) {
    free(c->body);
    strbuf_free(&c->text);
    strbuf_free(&c->buf);
}

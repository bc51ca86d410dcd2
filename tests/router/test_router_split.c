/* test_router_split.c - the router's `--split auto` decision on real
 * processes: a prefill node and a decode node of different speeds
 * (prefill: 2 threads, 512-token passes; decode: 1 thread prefilling one
 * position per pass (-b 1), which reads the weights once per position:
 * about 3x slower, on an idle machine as on a loaded one),
 * both reporting their
 * calibrated prefill rates before any request. A long prompt is split, a
 * short one stays local, each with its reason in the reply's headers and in
 * /metrics (only the decision series that can occur); the prompt is counted
 * by the decode node's tokenizer (the chat template applied: the count
 * equals the reply's usage); the plan's estimated prefill time is within
 * 20% of the time the decode node measured; a repeated prompt shows as
 * "cached" (prefix reuse), not as a fallback; a stream whose decode node
 * dies is logged with the tokens it sent. Also: config files with an
 * unknown key are refused, naming the key. */
#include "t.h"
#include "proc.h"

#include <curl/curl.h>
#include <math.h>
#include <pthread.h>

#include "net/prefill_rate.h"
#include "router/router.h"

#define RS_DIR "build/test_router_split.d"
/* Long prompts: ~700 tokens, well past min_split_tokens, ~0.3-0.8 s of
 * prefill on the fixture model. */
#define RS_LONG_WORDS 60
/* Long prompts sent per round: the estimates of all but the first are
 * compared with the measured times, summed. */
#define RS_LONG_N 8

/* ==== Config ==== */

static int rs_load(const char *json, char *err, size_t errlen) {
    FILE *f = fopen(RS_DIR "/c.json", "w");
    if (!f) return -2;
    fputs(json, f);
    fclose(f);
    router_config c;
    router_config_default(&c);
    int rc = router_config_load(&c, RS_DIR "/c.json", err, errlen);
    router_config_free(&c);
    return rc;
}

static void test_config(void) {
    char err[256] = "";
    CHECK(rs_load("{\"split\":\"auto\",\"min_split_tokenz\":64}", err, sizeof err) == -1 && strstr(err, "min_split_tokenz"),
          "misspelled top-level key refused by name: %s", err);
    CHECK(rs_load("{\"limits\":{\"max_tokenz\":9}}", err, sizeof err) == -1 && strstr(err, "max_tokenz") &&
          strstr(err, "limits"), "unknown limits key refused by name: %s", err);
    CHECK(rs_load("{\"nodes\":[{\"role\":\"decode\",\"model\":\"m\",\"addr\":\"h:1\",\"adr\":\"h:2\"}]}", err, sizeof err) == -1 &&
          strstr(err, "\"adr\"") && strstr(err, "nodes[0]"), "unknown node key refused by name: %s", err);
    CHECK(rs_load("{\"split\":\"auto\",\"min_split_tokens\":64,\"tokenize_timeout_ms\":300,\"limits\":{\"max_tokens\":9}}",
                  err, sizeof err) == 0, "known keys accepted: %s", err);
    /* the command line says it too, and exits before listening */
    rs_load("{\"listen\":\"127.0.0.1:0\",\"min_split_tokenz\":64}", err, sizeof err);
    char cmd[600];
    snprintf(cmd, sizeof cmd, "%s serve --role router --config " RS_DIR "/c.json 2>&1; echo rc=$?", bin());
    FILE *p = popen(cmd, "r");
    char out[2048] = "";
    size_t n = p ? fread(out, 1, sizeof out - 1, p) : 0;
    out[n] = 0;
    if (p) pclose(p);
    CHECK(strstr(out, "min_split_tokenz") && strstr(out, "rc=2"), "router refuses the config file: %s", out);
}

/* ==== The rate in a prefill node's HELLO ==== */

static void test_rate_desc(void) {
    char d[256];
    prefill_rate_format(d, sizeof d, "m.gguf (qwen3, 4 layers), KV F16", 1887.6);
    CHECK(!strcmp(d, "m.gguf (qwen3, 4 layers), KV F16; prefill 1888 t/s") && prefill_rate_parse(d) == 1888, "round trip: %s", d);
    prefill_rate_format(d, sizeof d, "m.gguf", 0);
    CHECK(!strcmp(d, "m.gguf") && prefill_rate_parse(d) == -1, "no rate, no tag: %s", d);
    static const char *const bad[] = {"m; prefill abc t/s", "m; prefill 5 t/sX", "m; prefill -5 t/s", "m; prefill 0 t/s",
                                      "m; prefill 1e12 t/s", "m; prefill nan t/s", "m; prefill inf t/s", "m; prefill ", ""};
    for (size_t i = 0; i < sizeof bad / sizeof bad[0]; i++)
        CHECK(prefill_rate_parse(bad[i]) == -1, "no rate in \"%s\"", bad[i]);
    CHECK(prefill_rate_parse("a; prefill 5 t/s; prefill 7 t/s") == 7, "the last clause counts");
    /* its context rides before the rate */
    char c[256];
    prefill_ctx_format(c, sizeof c, "m.gguf (qwen3, 4 layers), KV F16", 600);
    prefill_rate_format(d, sizeof d, c, 1887.6);
    CHECK(!strcmp(d, "m.gguf (qwen3, 4 layers), KV F16; ctx 600; prefill 1888 t/s") && prefill_ctx_parse(d) == 600 &&
          prefill_rate_parse(d) == 1888, "context and rate round trip: %s", d);
    CHECK(prefill_ctx_parse("m.gguf; layers 0:2; prefill 5 t/s") == 0, "no context clause: 0");
    static const char *const badc[] = {"m; ctx 0", "m; ctx -5", "m; ctx 99999999999", "m; ctx 12x", "m; ctx ", "m; ctx 0x10",
                                       "m; ctx 16777217"};
    for (size_t i = 0; i < sizeof badc / sizeof badc[0]; i++)
        CHECK(prefill_ctx_parse(badc[i]) == 0, "no context in \"%s\"", badc[i]);
    double avg = 0;
    prefill_rate_update(&avg, 8, 10);
    CHECK(avg == 0, "a request of 8 positions is not counted");
    prefill_rate_update(&avg, 100, 100);
    prefill_rate_update(&avg, 200, 100);
    CHECK(fabs(avg - (0.7 * 1000 + 0.3 * 2000)) < 1e-9, "moving average: %f", avg);
}

/* ==== Processes ==== */

/* Its log truncated first. */
static int rs_start(pid_t *pid, char *const argv[], const char *name) {
    return start_named(pid, argv, RS_DIR, name, 1, 60000);
}

/* A reply: status, body and the X-Tandem-* headers (as "name: value\r\n" lines). */
typedef struct { long status; membuf body, hdr; } rs_reply;

static size_t rs_hdr(char *p, size_t sz, size_t nm, void *ud) {
    size_t n = sz * nm;
    if (n > 9 && !strncasecmp(p, "X-Tandem-", 9)) membuf_add(p, 1, n, ud);
    return n;
}

static void rs_post(int port, const char *path, const char *body, rs_reply *r) {
    char url[128];
    snprintf(url, sizeof url, "http://127.0.0.1:%d%s", port, path);
    memset(r, 0, sizeof *r);
    r->status = -1;
    CURL *h = curl_easy_init();
    struct curl_slist *hl = curl_slist_append(NULL, "Content-Type: application/json");
    curl_easy_setopt(h, CURLOPT_URL, url);
    if (body) curl_easy_setopt(h, CURLOPT_POSTFIELDS, body);
    curl_easy_setopt(h, CURLOPT_HTTPHEADER, hl);
    curl_easy_setopt(h, CURLOPT_WRITEFUNCTION, membuf_add);
    curl_easy_setopt(h, CURLOPT_WRITEDATA, &r->body);
    curl_easy_setopt(h, CURLOPT_HEADERFUNCTION, rs_hdr);
    curl_easy_setopt(h, CURLOPT_HEADERDATA, &r->hdr);
    curl_easy_setopt(h, CURLOPT_TIMEOUT, 120L);
    curl_easy_setopt(h, CURLOPT_NOSIGNAL, 1L);
    curl_easy_setopt(h, CURLOPT_PROXY, "");
    if (curl_easy_perform(h) == CURLE_OK) curl_easy_getinfo(h, CURLINFO_RESPONSE_CODE, &r->status);
    curl_easy_cleanup(h);
    curl_slist_free_all(hl);
}

static void rs_reply_free(rs_reply *r) { free(r->body.s); free(r->hdr.s); }

/* A header's value ("" when absent), into out. */
static const char *rs_header(const rs_reply *r, const char *name, char *out, size_t outlen) {
    out[0] = 0;
    for (const char *p = r->hdr.s; p && *p;) {
        const char *e = strstr(p, "\r\n");
        size_t nl = strlen(name);
        if (!strncasecmp(p, name, nl) && p[nl] == ':') {
            const char *v = p + nl + 1;
            while (*v == ' ') v++;
            size_t vl = (size_t)((e ? e : v + strlen(v)) - v);
            snprintf(out, outlen, "%.*s", (int)(vl < outlen ? vl : outlen - 1), v);
            return out;
        }
        p = e ? e + 2 : NULL;
    }
    return out;
}

static double rs_header_num(const rs_reply *r, const char *name) {
    char v[64];
    return *rs_header(r, name, v, sizeof v) ? atof(v) : -1;
}

static long long rs_usage_prompt(const rs_reply *r) {
    json_t *o = r->body.s ? json_loads(r->body.s, 0, NULL) : NULL;
    long long n = jint(o, "usage", "prompt_tokens");
    json_decref(o);
    return n;
}

/* A chat request of one system and one user message (the template's turns
 * around them are what a byte estimate misses). */
static char *rs_chat(const char *user) {
    json_t *o = json_pack("{s:s, s:i, s:f, s:[{s:s, s:s}, {s:s, s:s}]}", "model", "q", "max_tokens", 1, "temperature", 0.0,
                          "messages", "role", "system", "content", "You answer in one word.", "role", "user", "content", user);
    char *s = json_dumps(o, JSON_COMPACT);
    json_decref(o);
    return s;
}

/* A long user message; tag makes it differ from the first token on, so no
 * node holds a prefix of it. */
static char *rs_long_text(int tag, int words) {
    size_t cap = (size_t)words * 64 + 64, n = 0;
    char *s = malloc(cap);
    n += (size_t)snprintf(s + n, cap - n, "Report %d. Summarise the following list.", tag);
    for (int i = 0; i < words; i++)
        n += (size_t)snprintf(s + n, cap - n, " Item %d-%d is a fine word for the story", tag, i);
    return s;
}

/* Both nodes' calibrated rates reach the router before any request. */
static int rs_wait_rates(int rport, int pport, int dport) {
    char ps[160], ds[160];
    snprintf(ps, sizeof ps, "tandem_node_prefill_tokens_per_second{node=\"127.0.0.1:%d\",role=\"prefill\",model=\"q\"} ", pport);
    snprintf(ds, sizeof ds, "tandem_node_prefill_tokens_per_second{node=\"127.0.0.1:%d\",role=\"decode\",model=\"q\"} ", dport);
    double p = 0, d = 0;
    for (int i = 0; i < 100 && (p <= 0 || d <= 0); i++) {
        p = metric_value(rport, ps);
        d = metric_value(rport, ds);
        if (p <= 0 || d <= 0) sleep_ms(100);
    }
    printf("test_router_split: calibrated rates: prefill node %.0f t/s, decode node %.0f t/s\n", p, d);
    CHECK(p > 0 && d > 0, "both nodes report a rate before any request (prefill %.0f, decode %.0f)", p, d);
    return p > 0 && d > 0;
}

static void test_short(int rport) {
    char *body = rs_chat("Hi there");
    rs_reply r;
    rs_post(rport, "/v1/chat/completions", body, &r);
    char plan[32], reason[32], cnt[32];
    rs_header(&r, "X-Tandem-Prefill-Plan", plan, sizeof plan);
    rs_header(&r, "X-Tandem-Prefill-Reason", reason, sizeof reason);
    rs_header(&r, "X-Tandem-Token-Count", cnt, sizeof cnt);
    long long used = rs_usage_prompt(&r);
    CHECK(r.status == 200 && !strcmp(plan, "local") && !strcmp(reason, "short_prompt"),
          "short prompt stays local for being short: %ld plan %s reason %s", r.status, plan, reason);
    CHECK(!strcmp(cnt, "exact") && used > 0 && rs_header_num(&r, "X-Tandem-Prompt-Tokens") == used,
          "short prompt counted by the tokenizer: %s %.0f vs usage %lld", cnt, rs_header_num(&r, "X-Tandem-Prompt-Tokens"), used);
    rs_reply_free(&r);
    free(body);
}

/* n long prompts (tags tag0..) through the router at rport; each must get
 * plan want_plan for reason want_reason, counted by the tokenizer. Returns
 * the sums of the estimated and measured prefill times from the skip-th on
 * (the first's estimate rests on the calibration alone); the last request's
 * body into *last when asked. */
static void rs_round(int rport, int tag0, int n, int words, int skip, const char *want_plan, const char *want_reason,
                     double *est_sum, double *meas_sum, char **last) {
    *est_sum = *meas_sum = 0;
    for (int i = 0; i < n; i++) {
        char *text = rs_long_text(tag0 + i, words);
        char *body = rs_chat(text);
        rs_reply r;
        rs_post(rport, "/v1/chat/completions", body, &r);
        char plan[32], reason[32], out[32], cnt[32];
        rs_header(&r, "X-Tandem-Prefill-Plan", plan, sizeof plan);
        rs_header(&r, "X-Tandem-Prefill-Reason", reason, sizeof reason);
        rs_header(&r, "X-Tandem-Prefill-Outcome", out, sizeof out);
        rs_header(&r, "X-Tandem-Token-Count", cnt, sizeof cnt);
        long long used = rs_usage_prompt(&r);
        double est = rs_header_num(&r, "X-Tandem-Prefill-Estimate-Ms"), meas = rs_header_num(&r, "X-Tandem-Prefill-Ms");
        double remote = rs_header_num(&r, "X-Tandem-Remote-Prefill-Ms");
        printf("test_router_split: prompt %d: %lld tokens, plan %s (%s), prefilled %s, estimate %.1f ms, "
               "measured %.1f ms (prefill node compute %.1f ms)\n", tag0 + i, used, plan, reason, out, est, meas, remote);
        CHECK(r.status == 200 && !strcmp(plan, want_plan) && !strcmp(reason, want_reason) && !strcmp(out, want_plan),
              "long prompt %d: %ld plan %s reason %s outcome %s (want %s, %s)", tag0 + i, r.status, plan, reason, out,
              want_plan, want_reason);
        CHECK(!strcmp(cnt, "exact") && used > words * 5 && rs_header_num(&r, "X-Tandem-Prompt-Tokens") == used,
              "long prompt %d counted by the tokenizer: %s %.0f vs usage %lld", tag0 + i, cnt,
              rs_header_num(&r, "X-Tandem-Prompt-Tokens"), used);
        if (i >= skip && est > 0 && meas > 0) { *est_sum += est; *meas_sum += meas; }
        rs_reply_free(&r);
        if (last && i == n - 1) *last = body; else free(body);
        free(text);
    }
}

/* rs_round's estimates against the measured times, summed (one prompt's
 * time on a shared machine varies by +-25% with the load, more than the
 * estimate's error). When the load changed under a round (the nodes'
 * rates follow it with a moving average, a few requests behind), another
 * round, with the rates learned so far, decides; at most RS_ROUNDS. Returns
 * the prompts sent. */
#define RS_ROUNDS 3
static int rs_estimates(int rport, int tag0, int n, int words, const char *plan, const char *reason, char **last) {
    double est = 0, meas = 0, err = 1;
    int sent = 0;
    for (int round = 0; round < RS_ROUNDS && err > 0.20; round++) {
        if (last && *last) { free(*last); *last = NULL; }
        /* the first round's first two estimates rest on the start-up
         * calibration, the second on one request more: not judged */
        int k = round ? n - 2 : n;
        rs_round(rport, tag0 + 50 * round, k, words, round ? 0 : 2, plan, reason, &est, &meas, last);
        sent += k;
        err = meas > 0 ? fabs(est / meas - 1) : 1;
        printf("test_router_split: %s round %d: estimates vs measured over %d prompts: %.1f ms vs %.1f ms (%.0f%% off)\n",
               plan, round + 1, n - 2, est, meas, err * 100);
    }
    CHECK(err <= 0.20, "%s estimates within 20%% of the measured prefill: %.1f vs %.1f ms", plan, est, meas);
    return sent;
}

/* A stream whose decode node dies after some tokens went out: the
 * router's log line counts the tokens the client was sent. */
typedef struct { int events; pid_t victim; int killed; } rs_stream;

static size_t rs_stream_sink(char *p, size_t sz, size_t nm, void *ud) {
    rs_stream *st = ud;
    size_t n = sz * nm;
    for (size_t i = 0; i + 7 <= n; i++) st->events += !memcmp(p + i, "data: {", 7);
    if (!st->killed && st->events >= 12) { kill(st->victim, SIGKILL); st->killed = 1; }
    return n;
}

static void test_stream_failure(int rport, pid_t dn) {
    char url[128];
    snprintf(url, sizeof url, "http://127.0.0.1:%d/v1/completions", rport);
    const char *body = "{\"model\":\"q\",\"prompt\":\"Once upon a time\",\"max_tokens\":2000,\"stream\":true,"
                       "\"temperature\":1.0,\"seed\":7}";
    rs_stream st = {.victim = dn};
    CURL *h = curl_easy_init();
    struct curl_slist *hl = curl_slist_append(NULL, "Content-Type: application/json");
    curl_easy_setopt(h, CURLOPT_URL, url);
    curl_easy_setopt(h, CURLOPT_POSTFIELDS, body);
    curl_easy_setopt(h, CURLOPT_HTTPHEADER, hl);
    curl_easy_setopt(h, CURLOPT_WRITEFUNCTION, rs_stream_sink);
    curl_easy_setopt(h, CURLOPT_WRITEDATA, &st);
    curl_easy_setopt(h, CURLOPT_TIMEOUT, 60L);
    curl_easy_setopt(h, CURLOPT_NOSIGNAL, 1L);
    curl_easy_setopt(h, CURLOPT_PROXY, "");
    curl_easy_perform(h);
    curl_easy_cleanup(h);
    curl_slist_free_all(hl);
    CHECK(st.killed, "the decode node was killed mid-stream (%d events)", st.events);
    /* the router logs the request when the stream ends */
    int completion = -1;
    for (int i = 0; i < 50 && completion < 0; i++) {
        FILE *f = fopen(RS_DIR "/rt.log", "r");
        char line[4096];
        while (f && fgets(line, sizeof line, f)) {
            char *c = strstr(line, " stream error ") ? strstr(line, " completion=") : NULL;
            if (c) completion = atoi(c + 12);
        }
        if (f) fclose(f);
        if (completion < 0) sleep_ms(100);
    }
    CHECK(completion >= 12, "a failed stream logs the tokens it sent: completion=%d (client saw %d events)", completion,
          st.events);
}

static void test_processes(void) {
    char b[512], model[600], secret[] = RS_DIR "/secret";
    snprintf(b, sizeof b, "%s", bin());
    snprintf(model, sizeof model, "%s/qwen3-mini-F16.gguf", t_models());
    if (!t_need(model)) return;
    FILE *f = fopen(secret, "w");
    fputs("router-split-test-secret-5f0c2a9e7b1d4c3a8e6f9b2d1c0a7e5f\n", f);
    fclose(f);
    pid_t pf = 0, dn = 0, rt = 0;
    char *pfa[] = {b, "serve", "--role", "prefill", "-m", model, "-t", "2", "--secret-file", secret,
                   "--port-file", RS_DIR "/pf.port", NULL};
    int pport = rs_start(&pf, pfa, "pf");
    char pp[64], dp[64], rp[64];
    snprintf(pp, sizeof pp, "127.0.0.1:%d", pport);
    char *dna[] = {b, "serve", "--role", "decode", "-m", model, "-t", "1", "-b", "1", "--secret-file", secret, "--listen", "127.0.0.1:0",
                   "--prefill-node", pp, "--port-file", RS_DIR "/dn.port", NULL};
    int dport = pport > 0 ? rs_start(&dn, dna, "dn") : -1;
    snprintf(dp, sizeof dp, "q=127.0.0.1:%d", dport);
    snprintf(rp, sizeof rp, "q=127.0.0.1:%d", pport);
    char *rta[] = {b, "serve", "--role", "router", "--listen", "127.0.0.1:0", "--secret-file", secret, "--decode", dp,
                   "--prefill", rp, "--split", "auto", "--health-interval-ms", "200", "--port-file", RS_DIR "/rt.port", NULL};
    int rport = dport > 0 ? rs_start(&rt, rta, "rt") : -1;
    pid_t rt2 = 0;
    char *rta2[] = {b, "serve", "--role", "router", "--listen", "127.0.0.1:0", "--secret-file", secret, "--decode", dp,
                    "--prefill", rp, "--split", "never", "--health-interval-ms", "200", "--port-file", RS_DIR "/rt2.port", NULL};
    int rport2 = rport > 0 ? rs_start(&rt2, rta2, "rt2") : -1;
    if (rport > 0 && rs_wait_rates(rport, pport, dport)) {
        test_short(rport);
        char *last = NULL;
        int n_split = rs_estimates(rport, 0, RS_LONG_N, RS_LONG_WORDS, "split", "cost", &last);
        /* the last long prompt again: the decode node holds it, and the
         * router knows (its /v1/stats "prefix", router_cache.c): nothing is
         * left to split, so the plan is local for its cost */
        rs_reply r;
        rs_post(rport, "/v1/chat/completions", last, &r);
        char plan[32], out[32];
        rs_header(&r, "X-Tandem-Prefill-Plan", plan, sizeof plan);
        rs_header(&r, "X-Tandem-Prefill-Outcome", out, sizeof out);
        CHECK(r.status == 200 && !strcmp(plan, "local") && !strcmp(out, "cached"),
              "a repeated prompt is prefix reuse, planned local, not a fallback: plan %s outcome %s", plan, out);
        rs_reply_free(&r);
        free(last);
        CHECK(metric_value(rport, "tandem_router_prefill_total{mode=\"cached\"} ") == 1 &&
              metric_value(rport, "tandem_router_prefill_total{mode=\"split\"} ") == n_split &&
              metric_value(rport, "tandem_router_prefill_fallbacks_total ") == 0, "metrics: %d split, 1 cached, no fallback", n_split);
        CHECK(metric_value(rport, "tandem_router_decisions_total{decision=\"split\",reason=\"cost\"} ") == n_split &&
              metric_value(rport, "tandem_router_decisions_total{decision=\"local\",reason=\"cost\"} ") == 1 &&
              metric_value(rport, "tandem_router_decisions_total{decision=\"local\",reason=\"short_prompt\"} ") == 1,
              "decision metrics count %d cost splits, 1 local for its cost (held) and 1 short prompt", n_split);
        char *m = NULL;
        http(rport, "GET", "/metrics", NULL, &m);
        /* series exist once observed: exactly the three pairs these requests took */
        CHECK(m && count_str(m, "tandem_router_decisions_total{") == 3 &&
              !strstr(m, "decision=\"split\",reason=\"short_prompt\"") &&
              !strstr(m, "decision=\"split\",reason=\"no_prefill_node\""),
              "only the decision series that occurred are exported");
        free(m);
        /* shorter prompts: the slow decode node takes ~1 s for 400 tokens */
        if (rport2 > 0) rs_estimates(rport2, 1000, 5, RS_LONG_WORDS / 2, "local", "policy", NULL);
        test_stream_failure(rport, dn);   /* last: kills the decode node */
    }
    /* pid 0 would signal our own process group: stop only what started */
    if (rt2 > 0) stop_proc(rt2, 5000);
    if (rt > 0) stop_proc(rt, 5000);
    if (dn > 0) stop_proc(dn, 5000);
    if (pf > 0) stop_proc(pf, 5000);
}

int main(void) {
    signal(SIGPIPE, SIG_IGN);
    mkdir("build", 0755);
    mkdir(RS_DIR, 0755);
    curl_global_init(CURL_GLOBAL_DEFAULT);
    test_config();
    test_rate_desc();
    test_processes();
    curl_global_cleanup();
    return t_done("test_router_split");
}

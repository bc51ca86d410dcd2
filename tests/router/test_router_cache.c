/* test_router_cache.c - routing by cache and capacity (issue 47) and the
 * router's health checks (issue 40), on real processes: 2 prefill nodes,
 * 2 decode nodes and a router on the fixture model.
 *
 *  - 8 prompts of one 512-token prefix and 8 different 24-token suffixes,
 *    sent one after another (--split always): the positions computed,
 *    summed over the four nodes, are at most prefix + 8 x suffix (+ the
 *    decode nodes' last positions) + one extra prefix; each reply equals
 *    the same prompt prefilled locally on a decode node (greedy);
 *  - requests sent while a split of their prefix runs its handoff (both
 *    prefill nodes stopped): a busy prefill-node session and a decode node
 *    the split has not reached yet are not counted as holding the prefix;
 *  - 16 different prompts sent at once, then the same 16 again: the second
 *    burst reuses whole prompts (outcome "cached") for at least 14;
 *  - a 1-slot decode node beside a 4-slot one gets at most 30% of a burst
 *    of 16 requests (--client-share 100: the burst comes from one client,
 *    whose default share of a node would send the rest elsewhere; short
 *    prompts and 48 tokens each, so that a slot's worth is decoding, which
 *    a node batches: per request a 4-slot node is not 4x slower);
 *  - the small defects: failed health checks counted in
 *    tandem_node_failures_total; "marked down" logged for a prefill node
 *    whose split fell back; the fallback in the stream (final SSE comment)
 *    and the next request not naming the dead node; a decode node that dies
 *    mid-stream marked down at once; --help says that q8_0 on the wire
 *    changes greedy output; the probe timeout grows with a node's round
 *    trip, and a node stopped for 2 s (a loaded host) is not marked down.
 */
#include "t.h"
#include "proc.h"

#include <math.h>
#include <pthread.h>

#include "router/router.h"

#define TC_DIR "build/test_router_cache.d"
#define TC_PREFIX 512      /* tokens: 8 blocks of 64 */
#define TC_SUFFIX 24
#define TC_BURST 16
#define TC_BURST_LEN 200   /* tokens of each burst prompt: 3 full blocks */
#define TC_PF_CTX_S "600"  /* the prefill nodes' context: the suffix prompts (536) fit */
#define TC_LONG 700        /* a prompt longer than that (the decode nodes take 1024) */

static char tc_secret_path[] = TC_DIR "/secret";
static const char tc_secret[] = "7f3c9a1e5b2d8f4a6c0e9b3d7a1f5c8e2b6d0a4f8c3e7b1d5a9f2c6e0b4d8a3f";
static node_auth_key tc_key;

/* ==== Processes and requests ==== */

static int tc_start(pid_t *pid, char *const argv[], const char *name) {
    return start_named(pid, argv, TC_DIR, name, 1, 60000);
}

/* An ordinary token id for position i of prompt tag (Qwen3's BPE range). */
static int tc_tok(int tag, int i) { return 1000 + (int)(((unsigned)tag * 7919u + (unsigned)i * 104729u) % 60000u); }

/* A completion request on token ids: prefix (tag ptag) then suffix (tag). */
static char *tc_body_of(int ptag, int prefix_len, int tag, int suffix_len, int max_tokens, int stream) {
    json_t *ids = json_array();
    for (int i = 0; i < prefix_len; i++) json_array_append_new(ids, json_integer(tc_tok(ptag, i)));
    for (int i = 0; i < suffix_len; i++) json_array_append_new(ids, json_integer(tc_tok(tag, i)));
    json_t *o = json_pack("{s:s, s:o, s:i, s:f, s:b}", "model", "q", "prompt", ids, "max_tokens", max_tokens,
                          "temperature", 0.0, "stream", stream);
    char *s = json_dumps(o, JSON_COMPACT);
    json_decref(o);
    return s;
}

/* The same with the prefix of tag 0. */
static char *tc_body(int prefix_len, int tag, int suffix_len, int max_tokens, int stream) {
    return tc_body_of(0, prefix_len, tag, suffix_len, max_tokens, stream);
}

/* A reply's body (after the headers) as JSON, or NULL. */
static json_t *tc_json(const char *raw) {
    const char *b = raw ? strstr(raw, "\r\n\r\n") : NULL;
    return b ? json_loads(b + 4, 0, NULL) : NULL;
}

static const char *tc_text(json_t *o) {
    return jstr(json_array_get(json_object_get(o, "choices"), 0), "text", NULL);
}

/* Positions a decode node computed: prompts less reused and received ones. */
static long long tc_decode_computed(int port) {
    char *b = NULL;
    const node_auth_key *k = sign_key;
    sign_key = &tc_key;
    int st = http(port, "GET", "/v1/stats", NULL, &b);
    sign_key = k;
    json_t *o = st == 200 && b ? json_loads(b, 0, NULL) : NULL;
    long long n = o ? jint(o, "prompt_tokens", NULL) - jint(o, "reused_positions", NULL) - jint(o, "positions_received", NULL) : -1;
    json_decref(o);
    free(b);
    return n;
}

/* Positions a prefill node computed (its /metrics, summed over series). */
static long long tc_prefill_computed(int mport) {
    char *m = NULL;
    http(mport, "GET", "/metrics", NULL, &m);
    long long n = m ? 0 : -1;
    for (char *p = m; p && (p = strstr(p, "tandem_prefill_tokens_computed_total")); p++)
        if (p == m || p[-1] == '\n') {
            char *sp = strchr(p, ' ');
            if (sp) n += (long long)atof(sp + 1);
        }
    free(m);
    return n;
}

/* The text a decode node generates for the same request prefilled locally. */
static char *tc_local_text_of(int dport, int ptag, int prefix_len, int tag, int suffix_len, int max_tokens) {
    int32_t ids[TC_PREFIX + TC_BURST_LEN];
    int n = 0;
    for (int i = 0; i < prefix_len; i++) ids[n++] = tc_tok(ptag, i);
    for (int i = 0; i < suffix_len; i++) ids[n++] = tc_tok(tag, i);
    json_t *r = gen_req(ids, n, max_tokens, 0, "local");
    json_object_set_new(r, "ignore_eos", json_false());
    char *body = json_dumps(r, JSON_COMPACT), *out = NULL;
    json_decref(r);
    const node_auth_key *k = sign_key;
    sign_key = &tc_key;
    int st = http(dport, "POST", "/v1/generate", body, &out);
    sign_key = k;
    free(body);
    json_t *o = st == 200 && out ? json_loads(out, 0, NULL) : NULL;
    char *t = strdup(o ? jstr(o, "text", NULL) : "(no reply)");
    json_decref(o);
    free(out);
    return t;
}

static char *tc_local_text(int dport, int prefix_len, int tag, int suffix_len, int max_tokens) {
    return tc_local_text_of(dport, 0, prefix_len, tag, suffix_len, max_tokens);
}

/* ==== A burst of concurrent requests ==== */

typedef struct {
    int port, tag, len, max_tokens;
    int status;
    char node[64], outcome[32];
} tc_job;

static void *tc_job_main(void *arg) {
    tc_job *j = arg;
    char *body = tc_body(0, j->tag, j->len, j->max_tokens, 0), *raw = NULL;
    j->status = http_raw(j->port, "POST", "/v1/completions", NULL, body, &raw);
    http_header(raw ? raw : "", "X-Tandem-Decode-Node", j->node, sizeof j->node);
    http_header(raw ? raw : "", "X-Tandem-Prefill-Outcome", j->outcome, sizeof j->outcome);
    free(raw);
    free(body);
    return NULL;
}

static void tc_burst(tc_job *jobs, int n) {
    pthread_t th[TC_BURST];
    for (int i = 0; i < n; i++) pthread_create(&th[i], NULL, tc_job_main, &jobs[i]);
    for (int i = 0; i < n; i++) pthread_join(th[i], NULL);
}

/* ==== 2 + 2 nodes ==== */

typedef struct {
    pid_t pf[2], dn[2], rt;
    int pport[2], mport[2], dport[2], rport;
} tc_cluster;

static void tc_stop_all(pid_t *pids, int n) {
    for (int i = 0; i < n; i++)
        if (pids[i] > 0) stop_proc(pids[i], 5000);
}

/* The 8-suffix experiment: the prefix is computed once where it is needed. */
static void test_suffixes(tc_cluster *c) {
    long long before = 0;
    for (int i = 0; i < 2; i++) before += tc_decode_computed(c->dport[i]) + tc_prefill_computed(c->mport[i]);
    char *texts[8] = {0};
    int ok = 1;
    for (int k = 0; k < 8; k++) {
        char *body = tc_body(TC_PREFIX, 100 + k, TC_SUFFIX, 4, 0), *raw = NULL;
        int st = http_raw(c->rport, "POST", "/v1/completions", NULL, body, &raw);
        char dn[64], pn[64], plan[16];
        http_header(raw ? raw : "", "X-Tandem-Decode-Node", dn, sizeof dn);
        http_header(raw ? raw : "", "X-Tandem-Prefill-Node", pn, sizeof pn);
        http_header(raw ? raw : "", "X-Tandem-Prefill-Plan", plan, sizeof plan);
        json_t *o = tc_json(raw);
        texts[k] = strdup(o ? tc_text(o) : "");
        printf("test_router_cache: suffix %d: HTTP %d decode %s plan %s prefill %s\n", k, st, dn, plan, pn);
        ok &= st == 200;
        json_decref(o);
        free(raw);
        free(body);
    }
    CHECK(ok, "8 prompts of one prefix answered");
    long long after = 0;
    for (int i = 0; i < 2; i++) after += tc_decode_computed(c->dport[i]) + tc_prefill_computed(c->mport[i]);
    long long computed = after - before, bound = TC_PREFIX + 8 * (TC_SUFFIX + 1) + TC_PREFIX;
    printf("test_router_cache: 8 suffixes: %lld positions computed over the cluster (bound %lld; "
           "once-per-cluster ideal %d)\n", computed, bound, TC_PREFIX + 8 * (TC_SUFFIX + 1));
    CHECK(computed > 0 && computed <= bound, "8-suffix experiment: %lld positions computed <= prefix + 8 x suffix + "
          "one extra prefix (%lld)", computed, bound);
    /* greedy outputs unchanged: each equals the prompt prefilled locally */
    int same = 0;
    for (int k = 0; k < 8; k++) {
        char *t = tc_local_text(c->dport[k % 2], TC_PREFIX, 100 + k, TC_SUFFIX, 4);
        same += !strcmp(t, texts[k]);
        if (strcmp(t, texts[k])) printf("test_router_cache: suffix %d: routed \"%s\" local \"%s\"\n", k, texts[k], t);
        free(t);
        free(texts[k]);
    }
    CHECK(same == 8, "greedy outputs equal local prefill: %d of 8", same);
}

/* One request of the in-flight test: prefix ptag, suffix tag, log id rid. */
typedef struct {
    int port, ptag, tag, status;
    char rid[16], node[64], pnode[64], text[256];
} tc_flight;

static void *tc_flight_main(void *arg) {
    tc_flight *f = arg;
    char *body = tc_body_of(f->ptag, TC_PREFIX, f->tag, TC_SUFFIX, 4, 0), *raw = NULL, hdr[64];
    snprintf(hdr, sizeof hdr, "X-Request-Id: %s\r\n", f->rid);
    f->status = http_raw(f->port, "POST", "/v1/completions", hdr, body, &raw);
    http_header(raw ? raw : "", "X-Tandem-Decode-Node", f->node, sizeof f->node);
    http_header(raw ? raw : "", "X-Tandem-Prefill-Node", f->pnode, sizeof f->pnode);
    json_t *o = tc_json(raw);
    snprintf(f->text, sizeof f->text, "%s", o ? tc_text(o) : "");
    json_decref(o);
    free(raw);
    free(body);
    return NULL;
}

/* Sends f on its own thread and waits until the router has routed it. */
static void tc_flight_send(pthread_t *th, tc_flight *f) {
    char what[64];
    snprintf(what, sizeof what, "req=%s model q -> decode", f->rid);
    pthread_create(th, NULL, tc_flight_main, f);
    CHECK(wait_file_has(TC_DIR "/rt.log", what, 5000), "request %s routed", f->rid);
}

/* What a split in flight holds, with both prefill nodes stopped so that the
 * handoffs stay in flight (--split always):
 *  - a prompt whose prefix one session holds, sent while another request
 *    of that prefix runs its handoff on that session: the decode node would
 *    open a second session, which holds nothing, so the pick must not count
 *    the busy one (bench_route: the prefill node computed the prefix again
 *    behind a plan that counted it held; the pick went to the busy prefill
 *    node over an idle one);
 *  - a prompt of a fresh prefix, sent while a split of that prefix runs:
 *    its rows are not in the decode node's slots until that split's first
 *    token (a local prefill started meanwhile computes the prefix again). */
static void test_in_flight(tc_cluster *c) {
    tc_flight f0 = { .port = c->rport, .ptag = 47, .tag = 470, .rid = "a4700000" };
    tc_flight_main(&f0);
    CHECK(f0.status == 200 && f0.pnode[0], "in flight: the holder's request split (HTTP %d, prefill %s)", f0.status,
          f0.pnode);
    sleep_ms(500);   /* its report: the session to f0.pnode holds the prefix */
    tc_flight f[4] = {
        { .port = c->rport, .ptag = 47, .tag = 471, .rid = "a4700001" },
        { .port = c->rport, .ptag = 47, .tag = 472, .rid = "a4700002" },
        { .port = c->rport, .ptag = 48, .tag = 480, .rid = "a4700003" },
        { .port = c->rport, .ptag = 48, .tag = 481, .rid = "a4700004" },
    };
    pthread_t th[4];
    kill(c->pf[0], SIGSTOP);
    kill(c->pf[1], SIGSTOP);
    for (int i = 0; i < 4; i++) tc_flight_send(&th[i], &f[i]);
    kill(c->pf[0], SIGCONT);
    kill(c->pf[1], SIGCONT);
    for (int i = 0; i < 4; i++) pthread_join(th[i], NULL);
    int ok = f0.status == 200;
    for (int i = 0; i < 4; i++) {
        ok &= f[i].status == 200;
        printf("test_router_cache: in flight %s: HTTP %d decode %s prefill %s\n", f[i].rid, f[i].status, f[i].node, f[i].pnode);
    }
    CHECK(ok, "in flight: every request answered");
    CHECK(!strcmp(f[0].node, f0.node) && !strcmp(f[0].pnode, f0.pnode),
          "in flight: a prompt of a held prefix goes where it is held (%s via %s; held on %s via %s)", f[0].node,
          f[0].pnode, f0.node, f0.pnode);
    CHECK(strcmp(f[1].pnode, f[0].pnode), "in flight: a second prompt of that prefix is not sent to the busy session's "
          "prefill node (%s) over the idle one (went via %s)", f[0].pnode, f[1].pnode);
    /* what the pick saw on f[2]'s decode node for f[3]: nothing held yet */
    char *log = slurp(TC_DIR "/rt.log"), what[128];
    snprintf(what, sizeof what, "req=%s pick: decode %s ", f[3].rid, f[2].node);
    const char *pk = strstr(log, what), *held = pk ? strstr(pk, "(held ") : NULL;
    int h = held ? atoi(held + 6) : -1;
    CHECK(h == 0, "in flight: a split's prefix is not counted on its decode node before its first token (held %d)", h);
    free(log);
    /* greedy outputs unchanged */
    int same = 0;
    for (int i = 0; i < 4; i++) {
        char *t = tc_local_text_of(c->dport[i % 2], f[i].ptag, TC_PREFIX, f[i].tag, TC_SUFFIX, 4);
        same += !strcmp(t, f[i].text);
        free(t);
    }
    CHECK(same == 4, "in flight: greedy outputs equal local prefill: %d of 4", same);
}

/* The same 16 prompts twice: whole prompts reused the second time. */
static void test_repeat_burst(tc_cluster *c) {
    tc_job jobs[TC_BURST];
    char first[TC_BURST][64];
    for (int pass = 0; pass < 2; pass++) {
        for (int i = 0; i < TC_BURST; i++) jobs[i] = (tc_job){ .port = c->rport, .tag = 1000 + i, .len = TC_BURST_LEN, .max_tokens = 2 };
        tc_burst(jobs, TC_BURST);
        int ok = 0, cached = 0, on0 = 0;
        char n0[64];
        snprintf(n0, sizeof n0, "127.0.0.1:%d", c->dport[0]);
        for (int i = 0; i < TC_BURST; i++) {
            ok += jobs[i].status == 200;
            cached += !strcmp(jobs[i].outcome, "cached");
            on0 += !strcmp(jobs[i].node, n0);
            if (pass == 0) snprintf(first[i], sizeof first[i], "%s", jobs[i].node);
            /* a prompt not reused: where it was held and where it went */
            else if (strcmp(jobs[i].outcome, "cached"))
                printf("test_router_cache: burst 2: prompt %d first on %s, now on %s: %s\n", i, first[i], jobs[i].node,
                       jobs[i].outcome);
        }
        printf("test_router_cache: burst %d: %d ok, %d whole prompts reused, %d on the first decode node\n", pass + 1, ok,
               cached, on0);
        CHECK(ok == TC_BURST, "burst %d: every request answered (%d)", pass + 1, ok);
        /* Issue 47's bar. It had been lowered to 10 after 11-13 in five runs
         * under load: with --split always the plan's estimate counted the
         * prefill node's compute and queue even on the decode node that
         * held the whole prompt, so holder and non-holder tied and the
         * capacity order sent some away (each such request then also
         * evicted held prompts on the node it reached). */
        if (pass == 1) CHECK(cached >= 14, "repeated burst reuses whole prompts for %d of 16 (>= 14)", cached);
        sleep_ms(600);   /* a health report or two */
    }
}

/* A prompt longer than every prefill node's context (which the router
 * learns from their HELLOs) is not split to them (--split always): planned
 * local, so no fallback and no prefill node marked down. */
static void test_prefill_ctx(tc_cluster *c) {
    char *h = NULL;
    http(c->rport, "GET", "/health", NULL, &h);
    json_t *ho = h ? json_loads(h, 0, NULL) : NULL, *nodes = json_object_get(ho, "nodes");
    int learned = 0;
    for (size_t k = 0; k < json_array_size(nodes); k++) {
        json_t *n = json_array_get(nodes, k);
        learned += !strcmp(jstr(n, "role", NULL) ? jstr(n, "role", NULL) : "", "prefill") &&
                   json_integer_value(json_object_get(n, "n_ctx")) == atoi(TC_PF_CTX_S);
    }
    json_decref(ho);
    free(h);
    CHECK(learned == 2, "the router learned both prefill nodes' context (%s) from their HELLOs: %d", TC_PF_CTX_S, learned);
    char *log0 = slurp(TC_DIR "/rt.log");
    size_t from = log0 ? strlen(log0) : 0;   /* what the router logs from here on */
    free(log0);
    char *body = tc_body(0, 6000, TC_LONG, 2, 0), *raw = NULL;
    int st = http_raw(c->rport, "POST", "/v1/completions", NULL, body, &raw);
    free(body);
    char plan[16], pn[64], outcome[32];
    http_header(raw ? raw : "", "X-Tandem-Prefill-Plan", plan, sizeof plan);
    http_header(raw ? raw : "", "X-Tandem-Prefill-Node", pn, sizeof pn);
    http_header(raw ? raw : "", "X-Tandem-Prefill-Outcome", outcome, sizeof outcome);
    free(raw);
    sleep_ms(100);   /* its log line */
    char *log = slurp(TC_DIR "/rt.log");
    const char *since = log && strlen(log) >= from ? log + from : NULL;
    printf("test_router_cache: a %d-token prompt: HTTP %d plan %s outcome %s prefill node '%s'\n", TC_LONG, st, plan, outcome,
           pn);
    CHECK(st == 200 && !strcmp(plan, "local") && !pn[0] && !strcmp(outcome, "local") && since &&
          strstr(since, "reason=prefill_context") && !strstr(since, "marked down"),
          "a prompt longer than every prefill node's context is planned local (plan %s, outcome %s), none marked down",
          plan, outcome);
    free(log);
}

/* Every prefill node killed: the split falls back, the stream says so, the
 * router logs each "marked down" and counts failed checks. */
static void test_fallback(tc_cluster *c) {
    for (int i = 0; i < 2; i++) { kill(c->pf[i], SIGKILL); wait_exit(c->pf[i], 5000); c->pf[i] = 0; }
    char *body = tc_body(0, 5000, 150, 3, 1), *raw = NULL;
    int st = http_raw(c->rport, "POST", "/v1/completions", NULL, body, &raw);
    free(body);
    char plan[16], pn[64];
    http_header(raw ? raw : "", "X-Tandem-Prefill-Plan", plan, sizeof plan);
    http_header(raw ? raw : "", "X-Tandem-Prefill-Node", pn, sizeof pn);
    const char *cm = raw ? strstr(raw, ": tandem prefill=") : NULL;
    char line[400] = "";
    if (cm) snprintf(line, sizeof line, "%.*s", (int)strcspn(cm, "\n"), cm);
    printf("test_router_cache: stream after the prefill nodes died: plan %s via %s; %s\n", plan, pn, line);
    CHECK(st == 200 && !strcmp(plan, "split") && strstr(line, "prefill=fallback") && strstr(line, "reason=\"") &&
          strstr(raw, "data: [DONE]") && cm < strstr(raw, "data: [DONE]"),
          "the stream ends with the fallback as an SSE comment before [DONE]: %s", line);
    free(raw);
    /* by the fallback, or (a loaded host: the request planned before the
     * kill was seen) by a health check that came first */
    char want[160], want2[160];
    snprintf(want, sizeof want, "prefill node %s marked down (its split fell back", pn);
    snprintf(want2, sizeof want2, "prefill node %s marked down (health check failed", pn);
    int seen = wait_file_has(TC_DIR "/rt.log", want, 3000);
    if (!seen) {
        char *log = slurp(TC_DIR "/rt.log");
        seen = log && strstr(log, want2);
        free(log);
    }
    CHECK(seen, "router logs: %s", want);
    /* the next stream's headers do not name a dead prefill node */
    sleep_ms(1500);   /* three failed checks of the other one */
    body = tc_body(0, 5001, 150, 3, 1);
    st = http_raw(c->rport, "POST", "/v1/completions", NULL, body, &raw);
    free(body);
    http_header(raw ? raw : "", "X-Tandem-Prefill-Plan", plan, sizeof plan);
    http_header(raw ? raw : "", "X-Tandem-Prefill-Node", pn, sizeof pn);
    CHECK(st == 200 && !strcmp(plan, "local") && !pn[0] && raw && strstr(raw, ": tandem prefill=local plan=local"),
          "with both prefill nodes down the next stream is local and names none (plan %s, node '%s')", plan, pn);
    free(raw);
    for (int i = 0; i < 2; i++) {
        char series[160];
        snprintf(series, sizeof series, "tandem_node_failures_total{node=\"127.0.0.1:%d\",role=\"prefill\",model=\"q\"} ",
                 c->pport[i]);
        double f = metric_value(c->rport, series);
        CHECK(f >= 3, "failed health checks counted in tandem_node_failures_total: %.0f for prefill node %d", f, i);
    }
}

static void test_cluster(void) {
    char b[512], model[600];
    snprintf(b, sizeof b, "%s", bin());
    snprintf(model, sizeof model, "%s/qwen3-mini-F16.gguf", t_models());
    if (!t_need(model)) return;
    tc_cluster c;
    memset(&c, 0, sizeof c);
    char pf_port[2][64], pf_mport[2][64], pf_name[2][8], mf_name[2][8];
    for (int i = 0; i < 2; i++) {
        snprintf(pf_name[i], sizeof pf_name[i], "pf%d", i);
        snprintf(mf_name[i], sizeof mf_name[i], "pm%d", i);
        snprintf(pf_port[i], sizeof pf_port[i], TC_DIR "/pf%d.port", i);
        snprintf(pf_mport[i], sizeof pf_mport[i], TC_DIR "/pm%d.port", i);
        char *a[] = {b, "serve", "--role", "prefill", "-m", model, "-t", "1", "-c", TC_PF_CTX_S, "--secret-file", tc_secret_path,
                     "--metrics-listen", "127.0.0.1:0", "--metrics-port-file", pf_mport[i], "--port-file", pf_port[i], NULL};
        c.pport[i] = tc_start(&c.pf[i], a, pf_name[i]);
        c.mport[i] = wait_port(pf_mport[i], c.pf[i], 10000);
    }
    char dn_port[2][64], dn_name[2][8], dd[2][64], pp[2][64];
    for (int i = 0; i < 2; i++) {
        snprintf(dn_name[i], sizeof dn_name[i], "dn%d", i);
        snprintf(dn_port[i], sizeof dn_port[i], TC_DIR "/dn%d.port", i);
        char *a[] = {b, "serve", "--role", "decode", "-m", model, "-t", "1", "-c", "1024", "--parallel", "8",
                     "--secret-file", tc_secret_path, "--listen", "127.0.0.1:0", "--port-file", dn_port[i], NULL};
        c.dport[i] = tc_start(&c.dn[i], a, dn_name[i]);
        snprintf(dd[i], sizeof dd[i], "q=127.0.0.1:%d", c.dport[i]);
        snprintf(pp[i], sizeof pp[i], "q=127.0.0.1:%d", c.pport[i]);
    }
    char *ra[] = {b, "serve", "--role", "router", "--listen", "127.0.0.1:0", "--secret-file", tc_secret_path,
                  "--decode", dd[0], "--decode", dd[1], "--prefill", pp[0], "--prefill", pp[1], "--split", "always",
                  "--health-interval-ms", "200", "--log-level", "debug", "--port-file", TC_DIR "/rt.port", NULL};
    int up = c.pport[0] > 0 && c.pport[1] > 0 && c.mport[0] > 0 && c.mport[1] > 0 && c.dport[0] > 0 && c.dport[1] > 0;
    c.rport = up ? tc_start(&c.rt, ra, "rt") : -1;
    if (c.rport > 0) {
        test_suffixes(&c);
        test_in_flight(&c);
        test_repeat_burst(&c);
        test_prefill_ctx(&c);
        test_fallback(&c);
    }
    pid_t all[] = {c.rt, c.dn[0], c.dn[1], c.pf[0], c.pf[1]};
    tc_stop_all(all, 5);
}

/* ==== Capacity: a 1-slot node beside a 4-slot node ==== */

/* A stream on the router; returns the connected socket once its headers and
 * first event came (decode node into node), or -1. */
static int tc_stream_open(int rport, char *node, size_t nlen) {
    char *body = tc_body(0, 7000, 100, 400, 1);
    int fd = http_connect(rport);
    if (fd < 0 || http_send(fd, "POST", "/v1/completions", body)) { free(body); if (fd >= 0) close(fd); return -1; }
    free(body);
    char buf[8192];
    size_t n = 0;
    while (n < sizeof buf - 1 && !strstr(buf, "data: ")) {
        ssize_t r = recv(fd, buf + n, sizeof buf - 1 - n, 0);
        if (r <= 0) break;
        n += (size_t)r;
        buf[n] = 0;
    }
    buf[n] = 0;
    http_header(buf, "X-Tandem-Decode-Node", node, nlen);
    if (!strstr(buf, "data: ")) { close(fd); return -1; }
    return fd;
}

static void test_capacity(void) {
    char b[512], model[600];
    snprintf(b, sizeof b, "%s", bin());
    snprintf(model, sizeof model, "%s/qwen3-mini-F16.gguf", t_models());
    if (!t_need(model)) return;
    pid_t d1 = 0, d4 = 0, rt = 0;
    char *a1[] = {b, "serve", "--role", "decode", "-m", model, "-t", "1", "-c", "1024", "--parallel", "1", "--secret-file",
                  tc_secret_path, "--client-share", "100", "--listen", "127.0.0.1:0", "--port-file", TC_DIR "/d1.port", NULL};
    char *a4[] = {b, "serve", "--role", "decode", "-m", model, "-t", "1", "-c", "1024", "--parallel", "4", "--secret-file",
                  tc_secret_path, "--client-share", "100", "--listen", "127.0.0.1:0", "--port-file", TC_DIR "/d4.port", NULL};
    int p1 = tc_start(&d1, a1, "d1"), p4 = tc_start(&d4, a4, "d4");
    char s1[64], s4[64];
    snprintf(s1, sizeof s1, "q=127.0.0.1:%d", p1);
    snprintf(s4, sizeof s4, "q=127.0.0.1:%d", p4);
    char *ra[] = {b, "serve", "--role", "router", "--listen", "127.0.0.1:0", "--secret-file", tc_secret_path,
                  "--decode", s1, "--decode", s4, "--health-interval-ms", "1000", "--port-file", TC_DIR "/rc.port", NULL};
    int rport = p1 > 0 && p4 > 0 ? tc_start(&rt, ra, "rc") : -1;
    if (rport > 0) {
        tc_job jobs[TC_BURST];
        for (int round = 0; round < 2; round++) {
            for (int i = 0; i < TC_BURST; i++)
                jobs[i] = (tc_job){ .port = rport, .tag = 3000 + 100 * round + i, .len = 16, .max_tokens = 48 };
            tc_burst(jobs, TC_BURST);
            int on1 = 0, ok = 0;
            char n1[64];
            snprintf(n1, sizeof n1, "127.0.0.1:%d", p1);
            for (int i = 0; i < TC_BURST; i++) { on1 += !strcmp(jobs[i].node, n1); ok += jobs[i].status == 200; }
            char *h = NULL;
            http(rport, "GET", "/health", NULL, &h);
            json_t *ho = h ? json_loads(h, 0, NULL) : NULL, *nodes = json_object_get(ho, "nodes");
            double hold[2] = {0, 0};
            for (size_t k = 0; k < json_array_size(nodes) && k < 2; k++)
                hold[k] = json_number_value(json_object_get(json_array_get(nodes, k), "hold_ms"));
            json_decref(ho);
            free(h);
            printf("test_router_cache: capacity burst %d: 1-slot node got %d of 16 (%d ok); slot hold times now "
                   "%.0f ms (1 slot), %.0f ms (4 slots)\n", round + 1, on1, ok, hold[0], hold[1]);
            CHECK(ok == TC_BURST && on1 <= TC_BURST * 30 / 100, "capacity burst %d: the 1-slot node got %d of 16 (<= 30%%)",
                  round + 1, on1);
        }
        /* a loaded host: the 4-slot node stopped for 2 s is not marked down */
        kill(d4, SIGSTOP);
        sleep_ms(2000);
        kill(d4, SIGCONT);
        sleep_ms(300);
        char *log = slurp(TC_DIR "/rc.log");
        CHECK(!strstr(log, "marked down"), "a node stopped for 2 s is not marked down (three failed probes needed)");
        free(log);
        /* a decode node that dies mid-stream is marked down at once */
        char node[64] = "";
        int fd = tc_stream_open(rport, node, sizeof node);
        pid_t victim = !strcmp(node + strlen("127.0.0.1:"), s1 + strlen("q=127.0.0.1:")) ? d1 : d4;
        CHECK(fd >= 0 && node[0], "a stream started on %s", node);
        if (fd >= 0) {
            double t0 = now_ms();
            kill(victim, SIGKILL);
            wait_exit(victim, 5000);
            if (victim == d1) d1 = 0; else d4 = 0;
            size_t n;
            char *rest = http_read_all(fd, &n);
            close(fd);
            char want[160];
            snprintf(want, sizeof want, "decode node %s marked down: its stream broke", node);
            int seen = wait_file_has(TC_DIR "/rc.log", want, 3000);
            double ms = now_ms() - t0;
            printf("test_router_cache: decode node killed mid-stream: marked down after %.0f ms\n", ms);
            /* the health checks alone would take three failed probes a second apart */
            CHECK(seen && ms < 1500, "a decode node dying mid-request is marked down at once (%.0f ms)", ms);
            CHECK(rest && strstr(rest, "\"error\""), "the stream ends with an error event");
            free(rest);
        }
    }
    pid_t all[] = {rt, d1, d4};
    tc_stop_all(all, 3);
}

/* ==== Without processes ==== */

static void test_pure(void) {
    CHECK(router_probe_timeout_ms(200, 0) == 1000 && router_probe_timeout_ms(2000, 0) == 2000,
          "probe timeout: at least 1 s and the interval");
    CHECK(router_probe_timeout_ms(1000, 500) == 4000, "probe timeout grows with the node's round trip: %d",
          router_probe_timeout_ms(1000, 500));
    CHECK(router_probe_timeout_ms(1000, 1e7) == 30000, "probe timeout capped at 30 s");
    /* the cost model counts only what is not held */
    router_cost_in in = { .n_prompt = 1000, .decode_prefill_tps = 1000, .prefill_prefill_tps = 1000,
                          .link_bytes_per_s = 1e9, .kv_bytes_per_token = 1000, .handoff_overhead_ms = 2,
                          .have_prefill = 1, .policy = ROUTER_SPLIT_AUTO, .min_split_tokens = 32 };
    router_decision d;
    router_decide(&in, &d);
    double local0 = d.est_local_ms;
    in.cached_decode = 960;
    router_decide(&in, &d);
    CHECK(fabs(d.est_local_ms - 40) < 1e-6 && fabs(local0 - 1000) < 1e-6 && !d.split,
          "a held prefix leaves 40 positions to compute locally: %.1f ms, plan %s", d.est_local_ms, d.split ? "split" : "local");
    in.cached_decode = 0;
    in.cached_prefill = 900;
    router_decide(&in, &d);
    CHECK(d.split && fabs(d.est_split_ms - 100 - 2) < 1e-6,
          "a prefix held by the prefill node: 100 positions computed there, split (%.1f ms)", d.est_split_ms);
    /* the whole prompt held on the decode node: a split plan asks nothing
     * of the prefill node, whatever its queue (the repeated burst) */
    in.cached_prefill = 0;
    in.cached_decode = 1000;
    in.prefill_queue = 7;
    in.policy = ROUTER_SPLIT_ALWAYS;
    router_decide(&in, &d);
    CHECK(d.split && fabs(d.est_split_ms - d.est_local_ms) < 1e-9 && fabs(d.est_local_ms - 1) < 1e-6,
          "a whole prompt held on the decode node: split costs what local does (%.1f ms, local %.1f ms)", d.est_split_ms,
          d.est_local_ms);
    in.cached_decode = 960;
    router_decide(&in, &d);
    CHECK(d.est_split_ms > 100, "a prompt held but for 40 positions still costs the prefill node's compute (%.1f ms)",
          d.est_split_ms);
    /* --help: q8_0 on the wire with an f16 cache changes greedy output */
    char b[512];
    snprintf(b, sizeof b, "%s", bin());
    char *ha[] = {b, "serve", "--role", "decode", "--help", NULL};
    char *h = run_capture(ha);
    CHECK(h && strstr(h, "--wire-dtype") && strstr(h, "lossy") && strstr(h, "greedy output"),
          "decode --help says q8_0 on the wire changes greedy output");
    free(h);
    char *hr[] = {b, "serve", "--role", "router", "--help", NULL};
    h = run_capture(hr);
    CHECK(h && strstr(h, "--cache-aware"), "router --help lists --cache-aware");
    free(h);
}

int main(void) {
    signal(SIGPIPE, SIG_IGN);
    unsetenv("TANDEM_SECRET");
    unsetenv("TANDEM_API_KEY");
    unsetenv("TANDEM_LOG_LEVEL");
    mkdir("build", 0755);
    mkdir(TC_DIR, 0755);
    write_text(tc_secret_path, tc_secret);
    node_auth_derive(&tc_key, tc_secret, strlen(tc_secret), NODE_AUTH_LABEL_DECODE_API);
    test_pure();
    test_cluster();
    test_capacity();
    return t_done("test_router_cache");
}

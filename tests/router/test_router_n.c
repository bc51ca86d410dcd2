/* test_router_n.c - OpenAI "n" > 1: several choices from one prompt whose
 * KV is computed once and copied to the sibling sequences.
 *   - "n" parsing and the merged response (pure functions)
 *   - real processes: a prefill node and a decode node (stories260K, the
 *     router splits every prompt) and a local qwen3-mini node, behind one
 *     router
 *   - greedy n = 2 gives two choices equal to n = 1's output, streamed and
 *     not, completions and chat; usage counts the prompt once and sums the
 *     completions
 *   - the prompt is computed once: the decode node's /v1/stats show one
 *     remote prefill (split) or one local prefill (local) plus only the
 *     last prompt position per extra choice
 *   - temperature 1 with a seed: reproducible, choices differ, choice i is
 *     the n = 1 output for seed + i
 *   - logprobs, stop strings and tool calls per choice; n above the
 *     router's limit or the node's slots is a prompt 400
 *   - the Python `openai` client, n = 2 streamed and not, the usage chunk
 *   - a forced function call's arguments constrained by its "parameters"
 *     schema: they parse and validate, streamed and not, for every choice;
 *     "strict" with a keyword the grammar lacks is a 400. */
#include "proc.h"

#include <jansson.h>
#include <pthread.h>

#include "api/http_api.h"

#define RN_DIR "build/test_router_n.d"
#define RN_SLOTS_QWEN 2     /* the qwen node's --parallel: n = 3 exceeds it */

typedef struct {
    pid_t pf, dec, qw, router;
    int ppf, pdec, pqw, prouter;
    char stories[512], qwen[512];
} rn_env;

/* ==== Helpers ==== */

static int rn_start(pid_t *pid, int *port, char *const argv[], const char *name) {
    char pf[256], log[256];
    snprintf(pf, sizeof pf, RN_DIR "/%s.port", name);
    snprintf(log, sizeof log, RN_DIR "/%s.log", name);
    unlink(pf);
    *pid = spawn(argv, log);
    *port = wait_port(pf, *pid, 60000);
    CHECK(*port > 0, "%s started (see %s)", name, log);
    return *port > 0 ? 0 : -1;
}

static json_t *rn_post(int port, const char *path, const char *body, int *status) {
    char *out = NULL;
    *status = http(port, "POST", path, body, &out);
    json_t *o = out ? json_loads(out, 0, NULL) : NULL;
    free(out);
    return o;
}

/* choices[i] text (completions) or message.content (chat), "" if absent. */
static const char *rn_text(json_t *o, int i, int chat) {
    json_t *c = json_array_get(json_object_get(o, "choices"), (size_t)i);
    json_t *v = chat ? json_object_get(json_object_get(c, "message"), "content") : json_object_get(c, "text");
    return json_is_string(v) ? json_string_value(v) : "";
}

static int rn_stream(int port, const char *path, const char *body, int chat, int n, sse_choices *s) {
    char *out = NULL;
    int st = http(port, "POST", path, body, &out);
    sse_gather(out ? out : (char *)"", chat, n, s);
    free(out);
    return st;
}

/* The nodes have a secret: /v1/stats wants the decode-API signature, as
 * the router's calls carry it. */
static node_auth_key rn_key;

static json_t *rn_stats(int port) {
    char *out = NULL;
    http_req q = { .method = "GET", .path = "/v1/stats", .sign = &rn_key };
    int st = http_request(port, &q, &out);
    json_t *o = st == 200 ? json_loads(out, 0, NULL) : NULL;
    free(out);
    return o;
}

/* A node counts a request once its response is gone (with its choices
 * before it): wait until `done` requests have been counted. */
static void rn_settle(int port, long long done) {
    double t0 = now_ms();
    while (now_ms() - t0 < 5000) {
        json_t *o = rn_stats(port);
        long long n = jint(o, "requests_ok", NULL) + jint(o, "requests_failed", NULL) + jint(o, "requests_cancelled", NULL);
        json_decref(o);
        if (n >= done) return;
        sleep_ms(20);
    }
}

static long long rn_finished(int port) {
    json_t *o = rn_stats(port);
    long long n = jint(o, "requests_ok", NULL) + jint(o, "requests_failed", NULL) + jint(o, "requests_cancelled", NULL);
    json_decref(o);
    return n;
}

/* Prompt positions a decode node has computed itself so far: positions its
 * requests needed, less those copied from a cache and those received from a
 * prefill node. received: the latter alone. */
static long long rn_computed(int port, long long *received, long long *reused) {
    json_t *o = rn_stats(port);
    long long p = jint(o, "prompt_tokens", NULL), r = jint(o, "reused_positions", NULL),
              x = jint(o, "positions_received", NULL);
    json_decref(o);
    if (received) *received = x;
    if (reused) *reused = r;
    return p - r - x;
}

/* 1 if /v1/models lists id. */
static int rn_listed(int port, const char *id) {
    char *out = NULL;
    int st = http(port, "GET", "/v1/models", NULL, &out), found = 0;
    json_t *o = st == 200 && out ? json_loads(out, 0, NULL) : NULL;
    free(out);
    json_t *d = json_object_get(o, "data");
    for (size_t i = 0; i < json_array_size(d); i++) found |= !strcmp(jstr(json_array_get(d, i), "id", NULL), id);
    json_decref(o);
    return found;
}

static int rn_setup(rn_env *e) {
    char b[512], pp[64], dp[64], qp[64], pfp[64], sl[8];
    snprintf(b, sizeof b, "%s", bin());
    FILE *f = fopen(RN_DIR "/secret", "w");
    if (!f) return -1;
    fputs("router-n-test-secret-5f0c2a9e7b1d4c3a8e6f9b2d1c0a7e5f\n", f);
    node_auth_derive(&rn_key, "router-n-test-secret-5f0c2a9e7b1d4c3a8e6f9b2d1c0a7e5f", strlen("router-n-test-secret-5f0c2a9e7b1d4c3a8e6f9b2d1c0a7e5f"), NODE_AUTH_LABEL_DECODE_API);
    fclose(f);
    char *pf[] = {b, "serve", "--role", "prefill", "-m", e->stories, "-t", "1", "--secret-file", RN_DIR "/secret",
                  "--listen", "127.0.0.1:0", "--port-file", RN_DIR "/pf.port", NULL};
    if (rn_start(&e->pf, &e->ppf, pf, "pf")) return -1;
    snprintf(pp, sizeof pp, "127.0.0.1:%d", e->ppf);
    char *dec[] = {b, "serve", "--role", "decode", "-m", e->stories, "-t", "1", "--secret-file", RN_DIR "/secret",
                   "--parallel", "4", "--listen", "127.0.0.1:0", "--prefill-node", pp, "--port-file", RN_DIR "/dec.port", NULL};
    if (rn_start(&e->dec, &e->pdec, dec, "dec")) return -1;
    snprintf(sl, sizeof sl, "%d", RN_SLOTS_QWEN);
    char *qw[] = {b, "serve", "--role", "local", "-m", e->qwen, "-t", "1", "--secret-file", RN_DIR "/secret",
                  "--parallel", sl, "--listen", "127.0.0.1:0", "--port-file", RN_DIR "/qw.port", NULL};
    if (rn_start(&e->qw, &e->pqw, qw, "qw")) return -1;
    snprintf(dp, sizeof dp, "stories=127.0.0.1:%d", e->pdec);
    snprintf(pfp, sizeof pfp, "stories=127.0.0.1:%d", e->ppf);
    snprintf(qp, sizeof qp, "qwen3=127.0.0.1:%d", e->pqw);
    char *r[] = {b, "serve", "--role", "router", "--listen", "127.0.0.1:0", "--secret-file", RN_DIR "/secret",
                 "--decode", dp, "--prefill", pfp, "--decode", qp, "--split", "always", "--health-interval-ms", "300",
                 "--port-file", RN_DIR "/router.port", NULL};
    if (rn_start(&e->router, &e->prouter, r, "router")) return -1;
    double t0 = now_ms();
    while (now_ms() - t0 < 15000 && !(rn_listed(e->prouter, "stories") && rn_listed(e->prouter, "qwen3"))) sleep_ms(100);
    CHECK(rn_listed(e->prouter, "stories") && rn_listed(e->prouter, "qwen3"), "both models listed");
    return 0;
}

/* ==== Pure functions ==== */

static void test_parse(void) {
    api_limits lim;
    api_limits_default(&lim);
    api_request r;
    api_error e;
    const char *b = "{\"model\":\"m\",\"prompt\":\"x\"}";
    CHECK(api_parse_request(API_COMPLETION, b, strlen(b), &lim, &r, &e) == 0 && r.n == 1, "no n: 1");
    char *up = api_upstream_body(&r, "local", NULL);
    CHECK(up && !strstr(up, "\"n\""), "n = 1 is not sent to the node: %s", up);
    free(up);
    api_request_free(&r);
    b = "{\"model\":\"m\",\"prompt\":\"x\",\"n\":3}";
    CHECK(api_parse_request(API_COMPLETION, b, strlen(b), &lim, &r, &e) == 0 && r.n == 3, "n 3");
    up = api_upstream_body(&r, "local", NULL);
    json_t *o = up ? json_loads(up, 0, NULL) : NULL;
    CHECK(jint(o, "n", NULL) == 3 && json_is_true(json_object_get(o, "stream")), "n 3 goes to the node, streamed: %s", up);
    json_decref(o);
    free(up);
    api_request_free(&r);
    static const char *bad[] = {"0", "9", "-1", "\"2\"", "1.5", "true"};
    for (size_t i = 0; i < sizeof bad / sizeof bad[0]; i++) {
        char body[128];
        snprintf(body, sizeof body, "{\"model\":\"m\",\"messages\":[{\"role\":\"user\",\"content\":\"x\"}],\"n\":%s}", bad[i]);
        int rc = api_parse_request(API_CHAT, body, strlen(body), &lim, &r, &e);
        CHECK(rc == -1 && e.status == 400 && !strcmp(e.param, "n"), "n %s: 400 on n (%s)", bad[i], rc ? e.message : "accepted");
        if (rc == 0) api_request_free(&r);
    }
    b = "{\"model\":\"m\",\"messages\":[{\"role\":\"user\",\"content\":\"x\"}],\"n\":9}";
    CHECK(api_parse_request(API_CHAT, b, strlen(b), &lim, &r, &e) == -1 && strstr(e.message, "between 1 and 8"),
          "the limit is named: %s", e.message);

    /* two single-choice responses merge into one with usage counted once */
    api_resp_meta m = {.id = "chatcmpl-1", .created = 5, .model = "m"};
    char *a = api_render_response(API_CHAT, &m, "one", "stop", 4, 5);
    m.index = 1;
    char *c = api_render_response(API_CHAT, &m, "two", "length", 4, 5);
    char *both[2] = {a, c};
    char *mg = api_merge_responses(both, 2, 4, 5);
    o = mg ? json_loads(mg, 0, NULL) : NULL;
    json_t *ch = json_object_get(o, "choices");
    CHECK(json_array_size(ch) == 2 && jint(json_array_get(ch, 0), "index", NULL) == 0 &&
          jint(json_array_get(ch, 1), "index", NULL) == 1 && !strcmp(rn_text(o, 1, 1), "two") &&
          !strcmp(jstr(json_array_get(ch, 1), "finish_reason", NULL), "length") &&
          jint(o, "usage", "prompt_tokens") == 4 && jint(o, "usage", "completion_tokens") == 5 &&
          jint(o, "usage", "total_tokens") == 9, "merged response: %s", mg);
    json_decref(o);
    free(a); free(c); free(mg);
    /* a chunk carries its choice's index */
    m.index = 2;
    char *k = api_render_chunk(API_COMPLETION, &m, "t", NULL, 0);
    CHECK(k && strstr(k, "\"index\":2"), "chunk index: %s", k);
    free(k);
}

/* ==== Greedy: n = 2 equals n = 1, the prompt computed once ==== */

static void test_greedy_split(rn_env *e) {
    /* a prompt no cache holds yet */
    const char *prompt = "The little dog ran to the big red barn and saw a cat";
    char body[512];
    long long rx0, rx1, ru0, ru1;
    long long fin = rn_finished(e->pdec), c0 = rn_computed(e->pdec, &rx0, &ru0);
    int st;
    snprintf(body, sizeof body, "{\"model\":\"stories\",\"prompt\":\"%s\",\"max_tokens\":12,\"temperature\":0,\"n\":2}", prompt);
    json_t *two = rn_post(e->prouter, "/v1/completions", body, &st);
    rn_settle(e->pdec, fin + 1);
    long long c1 = rn_computed(e->pdec, &rx1, &ru1);
    int p = (int)jint(two, "usage", "prompt_tokens");
    CHECK(st == 200 && json_array_size(json_object_get(two, "choices")) == 2 && p > 4, "n 2 split: %d", st);
    /* choice 0 received positions [0, p-1) from the prefill node, choice 1
     * copied them: each computed only its last prompt position */
    CHECK(rx1 - rx0 == p - 1, "prefill node sent the prompt once: %lld positions for a %d-token prompt", rx1 - rx0, p);
    CHECK(ru1 - ru0 == p - 1, "the sibling copied %lld positions (want %d)", ru1 - ru0, p - 1);
    CHECK(c1 - c0 == 2, "the decode node computed %lld prompt positions itself (want 2: the last one per choice)", c1 - c0);
    snprintf(body, sizeof body, "{\"model\":\"stories\",\"prompt\":\"%s\",\"max_tokens\":12,\"temperature\":0}", prompt);
    json_t *one = rn_post(e->prouter, "/v1/completions", body, &st);
    const char *want = rn_text(one, 0, 0);
    CHECK(st == 200 && *want, "n 1: %d", st);
    CHECK(!strcmp(rn_text(two, 0, 0), want) && !strcmp(rn_text(two, 1, 0), want), "greedy n 2 = n 1: '%s' '%s' want '%s'",
          rn_text(two, 0, 0), rn_text(two, 1, 0), want);
    json_t *ch = json_object_get(two, "choices");
    CHECK(jint(json_array_get(ch, 0), "index", NULL) == 0 && jint(json_array_get(ch, 1), "index", NULL) == 1 &&
          !strcmp(jstr(json_array_get(ch, 1), "finish_reason", NULL), "length"), "indexes and finish reasons");
    CHECK(jint(two, "usage", "prompt_tokens") == jint(one, "usage", "prompt_tokens") &&
          jint(two, "usage", "completion_tokens") == 24 && jint(two, "usage", "total_tokens") == p + 24,
          "usage: prompt once, completions summed");

    /* streamed */
    snprintf(body, sizeof body, "{\"model\":\"stories\",\"prompt\":\"%s\",\"max_tokens\":12,\"temperature\":0,\"n\":2,"
             "\"stream\":true,\"stream_options\":{\"include_usage\":true}}", prompt);
    sse_choices s;
    st = rn_stream(e->prouter, "/v1/completions", body, 0, 2, &s);
    CHECK(st == 200 && s.done == 1 && !s.errors && !s.bad_index, "n 2 streamed: %d done %d errors %d", st, s.done, s.errors);
    CHECK(!strcmp(s.text[0], want) && !strcmp(s.text[1], want), "streamed greedy n 2 = n 1: '%s' '%s'", s.text[0], s.text[1]);
    CHECK(!strcmp(s.finish[0], "length") && !strcmp(s.finish[1], "length"), "a finish chunk per choice");
    CHECK(s.usage_prompt == p && s.usage_completion == 24, "streamed usage %d %d", s.usage_prompt, s.usage_completion);
    json_decref(one);
    json_decref(two);

    /* stop strings and logprobs, per choice */
    snprintf(body, sizeof body, "{\"model\":\"stories\",\"prompt\":\"%s\",\"max_tokens\":12,\"temperature\":0,\"n\":2,"
             "\"logprobs\":2}", prompt);
    two = rn_post(e->prouter, "/v1/completions", body, &st);
    ch = json_object_get(two, "choices");
    for (int i = 0; i < 2; i++) {
        json_t *lp = json_object_get(json_array_get(ch, (size_t)i), "logprobs");
        CHECK(json_array_size(json_object_get(lp, "tokens")) == 12 && json_array_size(json_object_get(lp, "top_logprobs")) == 12,
              "choice %d has its 12 tokens' logprobs", i);
    }
    json_decref(two);
}

static void test_stop(rn_env *e) {
    int st;
    json_t *one = rn_post(e->prouter, "/v1/completions",
                          "{\"model\":\"stories\",\"prompt\":\"Once upon a time\",\"max_tokens\":12,\"temperature\":0}", &st);
    const char *t = rn_text(one, 0, 0);
    /* stop at the output's third character onwards: both choices end there */
    char stop[8] = "";
    if (strlen(t) > 5) memcpy(stop, t + 3, 3);
    char body[400], want[16] = "";
    memcpy(want, t, 3);
    snprintf(body, sizeof body, "{\"model\":\"stories\",\"prompt\":\"Once upon a time\",\"max_tokens\":12,\"temperature\":0,"
             "\"n\":2,\"stop\":[\"%s\"],\"stream\":true}", stop);
    sse_choices s;
    st = rn_stream(e->prouter, "/v1/completions", body, 0, 2, &s);
    CHECK(st == 200 && !strcmp(s.finish[0], "stop") && !strcmp(s.finish[1], "stop") && !strcmp(s.text[0], want) &&
          !strcmp(s.text[1], want), "stop '%s' per choice: '%s' (%s) '%s' (%s) want '%s'", stop, s.text[0], s.finish[0],
          s.text[1], s.finish[1], want);
    json_decref(one);
}

/* ==== Local node: chat, seeds, limits ==== */

static void test_chat_local(rn_env *e) {
    const char *msg = "Tell me about the sea and the old lighthouse keeper";
    char body[512];
    int st;
    long long fin = rn_finished(e->pqw), c0 = rn_computed(e->pqw, NULL, NULL);
    snprintf(body, sizeof body, "{\"model\":\"qwen3\",\"messages\":[{\"role\":\"user\",\"content\":\"%s\"}],"
             "\"max_tokens\":8,\"temperature\":0,\"n\":2}", msg);
    json_t *two = rn_post(e->prouter, "/v1/chat/completions", body, &st);
    rn_settle(e->pqw, fin + 1);
    long long c1 = rn_computed(e->pqw, NULL, NULL);
    int p = (int)jint(two, "usage", "prompt_tokens");
    CHECK(st == 200 && p > 8, "chat n 2: %d", st);
    CHECK(c1 - c0 == p + 1, "local: %lld prompt positions computed for n 2 (want %d: the prompt once, then the last "
          "position for the sibling)", c1 - c0, p + 1);
    snprintf(body, sizeof body, "{\"model\":\"qwen3\",\"messages\":[{\"role\":\"user\",\"content\":\"%s\"}],"
             "\"max_tokens\":8,\"temperature\":0}", msg);
    json_t *one = rn_post(e->prouter, "/v1/chat/completions", body, &st);
    const char *want = rn_text(one, 0, 1);
    CHECK(st == 200 && !strcmp(rn_text(two, 0, 1), want) && !strcmp(rn_text(two, 1, 1), want),
          "chat greedy n 2 = n 1: '%s' '%s' want '%s'", rn_text(two, 0, 1), rn_text(two, 1, 1), want);
    snprintf(body, sizeof body, "{\"model\":\"qwen3\",\"messages\":[{\"role\":\"user\",\"content\":\"%s\"}],"
             "\"max_tokens\":8,\"temperature\":0,\"n\":2,\"stream\":true,\"stream_options\":{\"include_usage\":true}}", msg);
    sse_choices s;
    st = rn_stream(e->prouter, "/v1/chat/completions", body, 1, 2, &s);
    CHECK(st == 200 && s.done == 1 && !s.errors && !strcmp(s.text[0], want) && !strcmp(s.text[1], want),
          "streamed chat n 2 = n 1: '%s' '%s'", s.text[0], s.text[1]);
    CHECK(s.first_is_role[0] && s.first_is_role[1] && s.roles[0] == 1 && s.roles[1] == 1, "each choice opens with the role");
    CHECK(s.usage_prompt == p && s.usage_completion == (int)jint(two, "usage", "completion_tokens"), "streamed chat usage");
    json_decref(one);
    json_decref(two);
}

static void test_seeds(rn_env *e) {
    const char *fmt = "{\"model\":\"qwen3\",\"prompt\":\"Once upon a time\",\"max_tokens\":16,\"temperature\":1,"
                      "\"seed\":%d,\"n\":%d}";
    char body[256];
    int st1, st2, st3;
    snprintf(body, sizeof body, fmt, 11, 2);
    json_t *a = rn_post(e->prouter, "/v1/completions", body, &st1);
    json_t *b = rn_post(e->prouter, "/v1/completions", body, &st2);
    CHECK(st1 == 200 && st2 == 200 && !strcmp(rn_text(a, 0, 0), rn_text(b, 0, 0)) && !strcmp(rn_text(a, 1, 0), rn_text(b, 1, 0)),
          "seeded n 2 replays");
    CHECK(strcmp(rn_text(a, 0, 0), rn_text(a, 1, 0)), "temperature 1: the choices differ ('%s' / '%s')", rn_text(a, 0, 0),
          rn_text(a, 1, 0));
    snprintf(body, sizeof body, fmt, 12, 1);
    json_t *c = rn_post(e->prouter, "/v1/completions", body, &st3);
    CHECK(st3 == 200 && !strcmp(rn_text(c, 0, 0), rn_text(a, 1, 0)), "choice 1 of seed 11 = n 1 with seed 12: '%s' vs '%s'",
          rn_text(a, 1, 0), rn_text(c, 0, 0));
    json_decref(a); json_decref(b); json_decref(c);
}

static void test_limits(rn_env *e) {
    int st;
    double t0 = now_ms();
    json_t *o = rn_post(e->prouter, "/v1/completions", "{\"model\":\"qwen3\",\"prompt\":\"x\",\"max_tokens\":4,\"n\":3}", &st);
    CHECK(st == 400 && strstr(jstr(o, "error", "message"), "--parallel 2") && now_ms() - t0 < 10000,
          "n above the node's slots: %d '%s'", st, jstr(o, "error", "message"));
    json_decref(o);
    o = rn_post(e->prouter, "/v1/completions", "{\"model\":\"qwen3\",\"prompt\":\"x\",\"max_tokens\":4,\"n\":9,\"stream\":true}", &st);
    CHECK(st == 400 && !strcmp(jstr(o, "error", "param"), "n"), "n 9 streamed: %d", st);
    json_decref(o);
    /* a node whose queue is shorter than n: every choice passes through it */
    char bn[512], *nq[] = {bn, "serve", "--role", "local", "-m", e->stories, "-t", "1", "--parallel", "4", "--queue", "2",
                           "--listen", "127.0.0.1:0", "--port-file", RN_DIR "/nq.port", NULL};
    snprintf(bn, sizeof bn, "%s", bin());
    pid_t pid;
    int port;
    if (rn_start(&pid, &port, nq, "nq") == 0) {
        char *out = NULL;
        st = http(port, "POST", "/v1/generate", "{\"prompt\":\"Once\",\"max_tokens\":2,\"n\":3,\"stream\":true}", &out);
        CHECK(st == 400 && out && strstr(out, "--queue 2"), "n above the node's queue: %d %s", st, out ? out : "");
        free(out);
        st = http(port, "POST", "/v1/generate", "{\"prompt\":\"Once\",\"max_tokens\":2,\"n\":2}", &out);
        CHECK(st == 400 && out && strstr(out, "stream"), "n 2 on the node needs a stream: %d %s", st, out ? out : "");
        free(out);
        st = http(port, "POST", "/v1/generate", "{\"prompt\":\"Once\",\"max_tokens\":2,\"n\":2,\"stream\":true}", &out);
        CHECK(st == 200 && out && strstr(out, "\"index\":1") && strstr(out, "\"index\":0"), "n 2 on the node: %d", st);
        free(out);
        stop_proc(pid, 5000);
    }
    /* the node still serves afterwards */
    o = rn_post(e->prouter, "/v1/completions", "{\"model\":\"qwen3\",\"prompt\":\"x\",\"max_tokens\":4,\"n\":2}", &st);
    CHECK(st == 200 && json_array_size(json_object_get(o, "choices")) == 2, "n 2 after the refusals: %d", st);
    json_decref(o);
}

/* Requests whose choices together need more slots than the node has: the
 * siblings wait for slots as other sequences end, nothing hangs. */
typedef struct { int port, status; char text[2][256]; } rn_job;

static void *rn_job_main(void *arg) {
    rn_job *j = arg;
    json_t *o = rn_post(j->port, "/v1/completions", "{\"model\":\"qwen3\",\"prompt\":\"Once upon a time\","
                        "\"max_tokens\":12,\"temperature\":0,\"n\":2}", &j->status);
    for (int i = 0; i < 2; i++) snprintf(j->text[i], sizeof j->text[i], "%s", rn_text(o, i, 0));
    json_decref(o);
    return NULL;
}

static void test_crowded(rn_env *e) {
    int st;
    json_t *one = rn_post(e->prouter, "/v1/completions", "{\"model\":\"qwen3\",\"prompt\":\"Once upon a time\","
                          "\"max_tokens\":12,\"temperature\":0}", &st);
    const char *want = rn_text(one, 0, 0);
    enum { K = 3 };   /* 3 requests x 2 choices on 2 slots */
    rn_job jobs[K];
    pthread_t th[K];
    double t0 = now_ms();
    for (int i = 0; i < K; i++) {
        memset(&jobs[i], 0, sizeof jobs[i]);
        jobs[i].port = e->prouter;
        pthread_create(&th[i], NULL, rn_job_main, &jobs[i]);
    }
    int ok = 0;
    for (int i = 0; i < K; i++) {
        pthread_join(th[i], NULL);
        ok += jobs[i].status == 200 && !strcmp(jobs[i].text[0], want) && !strcmp(jobs[i].text[1], want);
        if (jobs[i].status != 200) fprintf(stderr, "crowded request %d: status %d\n", i, jobs[i].status);
    }
    /* the router may answer 429 when the node's queue is full; none here:
     * 3 requests fit its queue */
    CHECK(ok == K, "%d concurrent n 2 requests on %d slots: %d complete with the greedy text (%.0f ms)", K,
          RN_SLOTS_QWEN, ok, now_ms() - t0);
    json_decref(one);
}

/* Two nodes for one model: the one with more free slots has too few slots
 * in all for n, the other enough. The router sends n to the latter. */
typedef struct { int port; } rn_load;

static void *rn_load_main(void *arg) {
    rn_load *l = arg;
    char *out = NULL;
    http(l->port, "POST", "/v1/generate", "{\"prompt\":\"Once upon a time\",\"max_tokens\":160,\"ignore_eos\":true}", &out);
    free(out);
    return NULL;
}

/* The queue depth the router last saw on the node at addr_port. */
static int rn_node_depth(int router_port, int node_port) {
    char *out = NULL, addr[32];
    snprintf(addr, sizeof addr, "127.0.0.1:%d", node_port);
    http(router_port, "GET", "/health", NULL, &out);
    json_t *o = out ? json_loads(out, 0, NULL) : NULL, *nodes = json_object_get(o, "nodes");
    free(out);
    int d = -1;
    for (size_t i = 0; i < json_array_size(nodes); i++)
        if (!strcmp(jstr(json_array_get(nodes, i), "addr", NULL), addr)) d = (int)jint(json_array_get(nodes, i), "queue_depth", NULL);
    json_decref(o);
    return d;
}

static void test_pick_slots(rn_env *e) {
    char b[512], qp[64], bp[64];
    snprintf(b, sizeof b, "%s", bin());
    char *big[] = {b, "serve", "--role", "local", "-m", e->qwen, "-t", "1", "--parallel", "4", "--listen", "127.0.0.1:0",
                   "--port-file", RN_DIR "/big.port", NULL};
    pid_t pbig = 0, pr = 0;
    int big_port, rport;
    if (rn_start(&pbig, &big_port, big, "big")) return;
    snprintf(qp, sizeof qp, "qwen3=127.0.0.1:%d", e->pqw);
    snprintf(bp, sizeof bp, "qwen3=127.0.0.1:%d", big_port);
    char *r2[] = {b, "serve", "--role", "router", "--listen", "127.0.0.1:0", "--secret-file", RN_DIR "/secret",
                  "--decode", qp, "--decode", bp, "--health-interval-ms", "100", "--port-file", RN_DIR "/r2.port", NULL};
    if (rn_start(&pr, &rport, r2, "r2")) { stop_proc(pbig, 5000); return; }
    /* three long generations on the big node: 1 slot free there, 2 on the small one */
    rn_load l = { big_port };
    pthread_t th[3];
    for (int i = 0; i < 3; i++) pthread_create(&th[i], NULL, rn_load_main, &l);
    double t0 = now_ms();
    while (now_ms() - t0 < 10000 && rn_node_depth(rport, big_port) < 3) sleep_ms(20);
    int depth = rn_node_depth(rport, big_port);
    int st;
    json_t *o = rn_post(rport, "/v1/completions", "{\"model\":\"qwen3\",\"prompt\":\"Hi\",\"max_tokens\":4,\"n\":3}", &st);
    CHECK(depth >= 3 && st == 200 && json_array_size(json_object_get(o, "choices")) == 3,
          "n 3 goes to the node with 4 slots (3 busy, queue depth %d seen), not the idle one with 2: %d %s", depth, st,
          jstr(json_object_get(o, "error"), "message", NULL));
    json_decref(o);
    for (int i = 0; i < 3; i++) pthread_join(th[i], NULL);
    stop_proc(pr, 5000);
    stop_proc(pbig, 5000);
}

/* Tool calls per choice: forced calls, distinct ids. */
static void test_tools(rn_env *e) {
    const char *body = "{\"model\":\"qwen3\",\"messages\":[{\"role\":\"user\",\"content\":\"Weather in Paris?\"}],"
                       "\"max_tokens\":24,\"temperature\":0,\"n\":2,\"tool_choice\":\"required\",\"tools\":[{\"type\":"
                       "\"function\",\"function\":{\"name\":\"get_weather\",\"parameters\":{\"type\":\"object\","
                       "\"properties\":{\"city\":{\"type\":\"string\"}}}}}]}";
    int st;
    json_t *o = rn_post(e->prouter, "/v1/chat/completions", body, &st);
    json_t *ch = json_object_get(o, "choices");
    const char *id[2] = {"", ""};
    int named = 0;
    for (int i = 0; i < 2; i++) {
        json_t *call = json_array_get(json_object_get(json_object_get(json_array_get(ch, (size_t)i), "message"), "tool_calls"), 0);
        id[i] = jstr(call, "id", NULL);
        named += !strcmp(jstr(json_object_get(call, "function"), "name", NULL), "get_weather");
    }
    CHECK(st == 200 && named == 2 && *id[0] && strcmp(id[0], id[1]), "a forced call per choice, ids '%s' '%s'", id[0], id[1]);
    json_decref(o);
}

/* ==== Tool-call arguments follow the function's schema ==== */

#define RN_WEATHER "\"tools\":[{\"type\":\"function\",\"function\":{\"name\":\"get_weather\",\"parameters\":" \
    "{\"type\":\"object\",\"properties\":{\"city\":{\"type\":\"string\",\"maxLength\":20},\"days\":{\"type\":" \
    "\"integer\",\"minimum\":1,\"maximum\":7}},\"required\":[\"city\",\"days\"],\"additionalProperties\":false}}}]"

/* 1 if args is JSON valid against RN_WEATHER's parameters. */
static int rn_weather_ok(const char *args) {
    json_t *a = json_loads(args, 0, NULL);
    json_t *city = json_object_get(a, "city"), *days = json_object_get(a, "days");
    int ok = json_is_object(a) && json_object_size(a) == 2 && json_is_string(city) &&
             json_string_length(city) <= 20 && json_is_integer(days) && json_integer_value(days) >= 1 &&
             json_integer_value(days) <= 7;
    json_decref(a);
    return ok;
}

static void test_tool_args_parse(void) {
    api_limits lim;
    api_limits_default(&lim);
    api_request r;
    api_error e;
    const char *b = "{\"model\":\"m\",\"messages\":[{\"role\":\"user\",\"content\":\"x\"}],\"tool_choice\":\"required\"," RN_WEATHER "}";
    CHECK(api_parse_request(API_CHAT, b, strlen(b), &lim, &r, &e) == 0 && r.tool_args_format &&
          strstr(r.tool_args_format, "\"json_schema\"") && strstr(r.tool_args_format, "\"maxLength\":20"),
          "a forced function's schema becomes its arguments' format: %s", r.tool_args_format ? r.tool_args_format : "(none)");
    api_request_free(&r);
    b = "{\"model\":\"m\",\"messages\":[{\"role\":\"user\",\"content\":\"x\"}],\"tool_choice\":\"required\",\"tools\":"
        "[{\"type\":\"function\",\"function\":{\"name\":\"f\",\"parameters\":{\"type\":\"object\",\"properties\":"
        "{\"id\":{\"type\":\"string\",\"format\":\"hostname\"}}}}}]}";
    CHECK(api_parse_request(API_CHAT, b, strlen(b), &lim, &r, &e) == 0 && r.tool_args_format &&
          strstr(r.tool_args_format, "\"json_object\""), "an unsupported keyword, not strict: any JSON object");
    api_request_free(&r);
    char strict[600];
    snprintf(strict, sizeof strict, "%.*s\"strict\":true,%s", (int)(strstr(b, "\"parameters\"") - b), b, strstr(b, "\"parameters\""));
    CHECK(api_parse_request(API_CHAT, strict, strlen(strict), &lim, &r, &e) == -1 && e.status == 400 &&
          !strcmp(e.param, "tools") && strstr(e.message, "format"), "strict with an unsupported keyword: 400 (%s)", e.message);
    b = "{\"model\":\"m\",\"messages\":[{\"role\":\"user\",\"content\":\"x\"}]," RN_WEATHER "}";
    CHECK(api_parse_request(API_CHAT, b, strlen(b), &lim, &r, &e) == 0 && !r.tool_args_format, "auto: no format");
    api_request_free(&r);
}

static void test_tool_args(rn_env *e) {
    char body[1200];
    int st, good = 0, total = 0, calls = 0;
    for (int seed = 1; seed <= 3; seed++) {
        snprintf(body, sizeof body, "{\"model\":\"qwen3\",\"messages\":[{\"role\":\"user\",\"content\":\"Weather in Paris?\"}],"
                 "\"max_tokens\":120,\"temperature\":1,\"seed\":%d,\"n\":2,\"tool_choice\":\"required\"," RN_WEATHER "}", seed);
        json_t *o = rn_post(e->prouter, "/v1/chat/completions", body, &st);
        json_t *ch = json_object_get(o, "choices");
        for (size_t i = 0; i < json_array_size(ch); i++) {
            json_t *c = json_array_get(ch, i);
            json_t *call = json_array_get(json_object_get(json_object_get(c, "message"), "tool_calls"), 0);
            const char *args = jstr(json_object_get(call, "function"), "arguments", NULL);
            total++;
            calls += !strcmp(jstr(c, "finish_reason", NULL), "tool_calls");
            if (rn_weather_ok(args)) good++;
            else fprintf(stderr, "seed %d choice %zu: arguments %s (finish %s)\n", seed, i, args, jstr(c, "finish_reason", NULL));
        }
        json_decref(o);
    }
    CHECK(total == 6 && good == 6 && calls == 6, "sampled forced calls: %d of %d arguments valid, %d finished as tool_calls",
          good, total, calls);
    /* streamed: the argument fragments of each choice join into valid JSON */
    snprintf(body, sizeof body, "{\"model\":\"qwen3\",\"messages\":[{\"role\":\"user\",\"content\":\"Weather in Paris?\"}],"
             "\"max_tokens\":120,\"temperature\":1,\"seed\":7,\"n\":2,\"stream\":true,\"tool_choice\":\"required\"," RN_WEATHER "}");
    char *out = NULL;
    st = http(e->prouter, "POST", "/v1/chat/completions", body, &out);
    char args[2][2048] = {"", ""}, finish[2][16] = {"", ""};
    for (char *save = NULL, *l = strtok_r(out ? out : (char *)"", "\n", &save); l; l = strtok_r(NULL, "\n", &save)) {
        json_t *o = strncmp(l, "data: {", 7) ? NULL : json_loads(l + 6, 0, NULL);
        json_t *c = json_array_get(json_object_get(o, "choices"), 0);
        long long i = jint(c, "index", NULL);
        json_t *tc = json_array_get(json_object_get(json_object_get(c, "delta"), "tool_calls"), 0);
        if (c && i >= 0 && i < 2) {
            const char *a = jstr(json_object_get(tc, "function"), "arguments", NULL);
            strncat(args[i], a, sizeof args[i] - strlen(args[i]) - 1);
            if (json_is_string(json_object_get(c, "finish_reason")))
                snprintf(finish[i], sizeof finish[i], "%s", jstr(c, "finish_reason", NULL));
        }
        json_decref(o);
    }
    free(out);
    CHECK(st == 200 && rn_weather_ok(args[0]) && rn_weather_ok(args[1]) && !strcmp(finish[0], "tool_calls") &&
          !strcmp(finish[1], "tool_calls"), "streamed forced calls: '%s' (%s) '%s' (%s)", args[0], finish[0], args[1], finish[1]);
}

/* ==== The Python openai client ==== */

static void test_py_client(rn_env *e) {
    if (!py_clients_ready("test_router_n")) return;
    char url[64];
    snprintf(url, sizeof url, "http://127.0.0.1:%d/v1", e->prouter);
    char *args[] = {"n", "--base", url, "--completion-model", "stories", "--chat-model", "qwen3", NULL};
    double split0 = metric_value(e->prouter, "tandem_router_prefill_total{mode=\"split\"} ");
    py_clients_run("test_router_n", args, 3);
    double split1 = metric_value(e->prouter, "tandem_router_prefill_total{mode=\"split\"} ");
    CHECK(split0 >= 0 && split1 >= split0 + 1, "the Python clients' stories request took the split path: %.0f -> %.0f",
          split0, split1);
}

int main(void) {
    signal(SIGPIPE, SIG_IGN);
    test_parse();
    test_tool_args_parse();
    mkdir("build", 0755);
    mkdir(RN_DIR, 0755);
    rn_env e;
    memset(&e, 0, sizeof e);
    snprintf(e.stories, sizeof e.stories, "assets/stories260K.gguf");
    snprintf(e.qwen, sizeof e.qwen, "%s/qwen3-mini-F16.gguf", t_models());
    CHECK(access(bin(), X_OK) == 0 && access(e.stories, R_OK) == 0, "%s and %s present", bin(), e.stories);
    if (access(bin(), X_OK) || access(e.stories, R_OK) || !t_need(e.qwen)) return t_done("test_router_n");
    if (rn_setup(&e) == 0) {
        test_greedy_split(&e);
        test_stop(&e);
        test_chat_local(&e);
        test_seeds(&e);
        test_limits(&e);
        test_crowded(&e);
        test_pick_slots(&e);
        test_tools(&e);
        test_tool_args(&e);
        test_py_client(&e);
    }
    if (e.router) CHECK(stop_proc(e.router, 5000) == 0, "router stops cleanly");
    if (e.qw) stop_proc(e.qw, 5000);
    if (e.dec) stop_proc(e.dec, 5000);
    if (e.pf) stop_proc(e.pf, 5000);
    return t_done("test_router_n");
}

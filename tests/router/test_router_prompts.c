/* test_router_prompts.c - /v1/completions with several prompts ("prompt":
 * ["a", "b"] or [[ids], [ids]]): one child request per prompt, run at once,
 * their choices merged into one reply.
 *   - parsing (pure functions): how many prompts, each prompt checked on its
 *     own (the faulty one named as prompt[k]), prompts x n bounded, echo
 *     only with text prompts, a child request per prompt
 *   - real processes: a prefill node and two decode nodes (stories260K, the
 *     router splits every prompt) behind one router
 *   - greedy: prompt k's choices are the one-prompt outputs, numbered k * n
 *     + i, streamed and not; usage sums the prompts; token-id prompts; echo
 *   - one prompt the node refuses (longer than its context): the whole
 *     request is that 400, streamed too, and the router serves on
 *   - a client that leaves a streamed batch: every prompt is cancelled on
 *     its decode node
 *   - the Python `openai` client with a list of prompts. */
#include "proc.h"

#include <jansson.h>

#include "api/http_api.h"

#define RP_DIR "build/test_router_prompts.d"

typedef struct {
    pid_t pf, dec[2], router;
    int ppf, pdec[2], prouter;
} rp_env;

/* ==== Helpers ==== */

static json_t *rp_post(int port, const char *body, int *status) {
    char *out = NULL;
    *status = http(port, "POST", "/v1/completions", body, &out);
    json_t *o = out ? json_loads(out, 0, NULL) : NULL;
    free(out);
    return o;
}

/* choices[i]: its text, or "" */
static const char *rp_text(json_t *o, int i) {
    json_t *c = json_array_get(json_object_get(o, "choices"), (size_t)i);
    return json_is_string(json_object_get(c, "text")) ? json_string_value(json_object_get(c, "text")) : "";
}

/* The choice whose "index" is i (the reply lists them in order). */
static long long rp_index(json_t *o, int i) {
    return jint(json_array_get(json_object_get(o, "choices"), (size_t)i), "index", NULL);
}

/* The decode nodes have a secret: /v1/stats wants the decode-API
 * signature, as the router's calls carry it. */
static node_auth_key rp_key;

static long long rp_stat(int port, const char *key) {
    char *out = NULL;
    http_req q = { .method = "GET", .path = "/v1/stats", .sign = &rp_key };
    int st = http_request(port, &q, &out);
    json_t *o = st == 200 ? json_loads(out, 0, NULL) : NULL;
    free(out);
    long long v = jint(o, key, NULL);
    json_decref(o);
    return v;
}

static long long rp_stat2(const rp_env *e, const char *key) { return rp_stat(e->pdec[0], key) + rp_stat(e->pdec[1], key); }

static int rp_setup(rp_env *e) {
    char b[512], pp[64], dp[2][64], pfp[64];
    snprintf(b, sizeof b, "%s", bin());
    FILE *f = fopen(RP_DIR "/secret", "w");
    if (!f) return -1;
    fputs("router-prompts-test-secret-5f0c2a9e7b1d4c3a8e6f9b2d1c0a7e5f\n", f);
    node_auth_derive(&rp_key, "router-prompts-test-secret-5f0c2a9e7b1d4c3a8e6f9b2d1c0a7e5f", strlen("router-prompts-test-secret-5f0c2a9e7b1d4c3a8e6f9b2d1c0a7e5f"), NODE_AUTH_LABEL_DECODE_API);
    fclose(f);
    char *pf[] = {b, "serve", "--role", "prefill", "-m", "assets/stories260K.gguf", "-t", "1", "--secret-file",
                  RP_DIR "/secret", "--listen", "127.0.0.1:0", "--port-file", RP_DIR "/pf.port", NULL};
    if ((e->ppf = start_named(&e->pf, pf, RP_DIR, "pf", 1, 60000)) <= 0) return -1;
    snprintf(pp, sizeof pp, "127.0.0.1:%d", e->ppf);
    for (int i = 0; i < 2; i++) {
        char name[8], portf[64];
        snprintf(name, sizeof name, "dec%d", i);
        snprintf(portf, sizeof portf, RP_DIR "/dec%d.port", i);
        char *dec[] = {b, "serve", "--role", "decode", "-m", "assets/stories260K.gguf", "-t", "1", "--secret-file",
                       RP_DIR "/secret", "--parallel", "2", "--listen", "127.0.0.1:0", "--prefill-node", pp,
                       "--port-file", portf, NULL};
        if ((e->pdec[i] = start_named(&e->dec[i], dec, RP_DIR, name, 1, 60000)) <= 0) return -1;
        snprintf(dp[i], sizeof dp[i], "stories=127.0.0.1:%d", e->pdec[i]);
    }
    snprintf(pfp, sizeof pfp, "stories=127.0.0.1:%d", e->ppf);
    char *r[] = {b, "serve", "--role", "router", "--listen", "127.0.0.1:0", "--secret-file", RP_DIR "/secret",
                 "--decode", dp[0], "--decode", dp[1], "--prefill", pfp, "--split", "always",
                 "--health-interval-ms", "300", "--port-file", RP_DIR "/router.port", NULL};
    if ((e->prouter = start_named(&e->router, r, RP_DIR, "router", 1, 60000)) <= 0) return -1;
    double t0 = now_ms();
    int ok = 0;
    while (!ok && now_ms() - t0 < 15000) {
        int st;
        json_t *o = rp_post(e->prouter, "{\"model\":\"stories\",\"prompt\":\"a\",\"max_tokens\":1}", &st);
        json_decref(o);
        ok = st == 200;
        if (!ok) sleep_ms(100);
    }
    CHECK(ok, "the router serves stories");
    return ok ? 0 : -1;
}

/* ==== Parsing ==== */

static int rp_parse(const char *body, api_request *r, api_error *e) {
    api_limits lim;
    api_limits_default(&lim);
    return api_parse_request(API_COMPLETION, body, strlen(body), &lim, r, e);
}

static void test_parse(void) {
    api_limits lim;
    api_limits_default(&lim);
    api_request r, c;
    api_error e;
    const char *b = "{\"model\":\"m\",\"prompt\":[\"one\",\"two\",\"three\"],\"max_tokens\":3,\"n\":2,\"temperature\":0.7}";
    CHECK(rp_parse(b, &r, &e) == 0 && r.n_prompts == 3 && !r.prompt && !r.tokens && r.n == 2, "three prompts");
    api_request_free(&r);
    static const char *const want[] = {"one", "two", "three"};
    api_request kids[4];
    int rc = api_parse_prompt_children(API_COMPLETION, b, strlen(b), &lim, 3, kids, &e);
    CHECK(rc == 0, "three children: %s", rc ? e.message : "ok");
    for (int k = 0; k < 3 && rc == 0; k++) {
        c = kids[k];
        CHECK(c.n_prompts == 1 && c.prompt && !strcmp(c.prompt, want[k]) && c.n == 2 && c.max_tokens == 3 &&
              c.temperature == 0.7, "child %d: its prompt '%s', the other fields the parent's", k, c.prompt);
        api_request_free(&c);
    }
    CHECK(api_parse_prompt_children(API_COMPLETION, b, strlen(b), &lim, 4, kids, &e) == -1 && e.status == 500,
          "no child past the last prompt");
    b = "{\"model\":\"m\",\"prompt\":[[1,2,3],[4,5]]}";
    CHECK(rp_parse(b, &r, &e) == 0 && r.n_prompts == 2 && r.prompts_have_ids, "two token-id prompts");
    api_request_free(&r);
    rc = api_parse_prompt_children(API_COMPLETION, b, strlen(b), &lim, 2, kids, &e);
    CHECK(rc == 0 && kids[1].n_tokens == 2 && kids[1].tokens[0] == 4 && kids[1].tokens[1] == 5, "child 1: ids 4 5");
    if (rc == 0) { api_request_free(&kids[0]); api_request_free(&kids[1]); }
    /* one prompt in a list is a plain request, as before */
    b = "{\"model\":\"m\",\"prompt\":[\"solo\"]}";
    CHECK(rp_parse(b, &r, &e) == 0 && r.n_prompts == 1 && r.prompt && !strcmp(r.prompt, "solo"), "[\"solo\"]: one prompt");
    api_request_free(&r);

    /* faults */
    struct { const char *body, *param, *says; } bad[] = {
        {"{\"model\":\"m\",\"prompt\":[\"ok\",\"\"]}", "prompt[1]", "empty"},
        {"{\"model\":\"m\",\"prompt\":[\"ok\",5]}", "prompt", "array of strings"},
        {"{\"model\":\"m\",\"prompt\":[[1,2],[-3]]}", "prompt[1]", "out of range"},
        {"{\"model\":\"m\",\"prompt\":[[1,2],[]]}", "prompt[1]", "empty"},
        {"{\"model\":\"m\",\"prompt\":[\"a\",[1]],\"echo\":true}", "echo", "text prompt"},
        {"{\"model\":\"m\",\"prompt\":[\"a\",\"b\",\"c\",\"d\",\"e\"],\"n\":8}", "n", "at most 32"},
    };
    for (size_t i = 0; i < sizeof bad / sizeof bad[0]; i++) {
        int rc = rp_parse(bad[i].body, &r, &e);
        CHECK(rc == -1 && e.status == 400 && !strcmp(e.param, bad[i].param) && strstr(e.message, bad[i].says),
              "%s: 400 on %s (%s: %s)", bad[i].body, bad[i].param, e.param, rc ? e.message : "accepted");
        if (rc == 0) api_request_free(&r);
    }
    char many[512] = "{\"model\":\"m\",\"prompt\":[";
    for (int i = 0; i <= API_MAX_PROMPTS; i++) strcat(many, i ? ",\"p\"" : "\"p\"");
    strcat(many, "]}");
    CHECK(rp_parse(many, &r, &e) == -1 && !strcmp(e.param, "prompt") && strstr(e.message, "at most 16"),
          "17 prompts: %s", e.message);
    /* chat has no prompt list */
    b = "{\"model\":\"m\",\"messages\":[{\"role\":\"user\",\"content\":\"x\"}]}";
    CHECK(api_parse_request(API_CHAT, b, strlen(b), &lim, &r, &e) == 0 && r.n_prompts == 0, "chat: no prompts");
    api_request_free(&r);
}

/* ==== Greedy: each prompt's choices are its one-prompt output ==== */

static const char *const rp_prompts[3] = {"Once upon a time", "The little dog", "Lily saw a big tree"};

static void test_greedy(rp_env *e) {
    char single[3][512], body[800];
    int st, ptok[3], psum = 0;
    for (int k = 0; k < 3; k++) {
        snprintf(body, sizeof body, "{\"model\":\"stories\",\"prompt\":\"%s\",\"max_tokens\":8,\"temperature\":0}", rp_prompts[k]);
        json_t *o = rp_post(e->prouter, body, &st);
        snprintf(single[k], sizeof single[k], "%s", rp_text(o, 0));
        ptok[k] = (int)jint(o, "usage", "prompt_tokens");
        psum += ptok[k];
        CHECK(st == 200 && *single[k] && ptok[k] > 1, "prompt %d alone: %d '%s'", k, st, single[k]);
        json_decref(o);
    }
    long long ok0 = rp_stat2(e, "requests_ok");
    snprintf(body, sizeof body, "{\"model\":\"stories\",\"prompt\":[\"%s\",\"%s\",\"%s\"],\"max_tokens\":8,\"temperature\":0}",
             rp_prompts[0], rp_prompts[1], rp_prompts[2]);
    json_t *o = rp_post(e->prouter, body, &st);
    json_t *ch = json_object_get(o, "choices");
    CHECK(st == 200 && json_array_size(ch) == 3, "three prompts: %d, %zu choices", st, json_array_size(ch));
    for (int k = 0; k < 3; k++)
        CHECK(rp_index(o, k) == k && !strcmp(rp_text(o, k), single[k]) &&
              !strcmp(jstr(json_array_get(ch, (size_t)k), "finish_reason", NULL), "length"),
              "choice %d: prompt %d's output '%s' (alone '%s')", k, k, rp_text(o, k), single[k]);
    CHECK(jint(o, "usage", "prompt_tokens") == psum && jint(o, "usage", "completion_tokens") == 24 &&
          jint(o, "usage", "total_tokens") == psum + 24, "usage sums the prompts: %lld + %lld (want %d + 24)",
          jint(o, "usage", "prompt_tokens"), jint(o, "usage", "completion_tokens"), psum);
    CHECK(!strncmp(jstr(o, "id", NULL), "cmpl-", 5), "one id: %s", jstr(o, "id", NULL));
    json_decref(o);
    /* each prompt was a request of its own on a decode node */
    double t0 = now_ms();
    while (rp_stat2(e, "requests_ok") < ok0 + 3 && now_ms() - t0 < 5000) sleep_ms(20);
    CHECK(rp_stat2(e, "requests_ok") == ok0 + 3, "the decode nodes served 3 requests (%lld)", rp_stat2(e, "requests_ok") - ok0);
    /* the router logs one line per prompt, each naming its place in the list */
    char *log = read_text(RP_DIR "/router.log");
    CHECK(log && strstr(log, " prompt_index=0 ") && strstr(log, " prompt_index=2 "), "a log line per prompt, with its index");
    free(log);

    /* n 2: prompt k's choices are k * 2 and k * 2 + 1 */
    snprintf(body, sizeof body, "{\"model\":\"stories\",\"prompt\":[\"%s\",\"%s\"],\"max_tokens\":8,\"temperature\":0,\"n\":2}",
             rp_prompts[0], rp_prompts[1]);
    o = rp_post(e->prouter, body, &st);
    CHECK(st == 200 && json_array_size(json_object_get(o, "choices")) == 4, "two prompts n 2: four choices");
    for (int i = 0; i < 4; i++)
        CHECK(rp_index(o, i) == i && !strcmp(rp_text(o, i), single[i / 2]), "choice %d is prompt %d's: '%s'", i, i / 2,
              rp_text(o, i));
    CHECK(jint(o, "usage", "prompt_tokens") == ptok[0] + ptok[1] && jint(o, "usage", "completion_tokens") == 32,
          "usage: each prompt once, every completion");
    json_decref(o);

    /* streamed, with the usage chunk */
    snprintf(body, sizeof body, "{\"model\":\"stories\",\"prompt\":[\"%s\",\"%s\",\"%s\"],\"max_tokens\":8,\"temperature\":0,"
             "\"stream\":true,\"stream_options\":{\"include_usage\":true}}", rp_prompts[0], rp_prompts[1], rp_prompts[2]);
    char *out = NULL;
    st = http(e->prouter, "POST", "/v1/completions", body, &out);
    sse_choices s;
    sse_gather(out ? out : (char *)"", 0, 8, &s);
    free(out);
    CHECK(st == 200 && s.done == 1 && !s.errors && !s.bad_index, "streamed: %d, done %d, errors %d", st, s.done, s.errors);
    for (int k = 0; k < 3; k++)
        CHECK(!strcmp(s.text[k], single[k]) && !strcmp(s.finish[k], "length"), "streamed choice %d: '%s' (%s)", k, s.text[k],
              s.finish[k]);
    CHECK(s.usage_prompt == psum && s.usage_completion == 24, "streamed usage %d %d", s.usage_prompt, s.usage_completion);

    /* streamed without the usage chunk: where each prompt was prefilled,
     * one final SSE comment per prompt (in prompt order), then [DONE] */
    snprintf(body, sizeof body, "{\"model\":\"stories\",\"prompt\":[\"%s\",\"%s\",\"%s\"],\"max_tokens\":4,\"temperature\":0,"
             "\"stream\":true}", rp_prompts[0], rp_prompts[1], rp_prompts[2]);
    out = NULL;
    st = http(e->prouter, "POST", "/v1/completions", body, &out);
    const char *done = out ? strstr(out, "data: [DONE]") : NULL, *last = out;
    int comments = 0;
    for (int k = 0; k < 3 && last; k++) {   /* prefill= split or cached (--split always; prompts seen before) */
        const char *at = strstr(last, "\n: tandem prefill=");
        char want[32], line[300] = "";
        snprintf(want, sizeof want, " prompt_index=%d plan=split ", k);
        if (at) snprintf(line, sizeof line, "%.*s", (int)strcspn(at + 1, "\n"), at + 1);
        comments += at && done && at < done && strstr(line, want);
        if (k == 0) printf("test_router_prompts: %s\n", line);
        last = at ? at + 1 : NULL;
    }
    CHECK(st == 200 && done && comments == 3, "a streamed prompt array ends with a prefill comment per prompt, in order, "
          "before [DONE] (%d of 3)", comments);
    free(out);

    /* echo: each choice starts with its own prompt */
    snprintf(body, sizeof body, "{\"model\":\"stories\",\"prompt\":[\"%s\",\"%s\"],\"max_tokens\":4,\"temperature\":0,"
             "\"echo\":true}", rp_prompts[0], rp_prompts[1]);
    o = rp_post(e->prouter, body, &st);
    CHECK(st == 200 && !strncmp(rp_text(o, 0), rp_prompts[0], strlen(rp_prompts[0])) &&
          !strncmp(rp_text(o, 1), rp_prompts[1], strlen(rp_prompts[1])), "echo per prompt: '%s' '%s'", rp_text(o, 0),
          rp_text(o, 1));
    json_decref(o);
}

static void test_token_ids(rp_env *e) {
    static const char *const ids[2] = {"[1,403,300,275]", "[1,260,330]"};
    char single[2][512], body[400];
    int st;
    for (int k = 0; k < 2; k++) {
        snprintf(body, sizeof body, "{\"model\":\"stories\",\"prompt\":%s,\"max_tokens\":6,\"temperature\":0}", ids[k]);
        json_t *o = rp_post(e->prouter, body, &st);
        snprintf(single[k], sizeof single[k], "%s", rp_text(o, 0));
        CHECK(st == 200 && *single[k], "ids %s alone: %d", ids[k], st);
        json_decref(o);
    }
    snprintf(body, sizeof body, "{\"model\":\"stories\",\"prompt\":[%s,%s],\"max_tokens\":6,\"temperature\":0}", ids[0], ids[1]);
    json_t *o = rp_post(e->prouter, body, &st);
    CHECK(st == 200 && !strcmp(rp_text(o, 0), single[0]) && !strcmp(rp_text(o, 1), single[1]) &&
          jint(o, "usage", "prompt_tokens") == 7, "two token-id prompts: '%s' '%s', %lld prompt tokens", rp_text(o, 0),
          rp_text(o, 1), jint(o, "usage", "prompt_tokens"));
    json_decref(o);
}

/* ==== One prompt refused: the request fails, the router serves on ==== */

static void test_refused(rp_env *e) {
    /* longer than stories260K's 512-position context */
    size_t cap = 8000;
    char *longp = malloc(cap), *body = malloc(cap + 400);
    if (!longp || !body) { free(longp); free(body); CHECK(0, "memory"); return; }
    longp[0] = 0;
    for (int i = 0; i < 700; i++) strcat(longp, "cat ");
    for (int stream = 0; stream < 2; stream++) {
        snprintf(body, cap + 400, "{\"model\":\"stories\",\"prompt\":[\"%s\",\"%s\"],\"max_tokens\":200,\"stream\":%s}",
                 rp_prompts[0], longp, stream ? "true" : "false");
        char *out = NULL;
        int st = http(e->prouter, "POST", "/v1/completions", body, &out);
        json_t *o = out ? json_loads(out, 0, NULL) : NULL;
        json_t *err = json_object_get(o, "error");
        CHECK(st == 400 && strstr(jstr(err, "message", NULL), "Prompt 1") &&
              !strcmp(jstr(err, "code", NULL), "context_length_exceeded"),
              "a prompt over the context (stream %d): %d %s", stream, st, out ? out : "");
        json_decref(o);
        free(out);
    }
    free(longp);
    free(body);
    int st;
    json_t *o = rp_post(e->prouter, "{\"model\":\"stories\",\"prompt\":[\"a\",\"b\"],\"max_tokens\":2}", &st);
    CHECK(st == 200 && json_array_size(json_object_get(o, "choices")) == 2, "the router serves on: %d", st);
    json_decref(o);
}

/* ==== The client leaves a streamed batch ==== */

static void test_client_leaves(rp_env *e) {
    /* the refused arrays' other prompts may still be ending (cancelled) on
     * their decode nodes: count from when both are idle */
    double w0 = now_ms();
    while (rp_stat2(e, "requests_busy") > 0 && now_ms() - w0 < 10000) sleep_ms(50);
    long long c0 = rp_stat2(e, "requests_cancelled");
    double m0 = metric_value(e->prouter, "tandem_router_cancelled_total");
    if (m0 < 0) m0 = 0;   /* not yet in the page */
    int fd = http_connect(e->prouter);
    /* to the end of the context past end-of-generation: long enough that the
     * client is gone well before the streams end, however fast the nodes */
    const char *body = "{\"model\":\"stories\",\"prompt\":[\"Once upon a time\",\"The little dog\"],"
                       "\"ignore_eos\":true,\"stream\":true}";
    CHECK(fd >= 0 && http_send(fd, "POST", "/v1/completions", body) == 0, "streamed batch sent");
    char buf[2048];
    ssize_t got = fd >= 0 ? read(fd, buf, sizeof buf) : -1;
    CHECK(got > 0, "the stream began (%zd bytes)", got);
    if (fd >= 0) close(fd);
    double t0 = now_ms();
    while (rp_stat2(e, "requests_cancelled") < c0 + 2 && now_ms() - t0 < 10000) sleep_ms(50);
    CHECK(rp_stat2(e, "requests_cancelled") == c0 + 2, "both prompts cancelled on their decode nodes (%lld)",
          rp_stat2(e, "requests_cancelled") - c0);
    t0 = now_ms();
    while (metric_value(e->prouter, "tandem_router_cancelled_total") < m0 + 1 && now_ms() - t0 < 5000) sleep_ms(50);
    CHECK(metric_value(e->prouter, "tandem_router_cancelled_total") == m0 + 1, "the router counted one cancelled request");
}

/* ==== The Python openai client ==== */

/* tandem_router_prefill_total for one outcome; 0 before the page has it */
static double rp_served(rp_env *e, const char *mode) {
    char series[80];
    snprintf(series, sizeof series, "tandem_router_prefill_total{mode=\"%s\"} ", mode);
    double v = metric_value(e->prouter, series);
    return v < 0 ? 0 : v;
}

static void test_py_client(rp_env *e) {
    if (!py_clients_ready("test_router_prompts")) return;
    char url[64];
    snprintf(url, sizeof url, "http://127.0.0.1:%d/v1", e->prouter);
    char *args[] = {"prompts", "--base", url, "--model", "stories", NULL};
    /* --split always: a prompt is prefilled on the prefill node ("split") or,
     * when its decode node already holds the whole prompt, asks it for nothing
     * ("cached"); which of the two depends on where the earlier tests left the
     * prompts, so both count, and none may be prefilled locally. The client
     * sends 2 requests of 2 prompts each. */
    double s0 = rp_served(e, "split"), c0 = rp_served(e, "cached"), l0 = rp_served(e, "local");
    py_clients_run("test_router_prompts", args, 3);
    double s1 = rp_served(e, "split"), c1 = rp_served(e, "cached"), l1 = rp_served(e, "local");
    CHECK(s1 - s0 + c1 - c0 >= 4 && l1 == l0,
          "the Python clients' 4 stories prompts took the split plan: split %.0f, cached %.0f, local %.0f",
          s1 - s0, c1 - c0, l1 - l0);
}

int main(void) {
    signal(SIGPIPE, SIG_IGN);
    test_parse();
    mkdir("build", 0755);
    mkdir(RP_DIR, 0755);
    rp_env e;
    memset(&e, 0, sizeof e);
    CHECK(access(bin(), X_OK) == 0 && access("assets/stories260K.gguf", R_OK) == 0, "%s and the stories model present", bin());
    if (access(bin(), X_OK) || access("assets/stories260K.gguf", R_OK)) return t_done("test_router_prompts");
    if (rp_setup(&e) == 0) {
        test_greedy(&e);
        test_token_ids(&e);
        test_refused(&e);
        test_client_leaves(&e);
        test_py_client(&e);
    }
    if (e.router) CHECK(stop_proc(e.router, 5000) == 0, "router stops cleanly");
    for (int i = 0; i < 2; i++)
        if (e.dec[i]) stop_proc(e.dec[i], 5000);
    if (e.pf) stop_proc(e.pf, 5000);
    return t_done("test_router_prompts");
}

/* test_decode_node.c - the decode node as real processes on loopback.
 *
 * Starts `tandem serve --role local`, and `--role decode` beside a
 * `--role prefill` process, on port 0 with --port-file, and talks plain
 * HTTP/1.1 to them over sockets:
 *   - streamed and non-streamed generations equal `tandem run --ids`;
 *   - malformed JSON, wrong types, bad values, an overlong prompt -> 400;
 *   - a split request: mode remote, computed_local 1, positions_received n-1;
 *   - prefix reuse: a request extending the previous one receives only the
 *     new span (positions_received = new tokens - 1) and still matches;
 *   - busy: with --queue 1, one running + one waiting -> the third gets 503;
 *   - a client that disconnects mid-stream stops its generation and the
 *     server keeps serving;
 *   - kill -9 of the prefill node -> the next request succeeds locally with
 *     a fallback_reason;
 *   - SIGTERM -> exit status 0 (under ASan that includes no leaks).
 * Uses the generated qwen3-mini-F16 model and its golden prompts: their
 * comparisons are self-consistency (the node against `tandem run`, both
 * tandem, exact equality on F16), not fidelity (test_golden is that), and
 * their messages say so.
 */
#include "proc.h"

/* ==== Fixtures ==== */

typedef struct { char *prompt; int32_t ids[2048]; int n; } golden;

static int load_goldens(golden *g, int cap) {
    char path[1024];
    snprintf(path, sizeof path, "%s/golden/visible/qwen3-mini-F16.jsonl", t_fixtures());
    FILE *f = fopen(path, "r");
    if (!f) return 0;
    char *line = NULL;
    size_t lc = 0;
    int n = 0;
    while (n < cap && getline(&line, &lc, f) > 0) {
        json_t *o = json_loads(line, 0, NULL);
        json_t *ids = json_object_get(o, "prompt_ids");
        if (json_is_array(ids) && json_array_size(ids) <= 2048) {
            g[n].prompt = strdup(jstr(o, "prompt", NULL));
            g[n].n = (int)json_array_size(ids);
            for (int i = 0; i < g[n].n; i++) g[n].ids[i] = (int32_t)json_integer_value(json_array_get(ids, (size_t)i));
            n++;
        }
        json_decref(o);
    }
    free(line);
    fclose(f);
    return n;
}

/* ==== Tests ==== */

typedef struct {
    const char *model;
    golden *g;
    int n_g, n_pred;
    int32_t ref[8][64];          /* tandem run --ids for goldens 0..7 */
    int n_ref[8];
    char *ext_prompt;            /* golden 2's prompt extended by a sentence */
    int32_t ext_ref[64];
    int n_ext_ref;
    int32_t chat_ref[64];        /* tandem run --chat on golden 0 */
    int n_chat_ref;
} ctx;

static void test_bad_requests(int port) {
    const char *bad[] = {
        "{bad json", "[1,2,3]", "{\"prompt\": 5}", "{\"tokens\": [1, \"a\"]}", "{\"tokens\": []}",
        "{\"prompt\": \"hi\", \"max_tokens\": \"x\"}", "{\"prompt\": \"hi\", \"stream\": 1}",
        "{\"prompt\": \"hi\", \"temperature\": -1}", "{\"prompt\": \"hi\", \"tokens\": [1]}", "{}",
        "{\"prompt\": \"hi\", \"prefill\": \"sideways\"}", "{\"tokens\": [99999999]}",
        "{\"prompt\": \"hi\", \"stop\": [1]}", "", "{\"messages\": []}", "{\"messages\": [{\"role\": \"user\"}]}",
        "{\"messages\": [{\"role\": \"user\", \"content\": \"x\"}], \"prompt\": \"x\"}",
    };
    for (size_t i = 0; i < sizeof bad / sizeof bad[0]; i++) {
        char *body = NULL;
        int st = http(port, "POST", "/v1/generate", bad[i], &body);
        json_t *o = body ? json_loads(body, 0, NULL) : NULL;
        CHECK(st == 400, "'%s' -> status %d, want 400", bad[i], st);
        CHECK(*jstr(o, "error", "message") && !strcmp(jstr(o, "error", "type"), "invalid_request_error"),
              "'%s' -> body %s", bad[i], body ? body : "(none)");
        json_decref(o);
        free(body);
    }
    /* longer than the context (the servers run with -c 2048) */
    int32_t *many = calloc(3000, sizeof(int32_t));
    for (int i = 0; i < 3000; i++) many[i] = 1000 + i;
    int st;
    json_t *o = post_json(port, gen_req(many, 3000, 4, 0, NULL), &st);
    CHECK(st == 400 && strstr(jstr(o, "error", "message"), "context"), "overlong prompt -> %d", st);
    json_decref(o);
    free(many);
    char *body = NULL;
    st = http(port, "GET", "/nope", NULL, &body);
    CHECK(st == 404, "unknown path -> %d", st);
    free(body);
}

/* Golden prompts as text, streamed and not, equal tandem run. */
static void test_local_equal(ctx *c, int port) {
    int which[] = { 0, 3, 6 };
    printf("decode_node: self-consistency (node vs tandem run, exact on F16; not a fidelity check): %d golden prompts\n",
           asan() ? 2 : 3);
    for (int k = 0; k < (asan() ? 2 : 3); k++) {
        int gi = which[k];
        if (gi >= c->n_g || c->n_ref[gi] <= 0) continue;
        for (int stream = 0; stream < 2; stream++) {
            json_t *r = json_object();
            json_object_set_new(r, "prompt", json_string(c->g[gi].prompt));
            json_object_set_new(r, "max_tokens", json_integer(c->n_pred));
            json_object_set_new(r, "ignore_eos", json_true());
            json_object_set_new(r, "stream", json_boolean(stream));
            char *s = json_dumps(r, JSON_COMPACT), *body = NULL;
            json_decref(r);
            int st = http(port, "POST", "/v1/generate", s, &body);
            free(s);
            CHECK(st == 200, "self-consistency golden %d stream %d: status %d", gi, stream, st);
            int32_t ids[256];
            int n = 0;
            json_t *fin = NULL;
            if (stream && body) {
                fin = parse_stream(body, ids, 256, &n);
            } else if (body) {
                fin = json_loads(body, 0, NULL);
                json_t *a = json_object_get(fin, "tokens");
                for (size_t i = 0; i < json_array_size(a) && n < 256; i++) ids[n++] = (int32_t)json_integer_value(json_array_get(a, i));
            }
            int same = n == c->n_ref[gi] && !memcmp(ids, c->ref[gi], sizeof(int32_t) * (size_t)n);
            CHECK(same, "self-consistency golden %d stream %d: %d tokens differ from tandem run (%d)", gi, stream, n, c->n_ref[gi]);
            CHECK(fin && !strcmp(jstr(fin, "finish_reason", NULL), "length"), "self-consistency golden %d: finish_reason", gi);
            CHECK(jint(fin, "usage", "prompt_tokens") == c->g[gi].n, "self-consistency golden %d: prompt_tokens %lld want %d", gi,
                  jint(fin, "usage", "prompt_tokens"), c->g[gi].n);
            CHECK(!strcmp(jstr(fin, "prefill", "mode"), "local"), "self-consistency golden %d: local mode", gi);
            json_decref(fin);
            free(body);
        }
    }
}

/* A stop string ends generation and is cut from the text. */
static void test_stop(ctx *c, int port) {
    json_t *r = gen_req(c->g[0].ids, c->g[0].n, 6, 1, NULL);
    char *s = json_dumps(r, JSON_COMPACT), *body = NULL;
    json_decref(r);
    int st = http(port, "POST", "/v1/generate", s, &body);
    free(s);
    char full[4096] = "", third[512] = "";
    for (char *save = NULL, *l = body ? strtok_r(body, "\n", &save) : NULL; l; l = strtok_r(NULL, "\n", &save)) {
        json_t *o = json_loads(l, 0, NULL);
        const char *t = jstr(o, "text", NULL);
        if (json_is_integer(json_object_get(o, "token"))) {
            size_t fl = strlen(full);
            snprintf(full + fl, sizeof full - fl, "%s", t);
        }
        json_decref(o);
    }
    free(body);
    /* the stop string: the text from byte 2 of the generation, 3 bytes long */
    size_t fl = strlen(full);
    CHECK(st == 200 && fl >= 6, "stream for the stop test: %d, text '%s'", st, full);
    if (fl < 6) return;
    memcpy(third, full + 2, 3);
    third[3] = 0;
    r = gen_req(c->g[0].ids, c->g[0].n, 6, 0, NULL);
    json_t *stop = json_array();
    json_array_append_new(stop, json_string(third));
    json_object_set_new(r, "stop", stop);
    json_t *o = post_json(port, r, &st);
    const char *text = jstr(o, "text", NULL);
    CHECK(st == 200 && !strcmp(jstr(o, "finish_reason", NULL), "stop"), "stop '%s': finish %s", third, jstr(o, "finish_reason", NULL));
    CHECK(!strstr(text, third) && !strncmp(text, full, strlen(text)) && strlen(text) <= 2,
          "stop '%s': text '%s' of '%s'", third, text, full);
    json_decref(o);
}

/* "chat": true and "messages" use the model's template like `tandem run --chat`. */
static void test_chat(ctx *c, int port) {
    for (int form = 0; form < 2; form++) {
        json_t *r = json_object();
        if (form == 0) {
            json_object_set_new(r, "prompt", json_string(c->g[0].prompt));
            json_object_set_new(r, "chat", json_true());
        } else {
            json_t *m = json_object();
            json_object_set_new(m, "role", json_string("user"));
            json_object_set_new(m, "content", json_string(c->g[0].prompt));
            json_t *a = json_array();
            json_array_append_new(a, m);
            json_object_set_new(r, "messages", a);
        }
        json_object_set_new(r, "max_tokens", json_integer(c->n_pred));
        json_object_set_new(r, "ignore_eos", json_true());
        int st;
        json_t *o = post_json(port, r, &st);
        CHECK(st == 200 && jint(o, "usage", "prompt_tokens") > c->g[0].n, "chat form %d: status %d", form, st);
        CHECK(same_ids(json_object_get(o, "tokens"), c->chat_ref, c->n_chat_ref), "chat form %d: tokens equal tandem run --chat", form);
        json_decref(o);
    }
}

/* --queue 1: one generating, one waiting, the third is refused; the first
 * client disconnecting mid-stream frees the model for the waiting one. */
static void test_busy_and_disconnect(ctx *c, int port) {
    int32_t *ids = c->g[1].ids;
    int a = http_open_json(port, "/v1/generate", gen_req(ids, 8, 100000, 1, NULL));
    CHECK(a >= 0, "stream request A sent");
    char buf[4096];
    ssize_t got = a >= 0 ? recv(a, buf, sizeof buf - 1, 0) : -1;   /* headers + first token line(s) */
    buf[got > 0 ? got : 0] = 0;
    CHECK(got > 0 && strstr(buf, "200") && strstr(buf, "application/x-ndjson"), "A is streaming: %.200s", buf);
    int b = http_open_json(port, "/v1/generate", gen_req(ids, 8, 2, 0, NULL));
    CHECK(b >= 0, "request B sent");
    long long queued = 0;
    for (int i = 0; i < 200 && queued < 1; i++) {   /* B is parsed on its own thread */
        char *body = NULL;
        http(port, "GET", "/v1/stats", NULL, &body);
        json_t *o = body ? json_loads(body, 0, NULL) : NULL;
        queued = jint(o, "queued", NULL);
        json_decref(o);
        free(body);
        if (queued < 1) sleep_ms(25);
    }
    CHECK(queued == 1, "B waits in the queue (queued %lld)", queued);
    int st;
    json_t *o = post_json(port, gen_req(ids, 8, 2, 0, NULL), &st);
    CHECK(st == 503, "C with a full queue -> %d, want 503", st);
    json_decref(o);
    if (a >= 0) close(a);   /* A goes away mid-stream */
    char *body = NULL;
    st = b >= 0 ? http_read(b, &body) : -1;
    CHECK(st == 200, "B completes after A disconnected: %d", st);
    json_t *ob = body ? json_loads(body, 0, NULL) : NULL;
    CHECK(json_array_size(json_object_get(ob, "tokens")) == 2, "B generated 2 tokens");
    json_decref(ob);
    free(body);
    if (b >= 0) close(b);
    long long cancelled = 0;
    for (int i = 0; i < 100 && !cancelled; i++) {
        http(port, "GET", "/v1/stats", NULL, &body);
        json_t *so = body ? json_loads(body, 0, NULL) : NULL;
        cancelled = jint(so, "requests_cancelled", NULL);
        json_decref(so);
        free(body);
        if (!cancelled) sleep_ms(25);
    }
    CHECK(cancelled == 1, "A counted as cancelled (%lld)", cancelled);
    st = http(port, "GET", "/health", NULL, &body);
    CHECK(st == 200 && body && strstr(body, "\"ok\""), "healthy after the disconnect: %d", st);
    free(body);
}

static void test_local_server(ctx *c, const char *dir) {
    char pf[1100], log[1100];
    snprintf(pf, sizeof pf, "%s/local.port", dir);
    snprintf(log, sizeof log, "%s/local.log", dir);
    char *argv[] = { (char *)bin(), "serve", "--role", "local", "-m", (char *)c->model, "--listen", "127.0.0.1:0",
                     "--port-file", pf, "-t", "1", "-c", "2048", "--queue", "1", "--parallel", "1",
                     "--drain-timeout", "500", NULL };   /* SIGTERM below: the 100000-token stream is cut after 0.5 s */
    pid_t pid;
    int port = start_named(&pid, argv, dir, "local", 0, asan() ? 60000 : 20000);
    if (port <= 0) { stop_proc(pid, 1000); return; }
    char *body = NULL;
    int st = http(port, "GET", "/health", NULL, &body);
    CHECK(st == 200 && body && strstr(body, "\"role\":\"local\""), "health: %s", body ? body : "");
    free(body);
    test_bad_requests(port);
    test_local_equal(c, port);
    test_chat(c, port);
    test_stop(c, port);
    test_busy_and_disconnect(c, port);
    /* SIGTERM while a stream is generating: the stream ends, the server exits cleanly */
    int fd = http_open_json(port, "/v1/generate", gen_req(c->g[1].ids, 8, 100000, 1, NULL));
    CHECK(fd >= 0, "long stream sent");
    char buf[1024];
    CHECK(fd >= 0 && recv(fd, buf, sizeof buf, 0) > 0, "long stream started");
    CHECK(stop_proc(pid, 20000) == 0, "local server exits cleanly on SIGTERM mid-stream (log %s)", log);
    if (fd >= 0) close(fd);
}

/* Split prefill, prefix reuse, and the prefill node dying. */
static void test_split(ctx *c, const char *dir) {
    char ppf[1100], dpf[1100], dlog[1100], sec[1100];
    snprintf(ppf, sizeof ppf, "%s/prefill.port", dir);
    snprintf(dpf, sizeof dpf, "%s/decode.port", dir);
    snprintf(dlog, sizeof dlog, "%s/decode.log", dir);
    snprintf(sec, sizeof sec, "%s/secret", dir);
    write_text(sec, "test-secret-0123456789-5f0c2a9e7b1d4c3a8e6f9b2d1c0a7e5f\n");
    char *pargv[] = { (char *)bin(), "serve", "--role", "prefill", "-m", (char *)c->model, "--listen", "127.0.0.1:0",
                      "--port-file", ppf, "--secret-file", sec, "-t", "1", "-c", "2048", NULL };
    pid_t ppid;
    int pport = start_named(&ppid, pargv, dir, "prefill", 0, asan() ? 60000 : 20000);
    if (pport <= 0) { stop_proc(ppid, 1000); return; }
    char node[64];
    snprintf(node, sizeof node, "127.0.0.1:%d", pport);
    char *dargv[] = { (char *)bin(), "serve", "--role", "decode", "-m", (char *)c->model, "--listen", "127.0.0.1:0",
                      "--port-file", dpf, "--secret-file", sec, "--prefill-node", node, "-t", "1", "-c", "2048",
                      "--min-split-tokens", "8", "--timeout-ms", "3000", NULL };
    pid_t dpid;
    int port = start_named(&dpid, dargv, dir, "decode", 0, asan() ? 60000 : 20000);
    if (port <= 0) { stop_proc(dpid, 1000); stop_proc(ppid, 1000); return; }
    /* the node has a secret: anonymous requests are refused, signed ones served */
    int st0;
    json_t *a = post_json(port, gen_req(c->g[0].ids, c->g[0].n, 2, 0, "local"), &st0);
    CHECK(st0 == 401, "anonymous request to a node with a secret: %d", st0);
    json_decref(a);
    static node_auth_key key;
    node_auth_derive(&key, "test-secret-0123456789-5f0c2a9e7b1d4c3a8e6f9b2d1c0a7e5f", 55, NODE_AUTH_LABEL_DECODE_API);
    sign_key = &key;

    /* split generations equal tandem run, the decode node computing one position */
    int which[] = { 1, 5, 7 };
    for (int k = 0; k < (asan() ? 2 : 3); k++) {
        int gi = which[k], st;
        if (gi >= c->n_g || c->n_ref[gi] <= 0) continue;
        json_t *o = post_json(port, gen_req(c->g[gi].ids, c->g[gi].n, c->n_pred, 0, "auto"), &st);
        CHECK(st == 200, "self-consistency split golden %d: status %d", gi, st);
        CHECK(!strcmp(jstr(o, "prefill", "mode"), "remote"), "self-consistency split golden %d: mode %s (%s)", gi,
              jstr(o, "prefill", "mode"), jstr(o, "prefill", "fallback_reason"));
        CHECK(jint(o, "prefill", "computed_local") == 1, "self-consistency split golden %d: computed_local %lld", gi,
              jint(o, "prefill", "computed_local"));
        long long start = jint(o, "prefill", "start_pos");
        CHECK(jint(o, "prefill", "positions_received") == c->g[gi].n - 1 - start,
              "self-consistency split golden %d: positions_received %lld, n %d, start %lld", gi,
              jint(o, "prefill", "positions_received"), c->g[gi].n, start);
        CHECK(jint(o, "prefill", "wire_bytes") >= jint(o, "prefill", "kv_bytes") && jint(o, "prefill", "kv_bytes") > 0,
              "self-consistency split golden %d: bytes reported", gi);
        CHECK(same_ids(json_object_get(o, "tokens"), c->ref[gi], c->n_ref[gi]),
              "self-consistency split golden %d: tokens differ from tandem run", gi);
        json_decref(o);
    }
    /* prefix reuse: golden 2's text, then the same text extended */
    int st;
    json_t *o = post_json(port, gen_req(c->g[2].ids, c->g[2].n, 4, 0, "remote"), &st);
    CHECK(st == 200 && jint(o, "prefill", "start_pos") == 0 && jint(o, "prefill", "positions_received") == c->g[2].n - 1,
          "first request: start %lld received %lld", jint(o, "prefill", "start_pos"), jint(o, "prefill", "positions_received"));
    json_decref(o);
    json_t *r = json_object();
    json_object_set_new(r, "prompt", json_string(c->ext_prompt));
    json_object_set_new(r, "max_tokens", json_integer(c->n_pred));
    json_object_set_new(r, "ignore_eos", json_true());
    json_object_set_new(r, "prefill", json_string("remote"));
    o = post_json(port, r, &st);
    long long n2 = jint(o, "usage", "prompt_tokens");
    CHECK(st == 200 && !strcmp(jstr(o, "prefill", "mode"), "remote"), "extension: status %d mode %s", st, jstr(o, "prefill", "mode"));
    CHECK(jint(o, "prefill", "start_pos") == c->g[2].n, "extension reuses %lld positions, want %d",
          jint(o, "prefill", "start_pos"), c->g[2].n);
    CHECK(n2 > c->g[2].n + 1 && jint(o, "prefill", "positions_received") == n2 - c->g[2].n - 1,
          "extension received %lld positions for %lld new tokens", jint(o, "prefill", "positions_received"), n2 - c->g[2].n);
    CHECK(same_ids(json_object_get(o, "tokens"), c->ext_ref, c->n_ext_ref), "extension: tokens equal tandem run");
    json_decref(o);

    /* many requests in a row: no growth in open files or memory. A first
     * round touches the slots' KV pages (2 MiB at a time where the cache has
     * huge pages), so memory is compared over a second round of the same
     * shapes (other tokens: computed again, not reused from the cache). */
    int fd0 = 0;
    long rss0 = 0;
    for (int round = 0; round < 2; round++) {
        if (round == 1) { fd0 = settled_fds(dpid); rss0 = rss_kb(dpid); }
        for (int i = 0; i < (asan() ? 6 : 12); i++) {
            int32_t ids[24];
            for (int k = 0; k < 24; k++) ids[k] = c->g[i % 8].ids[k % c->g[i % 8].n] + i + 13 * round;
            o = post_json(port, gen_req(ids, 24, 2, i & 1, i % 3 ? "remote" : "local"), &st);
            CHECK(st == 200, "request %d in a row (round %d): %d", i, round, st);
            json_decref(o);
        }
    }
    int fd1 = settled_fds(dpid);
    long rss1 = rss_kb(dpid);
    CHECK(fd0 > 0 && fd1 > 0 && fd1 <= fd0, "open files %d -> %d", fd0, fd1);
    CHECK(asan() || rss1 - rss0 < 8192, "RSS %ld kB -> %ld kB", rss0, rss1);

    /* the prefill node stalls (SIGSTOP): the request falls back after the timeout */
    kill(ppid, SIGSTOP);
    int gi = 0;
    double t0 = now_ms();
    o = post_json(port, gen_req(c->g[gi].ids, c->g[gi].n, c->n_pred, 0, "remote"), &st);
    CHECK(st == 200 && !strcmp(jstr(o, "prefill", "mode"), "local") && *jstr(o, "prefill", "fallback_reason"),
          "stalled node: status %d mode %s, fallback '%s'", st, jstr(o, "prefill", "mode"), jstr(o, "prefill", "fallback_reason"));
    CHECK(now_ms() - t0 < 3000 * 3 + (asan() ? 20000 : 5000), "stalled node: fell back in %.0f ms", now_ms() - t0);
    CHECK(same_ids(json_object_get(o, "tokens"), c->ref[gi], c->n_ref[gi]), "after the stall: tokens equal tandem run");
    json_decref(o);

    /* the prefill node dies: the next request still succeeds, locally */
    kill(ppid, SIGKILL);
    waitpid(ppid, NULL, 0);
    o = post_json(port, gen_req(c->g[gi].ids, c->g[gi].n, c->n_pred, 0, "remote"), &st);
    CHECK(st == 200, "after kill -9: status %d", st);
    CHECK(!strcmp(jstr(o, "prefill", "mode"), "local") && *jstr(o, "prefill", "fallback_reason"),
          "after kill -9: mode %s, fallback '%s'", jstr(o, "prefill", "mode"), jstr(o, "prefill", "fallback_reason"));
    CHECK(same_ids(json_object_get(o, "tokens"), c->ref[gi], c->n_ref[gi]), "after kill -9: tokens equal tandem run");
    json_decref(o);
    char *body = NULL;
    st = http(port, "GET", "/v1/stats", NULL, &body);
    o = body ? json_loads(body, 0, NULL) : NULL;
    CHECK(st == 200 && jint(o, "fallbacks", NULL) == 2 && jint(o, "remote_prefills", NULL) >= 4,
          "stats: %s", body ? body : "");
    json_decref(o);
    free(body);
    CHECK(stop_proc(dpid, 20000) == 0, "decode node exits cleanly on SIGTERM (log %s)", dlog);
    sign_key = NULL;
}

int main(void) {
    signal(SIGPIPE, SIG_IGN);
    char model[1024];
    snprintf(model, sizeof model, "%s/qwen3-mini-F16.gguf", t_models());
    char gpath[1024];
    snprintf(gpath, sizeof gpath, "%s/golden/visible/qwen3-mini-F16.jsonl", t_fixtures());
    const char *need_files[] = { model, gpath, NULL };
    if (!t_need_all(need_files)) return t_done("test_decode_node");
    static golden g[8];
    static ctx c;
    c.model = model;
    c.g = g;
    c.n_g = load_goldens(g, 8);
    c.n_pred = asan() ? 6 : 12;
    CHECK(access(model, R_OK) == 0, "model %s", model);
    CHECK(c.n_g == 8, "8 golden prompts (got %d)", c.n_g);
    CHECK(access(bin(), X_OK) == 0, "tandem binary %s", bin());
    if (t_fail) return t_done("test_decode_node");
    double t0 = now_ms();
    /* the reference runs all at once (one core's work each: one after
     * another they left the other core idle, 7 s of the test under ASan) */
    int need[] = { 0, 1, 3, 5, 6, 7 };
    size_t n_need = asan() ? 4 : sizeof need / sizeof need[0];
    run_job refs[8], ext_job, chat_job;
    for (size_t k = 0; k < n_need; k++) run_ids_start(&refs[k], model, g[need[k]].prompt, 0, c.n_pred);
    size_t el = strlen(g[2].prompt) + 64;
    c.ext_prompt = malloc(el);
    snprintf(c.ext_prompt, el, "%s Late work loses ten percent of the marks per day.", g[2].prompt);
    run_ids_start(&ext_job, model, c.ext_prompt, 0, c.n_pred);
    run_ids_start(&chat_job, model, g[0].prompt, 1, c.n_pred);
    const int ref_ms = asan() ? 300000 : 60000;
    for (size_t k = 0; k < n_need; k++) {
        int gi = need[k];
        c.n_ref[gi] = run_ids_end(&refs[k], ref_ms, c.ref[gi], 64);
        CHECK(c.n_ref[gi] == c.n_pred, "tandem run on golden %d gave %d ids", gi, c.n_ref[gi]);
    }
    c.n_ext_ref = run_ids_end(&ext_job, ref_ms, c.ext_ref, 64);
    c.n_chat_ref = run_ids_end(&chat_job, ref_ms, c.chat_ref, 64);
    CHECK(c.n_chat_ref == c.n_pred, "tandem run --chat gave %d ids", c.n_chat_ref);
    CHECK(c.n_ext_ref == c.n_pred, "tandem run on the extended prompt gave %d ids", c.n_ext_ref);
    char dir[] = "/tmp/tandem-test-decode-XXXXXX";
    CHECK(mkdtemp(dir) != NULL, "temp dir");
    fprintf(stderr, "test_decode_node: references after %.1f s\n", (now_ms() - t0) / 1e3);
    test_local_server(&c, dir);
    fprintf(stderr, "test_decode_node: local server done after %.1f s\n", (now_ms() - t0) / 1e3);
    test_split(&c, dir);
    fprintf(stderr, "test_decode_node: %.1f s (logs in %s)\n", (now_ms() - t0) / 1e3, dir);
    if (!t_fail) {   /* keep the logs only when something failed */
        const char *files[] = { "local.port", "local.log", "prefill.port", "prefill.log", "decode.port", "decode.log", "secret" };
        for (size_t i = 0; i < sizeof files / sizeof files[0]; i++) {
            char p[1200];
            snprintf(p, sizeof p, "%s/%s", dir, files[i]);
            unlink(p);
        }
        rmdir(dir);
    }
    for (int i = 0; i < c.n_g; i++) free(g[i].prompt);
    free(c.ext_prompt);
    return t_done("test_decode_node");
}

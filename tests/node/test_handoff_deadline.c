/* test_handoff_deadline.c - a decode node's handoff deadlines with real
 * processes: the stall timeout (no frame for --timeout-ms) and the total
 * deadline (--handoff-deadline-ms, by default growing with the prompt).
 *
 * One slow prefill node (16-position chunks, a delay before every KV frame:
 * a ~300-token prompt streams for several seconds, one frame every ~60 ms)
 * and two decode nodes on it, both with a 1.5 s stall timeout:
 *   1. progressing: a transfer far longer than the stall timeout, under the
 *      default total deadline, is kept to its end (mode remote);
 *   2. short total cap: the same kind of transfer on the node with
 *      --handoff-deadline-ms 2000 is given up after 2 s and the request is
 *      answered locally (fallback_reason names the deadline);
 *   3. stall: the prefill node stopped with SIGSTOP mid-transfer is given up
 *      on after the stall timeout, well before any total deadline, and the
 *      request is answered locally;
 *   5. two requests at once on a prefill node whose chunks take longer than
 *      the stall timeout: the one waiting for its turn is PINGed, not
 *      given up on; both are received whole;
 *   4. a router in front with --request-timeout-ms 1500 cuts such a request
 *      before its first token (502 naming the limit); with the default it
 *      is answered.
 * Every decode-node answer's greedy tokens equal a cold `tandem run` of the same prompt
 * (self-consistency on the F16 fixture, exact). Each prompt is another, so
 * no prefix cache turns a case into another. Plus, in process, the default
 * deadline's scaling (net/deadline.h). Every wait is bounded (HTTP reads:
 * 60 s; processes: SIGTERM, then SIGKILL).
 */
#include "proc.h"

#include "net/deadline.h"

#define N_PRED 8
#define STALL_MS 1500           /* the decode nodes' --timeout-ms */
#define SHORT_CAP_MS 2000       /* decode node 2's --handoff-deadline-ms */
#define FRAME_DELAY_MS 60       /* the prefill node's delay before each KV frame */

typedef struct { char text[8192]; int n_tok; int32_t ref[N_PRED]; int n_ref; } prompt;

/* ==== Fixtures ==== */

/* The golden prompts of at most 200 tokens (no single prompt of 1,000+:
 * each case stays seconds long), cycled from the `first` one on and joined
 * by spaces until about `want` tokens (counted from their prompt_ids):
 * prompts that start apart share no prefix. */
static int build_prompt(const char *golden, int first, int want, prompt *p) {
    FILE *f = fopen(golden, "r");
    if (!f) return -1;
    char *line = NULL, *text[64];
    int n_tok[64], n = 0;
    size_t lc = 0;
    while (n < 64 && getline(&line, &lc, f) > 0) {
        json_t *o = json_loads(line, 0, NULL);
        json_t *ids = json_object_get(o, "prompt_ids");
        const char *s = jstr(o, "prompt", NULL);
        if (json_is_array(ids) && json_array_size(ids) <= 200 && *s) {
            text[n] = strdup(s);
            n_tok[n++] = (int)json_array_size(ids);
        }
        json_decref(o);
    }
    free(line);
    fclose(f);
    p->text[0] = 0;
    p->n_tok = 0;
    for (int k = first; n > first && p->n_tok < want; k++) {
        const char *s = text[k % n];
        if (strlen(p->text) + strlen(s) + 2 >= sizeof p->text) break;
        if (p->text[0]) strcat(p->text, " ");
        strcat(p->text, s);
        p->n_tok += n_tok[k % n];
    }
    for (int i = 0; i < n; i++) free(text[i]);
    return p->n_tok >= want ? 0 : -1;
}

static json_t *text_req(const prompt *p) {
    json_t *r = json_object();
    json_object_set_new(r, "prompt", json_string(p->text));
    json_object_set_new(r, "max_tokens", json_integer(N_PRED));
    json_object_set_new(r, "ignore_eos", json_true());
    json_object_set_new(r, "prefill", json_string("remote"));
    return r;
}

/* ==== 0. The default deadline's scaling ==== */

static void test_scaling(void) {
    CHECK(deadline_prefill_ms(0) == DEADLINE_BASE_MS && deadline_prefill_ms(-5) == DEADLINE_BASE_MS, "no positions: base");
    CHECK(deadline_prefill_ms(4096) == 300000, "4,096 positions: the 300 s base (%d)", deadline_prefill_ms(4096));
    CHECK(deadline_prefill_ms(6000) == 300000 && deadline_prefill_ms(6001) == 300050, "the base rules to 6,000");
    CHECK(deadline_prefill_ms(16384) == 819200, "16,384 positions: 819.2 s, 1.9 x the 426 s one core took (%d)",
          deadline_prefill_ms(16384));
    CHECK(deadline_prefill_ms(1LL << 40) == DEADLINE_MAX_MS, "no overflow: at most a day (%d)", deadline_prefill_ms(1LL << 40));
    CHECK(deadline_prefill_extra_ms(100) == 0 && deadline_prefill_extra_ms(16384) == 519200, "the router's extra");
}

/* ==== 1-3. Real processes ==== */

/* One request; its answer's prefill figures checked against want_mode. */
static json_t *ask(int port, const prompt *p, int *st, double *ms) {
    double t0 = now_ms();
    json_t *o = post_json(port, text_req(p), st);
    *ms = now_ms() - t0;
    return o;
}

static void test_progressing(int d1, int d2, const prompt *a, const prompt *b) {
    int st;
    double ms;
    /* 1: kept while it progresses */
    json_t *o = ask(d1, a, &st, &ms);
    CHECK(st == 200 && !strcmp(jstr(o, "prefill", "mode"), "remote"),
          "progressing transfer kept: status %d mode %s (%s)", st, jstr(o, "prefill", "mode"),
          jstr(o, "prefill", "fallback_reason"));
    CHECK(jint(o, "prefill", "positions_received") == jint(o, "usage", "prompt_tokens") - 1,
          "every position received: %lld of %lld", jint(o, "prefill", "positions_received"), jint(o, "usage", "prompt_tokens"));
    CHECK(ms > SHORT_CAP_MS, "the transfer took %.0f ms: longer than the stall timeout (%d) and the short cap (%d)",
          ms, STALL_MS, SHORT_CAP_MS);
    CHECK(same_ids(json_object_get(o, "tokens"), a->ref, a->n_ref), "progressing: tokens equal a cold tandem run");
    printf("handoff_deadline: progressing transfer of %lld positions kept: %.0f ms (stall timeout %d ms)\n",
           jint(o, "prefill", "positions_received"), ms, STALL_MS);
    json_decref(o);
    /* 2: the same kind of transfer under a 2 s cap */
    o = ask(d2, b, &st, &ms);
    const char *why = jstr(o, "prefill", "fallback_reason");
    CHECK(st == 200 && !strcmp(jstr(o, "prefill", "mode"), "local"), "short cap: status %d mode %s", st,
          jstr(o, "prefill", "mode"));
    CHECK(strstr(why, "handoff deadline of 2000 ms"), "short cap: the reason names the deadline: '%s'", why);
    CHECK(same_ids(json_object_get(o, "tokens"), b->ref, b->n_ref), "short cap: tokens equal a cold tandem run");
    printf("handoff_deadline: --handoff-deadline-ms %d: answered locally after %.0f ms: %s\n", SHORT_CAP_MS, ms, why);
    json_decref(o);
}

static void test_stall(int d1, pid_t ppid, const prompt *c) {
    int fd = http_open_json(d1, "/v1/generate", text_req(c));
    CHECK(fd >= 0, "stall: request sent");
    if (fd < 0) return;
    /* mid-transfer: the whole one takes ~19 chunks x 4 layers x 60 ms; the
     * reason's "N of M positions complete" shows where it stopped */
    sleep_ms(1200);
    kill(ppid, SIGSTOP);
    double ts = now_ms();
    char *body = NULL;
    int st = http_read(fd, &body);
    double waited = now_ms() - ts;
    close(fd);
    kill(ppid, SIGCONT);
    json_t *o = body ? json_loads(body, 0, NULL) : NULL;
    const char *why = jstr(o, "prefill", "fallback_reason");
    CHECK(st == 200 && !strcmp(jstr(o, "prefill", "mode"), "local"), "stall: status %d mode %s (%s)", st,
          jstr(o, "prefill", "mode"), body ? body : "");
    CHECK(strstr(why, "no frame for 1500 ms"), "stall: the reason names the stall timeout: '%s'", why);
    const char *at = strstr(why, "layers of chunk");
    int done = -1, all = -1;
    if (at) sscanf(strchr(at, ';') ? strchr(at, ';') + 1 : at, " %d of %d positions complete", &done, &all);
    CHECK(done > 0 && done < all, "stall: stopped mid-transfer (%d of %d positions complete)", done, all);
    CHECK(waited >= STALL_MS - 100 && waited < STALL_MS + (asan() ? 30000 : 8000),
          "stall: answered %.0f ms after SIGSTOP (stall timeout %d ms, then a local prefill)", waited, STALL_MS);
    CHECK(same_ids(json_object_get(o, "tokens"), c->ref, c->n_ref), "stall: tokens equal a cold tandem run");
    printf("handoff_deadline: prefill node stopped mid-transfer: answered locally %.0f ms later: %s\n", waited, why);
    json_decref(o);
    free(body);
}

/* 5: two requests at once on a slow prefill node (400 ms a layer, 4
 * layers: 1.6 s a chunk, past the 1.5 s stall timeout; chunks of 256
 * positions, two a prompt: with 128 there were three, 3.2 s more of the
 * test's wall for the same check): each waits a
 * chunk of the other's for its turn, receiving no KV frame meanwhile, but
 * the prefill node PINGs a queued request's decode node every 500 ms, so
 * neither is taken for stalled: both are received whole. */
static void test_queued(int d1, int slow_port, const prompt *a, const prompt *b) {
    const prompt *p[2] = { a, b };
    int fd[2];
    char node[64];
    snprintf(node, sizeof node, "127.0.0.1:%d", slow_port);
    double t0 = now_ms();
    for (int i = 0; i < 2; i++) {
        json_t *r = text_req(p[i]);
        json_object_set_new(r, "prefill_node", json_string(node));
        fd[i] = http_open_json(d1, "/v1/generate", r);
        CHECK(fd[i] >= 0, "queued: request %d sent", i);
    }
    for (int i = 0; i < 2; i++) {
        if (fd[i] < 0) continue;
        char *body = NULL;
        int st = http_read(fd[i], &body);
        close(fd[i]);
        json_t *o = body ? json_loads(body, 0, NULL) : NULL;
        CHECK(st == 200 && !strcmp(jstr(o, "prefill", "mode"), "remote"),
              "queued request %d: status %d mode %s (%s)", i, st, jstr(o, "prefill", "mode"),
              jstr(o, "prefill", "fallback_reason"));
        CHECK(same_ids(json_object_get(o, "tokens"), p[i]->ref, p[i]->n_ref), "queued request %d: tokens equal a cold tandem run", i);
        json_decref(o);
        free(body);
    }
    printf("handoff_deadline: two requests sharing a prefill node with 1.6 s chunks (stall timeout %d ms): "
           "both remote in %.0f ms\n", STALL_MS, now_ms() - t0);
}

/* 4: the router's whole-request limit (--request-timeout-ms) over the same
 * slow prefill node: 1.5 s cuts the request before its first token (502
 * naming the limit); the default (300 s, more for long prompts) keeps it. */
static void test_router(const char *dir, const char *sec, int d1, int pport, const prompt *a, const prompt *b) {
    char dec[80], pre[80];
    snprintf(dec, sizeof dec, "m=127.0.0.1:%d", d1);
    snprintf(pre, sizeof pre, "m=127.0.0.1:%d", pport);
    for (int k = 0; k < 2; k++) {
        char *args[] = { "--role", "router", "--listen", "127.0.0.1:0", "--decode", dec, "--prefill", pre, "--split",
                         "always", "--secret-file", (char *)sec, "--quiet", k ? NULL : "--request-timeout-ms",
                         k ? NULL : "1500", NULL };
        int port;
        pid_t pid = start_serve(dir, k ? "router2" : "router1", args, 1, &port);
        if (port <= 0) { stop_proc(pid, 1000); return; }
        const prompt *p = k ? b : a;
        json_t *r = json_object();
        json_object_set_new(r, "model", json_string("m"));
        json_object_set_new(r, "prompt", json_string(p->text));
        json_object_set_new(r, "max_tokens", json_integer(N_PRED));
        json_object_set_new(r, "temperature", json_integer(0));
        char *s = json_dumps(r, JSON_COMPACT), *body = NULL;
        json_decref(r);
        double t0 = now_ms();
        int st = http(port, "POST", "/v1/completions", s, &body);
        double ms = now_ms() - t0;
        free(s);
        if (!k) {
            CHECK(st == 502 && body && strstr(body, "timed out after 1500 ms"),
                  "router --request-timeout-ms 1500: %d after %.0f ms: %s", st, ms, body ? body : "");
            CHECK(ms < 1500 + (asan() ? 20000 : 5000), "router cut the request %.0f ms after it came", ms);
        } else {
            CHECK(st == 200 && body && strstr(body, "\"choices\""), "router, default limit: %d after %.0f ms: %.300s", st,
                  ms, body ? body : "");
            CHECK(ms > 1500, "the kept request took %.0f ms: past the first router's limit", ms);
        }
        printf("handoff_deadline: router %s: status %d after %.0f ms\n", k ? "default limit" : "--request-timeout-ms 1500",
               st, ms);
        free(body);
        CHECK(stop_proc(pid, 20000) == 0, "router %d exits cleanly", k + 1);
    }
}

int main(void) {
    signal(SIGPIPE, SIG_IGN);
    test_scaling();
    char model[1024], golden[1024];
    snprintf(model, sizeof model, "%s/qwen3-mini-F16.gguf", t_models());
    snprintf(golden, sizeof golden, "%s/golden/visible/qwen3-mini-F16.jsonl", t_fixtures());
    const char *need[] = { model, golden, NULL };
    if (!t_need_all(need)) return t_done("test_handoff_deadline");
    /* the cold reference runs all at once, and beside the nodes' start
     * below (collected before the first case): one after another, with the
     * nodes started after them, they were 12 of the test's 56 s under ASan */
    static prompt p[7];
    run_job refs[7];
    for (int i = 0; i < 7; i++) {
        CHECK(build_prompt(golden, i, 280, &p[i]) == 0, "prompt %d: %d tokens from the goldens", i, p[i].n_tok);
        CHECK(run_ids_start(&refs[i], model, p[i].text, 0, N_PRED) == 0, "tandem run on prompt %d started", i);
    }
    char dir[] = "/tmp/tandem-test-deadline-XXXXXX";
    CHECK(mkdtemp(dir) != NULL, "temp dir");
    char sec[1100];
    snprintf(sec, sizeof sec, "%s/secret", dir);
    const char *secret = "test-secret-0123456789-5f0c2a9e7b1d4c3a8e6f9b2d1c0a7e5f";
    write_text(sec, secret);
    char delay[16];
    snprintf(delay, sizeof delay, "%d", FRAME_DELAY_MS);
    char *pargs[] = { "--role", "prefill", "-m", model, "--listen", "127.0.0.1:0", "--secret-file", sec, "-t", "1",
                      "-c", "2048", "-b", "16", "--debug-frame-delay-ms", delay, NULL };
    int pport, d1, d2;
    pid_t ppid = start_serve(dir, "prefill", pargs, 1, &pport);
    char *sargs[] = { "--role", "prefill", "-m", model, "--listen", "127.0.0.1:0", "--secret-file", sec, "-t", "1",
                      "-c", "2048", "-b", "256", "--debug-layer-delay-ms", "400", NULL };
    int sport;
    pid_t spid = start_serve(dir, "slow", sargs, 1, &sport);
    char node[64];
    snprintf(node, sizeof node, "127.0.0.1:%d", pport);
    char stall[16], cap[16];
    snprintf(stall, sizeof stall, "%d", STALL_MS);
    snprintf(cap, sizeof cap, "%d", SHORT_CAP_MS);
    char *dargs1[] = { "--role", "decode", "-m", model, "--listen", "127.0.0.1:0", "--secret-file", sec,
                       "--prefill-node", node, "-t", "1", "-c", "2048", "--timeout-ms", stall, NULL };
    char *dargs2[] = { "--role", "decode", "-m", model, "--listen", "127.0.0.1:0", "--secret-file", sec,
                       "--prefill-node", node, "-t", "1", "-c", "2048", "--timeout-ms", stall,
                       "--handoff-deadline-ms", cap, NULL };
    pid_t dpid1 = pport > 0 ? start_serve(dir, "decode1", dargs1, 1, &d1) : -1;
    pid_t dpid2 = pport > 0 ? start_serve(dir, "decode2", dargs2, 1, &d2) : -1;
    for (int i = 0; i < 7; i++) {
        p[i].n_ref = run_ids_end(&refs[i], asan() ? 300000 : 60000, p[i].ref, N_PRED);
        CHECK(p[i].n_ref == N_PRED, "tandem run on prompt %d gave %d ids", i, p[i].n_ref);
    }
    if (!t_fail && pport > 0 && d1 > 0 && d2 > 0) {
        static node_auth_key key;
        node_auth_derive(&key, secret, strlen(secret), NODE_AUTH_LABEL_DECODE_API);
        sign_key = &key;
        test_progressing(d1, d2, &p[0], &p[1]);
        test_stall(d1, ppid, &p[2]);
        if (sport > 0) test_queued(d1, sport, &p[5], &p[6]);
        sign_key = NULL;
        test_router(dir, sec, d1, pport, &p[3], &p[4]);
    }
    CHECK(stop_proc(dpid1, 20000) == 0, "decode node 1 exits cleanly (logs in %s)", dir);
    CHECK(stop_proc(dpid2, 20000) == 0, "decode node 2 exits cleanly");
    CHECK(stop_proc(ppid, 20000) == 0, "prefill node exits cleanly after the stall");
    CHECK(stop_proc(spid, 20000) == 0, "the slow prefill node exits cleanly");
    return t_done("test_handoff_deadline");
}

/* test_serve_batch.c - continuous batching on real decode nodes.
 *
 * Starts `tandem serve --role local --parallel 4` (and a decode node beside
 * a prefill node) on loopback and checks, with concurrent clients:
 *   - 8 greedy requests at once, joining at staggered times and asking for
 *     different lengths, streamed and not, get exactly the tokens each gets
 *     alone, on every F16/F32 golden model; the node really batched them
 *     (more tokens than model passes);
 *   - the same for split requests (prefill node -> decode node);
 *   - a shared prompt prefix is copied from a running slot (start_pos);
 *   - a client that leaves mid-stream frees its slot; the others finish
 *     with their own tokens; queue overflow gives 503 while the admitted
 *     requests stay correct; a sequence that fills its context ends with
 *     finish_reason "length" beside an unaffected one;
 *   - fds and RSS come back to their baseline;
 *   - stop strings are never streamed, on the node's NDJSON and through the
 *     router's SSE: text that could start a stop string is held back.
 */
#include "proc.h"

#include <math.h>
#include <pthread.h>

#define N_REQ 8
#define MAX_GEN 48

typedef struct {
    int port;
    int32_t prompt[256];
    int n_prompt, max_tokens, stream, delay_ms;
    const char *prefill;
    /* results */
    int status, n_tok;
    int32_t tok[MAX_GEN];
    char finish[32], mode[32];
    int start_pos;
    double t_done;           /* now_ms() when the reply was complete */
} req;

static void req_run(req *r) {
    if (r->delay_ms) sleep_ms(r->delay_ms);
    json_t *o = gen_tokens(r->port, gen_req(r->prompt, r->n_prompt, r->max_tokens, r->stream, r->prefill), r->stream,
                           r->tok, MAX_GEN, &r->n_tok, &r->status);
    snprintf(r->finish, sizeof r->finish, "%s", jstr(o, "finish_reason", NULL));
    snprintf(r->mode, sizeof r->mode, "%s", jstr(o, "prefill", "mode"));
    r->start_pos = (int)jint(o, "prefill", "start_pos");
    r->t_done = now_ms();
    json_decref(o);
}

static void *req_thread(void *arg) { req_run(arg); return NULL; }

static void run_all(req *r, int n) {
    pthread_t th[N_REQ * 2];
    for (int i = 0; i < n; i++) pthread_create(&th[i], NULL, req_thread, &r[i]);
    for (int i = 0; i < n; i++) pthread_join(th[i], NULL);
}

static uint32_t rng(uint32_t *s) { *s = *s * 1664525u + 1013904223u; return *s >> 8; }

/* N_REQ requests with random prompts over ids [lo, hi). */
static void make_reqs(req *r, int port, uint32_t seed, int lo, int hi, const char *prefill) {
    for (int i = 0; i < N_REQ; i++) {
        memset(&r[i], 0, sizeof r[i]);
        r[i].port = port;
        r[i].n_prompt = 4 + (int)(rng(&seed) % 40);
        for (int t = 0; t < r[i].n_prompt; t++) r[i].prompt[t] = lo + (int32_t)(rng(&seed) % (uint32_t)(hi - lo));
        r[i].max_tokens = 6 + (int)(rng(&seed) % 20);
        r[i].stream = i % 2;
        r[i].delay_ms = (int)(rng(&seed) % 5) * 40;
        r[i].prefill = prefill;
    }
}

/* Waits until no slot is busy (a cancelled job is dropped at the next step). */
static int wait_idle(int port, int timeout_ms) {
    double t0 = now_ms();
    while (now_ms() - t0 < timeout_ms) {
        if (stat_int(port, "slots_busy") == 0 && stat_int(port, "queued") == 0) return 1;
        sleep_ms(50);
    }
    return 0;
}

/* Each request alone (one at a time), then all together: same tokens. */
static void check_concurrent_equal(req *r, const char *what) {
    req alone[N_REQ];
    memcpy(alone, r, sizeof alone);
    for (int i = 0; i < N_REQ; i++) { alone[i].delay_ms = 0; req_run(&alone[i]); }
    int steps0 = (int)stat_int(r[0].port, "batch_steps"), toks0 = (int)stat_int(r[0].port, "batched_tokens");
    run_all(r, N_REQ);
    int steps = (int)stat_int(r[0].port, "batch_steps") - steps0, toks = (int)stat_int(r[0].port, "batched_tokens") - toks0;
    int same = 0;
    for (int i = 0; i < N_REQ; i++) {
        CHECK(alone[i].status == 200 && r[i].status == 200, "%s req %d: status %d alone, %d together", what, i,
              alone[i].status, r[i].status);
        int eq = alone[i].n_tok == r[i].n_tok && r[i].n_tok == r[i].max_tokens &&
                 !memcmp(alone[i].tok, r[i].tok, sizeof(int32_t) * (size_t)r[i].n_tok);
        CHECK(eq, "%s req %d (%s): %d tokens together vs %d alone, different ids", what, i,
              r[i].stream ? "stream" : "full", r[i].n_tok, alone[i].n_tok);
        same += eq;
    }
    /* decode steps carried several sequences: fewer passes than tokens */
    CHECK(steps > 0 && toks > steps, "%s: %d tokens in %d passes (no batching?)", what, toks, steps);
    printf("%s: %d/%d requests equal alone; %d tokens in %d passes (%.1f per pass)\n", what, same, N_REQ, toks, steps,
           steps ? (double)toks / steps : 0.0);
}

static void test_model_local(const char *path, const char *dir, int vocab_hi, uint32_t seed) {
    int port;
    char *extra[] = { "--role", "local", "-m", (char *)path, "-t", "2", "-c", "512", "--parallel", "4",
                      "--listen", "127.0.0.1:0", NULL };
    pid_t pid = start_serve(dir, "local", extra, 0, &port);
    CHECK(port > 0, "%s: local node did not start", path);
    if (port <= 0) { stop_proc(pid, 5000); return; }
    req r[N_REQ];
    make_reqs(r, port, seed, 10, vocab_hi, NULL);
    check_concurrent_equal(r, path);
    CHECK(stop_proc(pid, 20000) == 0, "%s: node exit status", path);
}

/* Slots freed by a leaving client; queue overflow; context exhaustion;
 * prefix copied from a running slot; fds/RSS back to baseline. */
static void test_lifecycle(const char *path, const char *dir) {
    int port;
    char *extra[] = { "--role", "local", "-m", (char *)path, "-t", "2", "-c", "160", "--parallel", "2",
                      "--queue", "2", "--listen", "127.0.0.1:0", NULL };
    pid_t pid = start_serve(dir, "life", extra, 0, &port);
    CHECK(port > 0, "lifecycle node did not start");
    if (port <= 0) { stop_proc(pid, 5000); return; }
    req warm[N_REQ];
    make_reqs(warm, port, 99, 10, 5000, NULL);
    for (int i = 0; i < 2; i++) { warm[i].delay_ms = 0; req_run(&warm[i]); }
    int fd0 = settled_fds(pid);
    long rss0 = rss_kb(pid);

    /* a client leaves mid-stream: its slot comes back, the other stream is intact */
    req keep = warm[2];
    keep.stream = 1; keep.max_tokens = 40; keep.delay_ms = 0;
    req keep_alone = keep;
    req_run(&keep_alone);
    pthread_t th;
    pthread_create(&th, NULL, req_thread, &keep);
    int fd = http_open_json(port, "/v1/generate", gen_req(warm[3].prompt, warm[3].n_prompt, 150, 1, NULL));
    char buf[256];
    ssize_t got = fd >= 0 ? recv(fd, buf, sizeof buf, 0) : -1;
    if (fd >= 0) close(fd);
    pthread_join(th, NULL);
    CHECK(got > 0, "leaving client got nothing before it left");
    CHECK(keep.status == 200 && keep.n_tok == keep_alone.n_tok &&
          !memcmp(keep.tok, keep_alone.tok, sizeof(int32_t) * (size_t)keep.n_tok),
          "stream beside a leaving client changed (%d vs %d tokens)", keep.n_tok, keep_alone.n_tok);
    CHECK(wait_idle(port, 10000), "slot of a client that left was not freed");
    CHECK(stat_int(port, "requests_cancelled") >= 1, "leaving client not counted as cancelled");

    /* queue overflow: 2 slots + 2 queued; the rest get 503, the admitted ones are right */
    req many[N_REQ];
    make_reqs(many, port, 7, 10, 5000, NULL);
    req solo[N_REQ];
    for (int i = 0; i < N_REQ; i++) { many[i].max_tokens = 24; many[i].delay_ms = 0; solo[i] = many[i]; }
    for (int i = 0; i < N_REQ; i++) req_run(&solo[i]);
    run_all(many, N_REQ);
    int busy = 0, ok = 0;
    for (int i = 0; i < N_REQ; i++) {
        if (many[i].status == 503) { busy++; continue; }
        ok += many[i].status == 200 && many[i].n_tok == solo[i].n_tok &&
              !memcmp(many[i].tok, solo[i].tok, sizeof(int32_t) * (size_t)solo[i].n_tok);
    }
    CHECK(busy >= 1 && ok == N_REQ - busy, "overflow: %d got 503, %d of %d admitted correct", busy, ok, N_REQ - busy);

    /* context exhaustion beside a normal request: 150 prompt tokens in a 160 context */
    req full, normal = warm[4];
    memset(&full, 0, sizeof full);
    full.port = port;
    full.n_prompt = 150;
    int32_t longp[150];
    for (int i = 0; i < 150; i++) longp[i] = 100 + i;
    full.max_tokens = 40;
    normal.delay_ms = 0;
    req normal_alone = normal;
    req_run(&normal_alone);
    {
        /* req holds at most 64 prompt ids: send the long one directly */
        int st;
        pthread_create(&th, NULL, req_thread, &normal);
        json_t *o = post_json(port, gen_req(longp, 150, 40, 0, NULL), &st);
        pthread_join(th, NULL);
        CHECK(st == 200 && !strcmp(jstr(o, "finish_reason", NULL), "length") &&
              json_array_size(json_object_get(o, "tokens")) == 11,
              "context exhaustion: status %d finish %s, %zu tokens (want length, 11)", st, jstr(o, "finish_reason", NULL),
              json_array_size(json_object_get(o, "tokens")));
        json_decref(o);
    }
    CHECK(normal.n_tok == normal_alone.n_tok && !memcmp(normal.tok, normal_alone.tok, sizeof(int32_t) * (size_t)normal.n_tok),
          "request beside an exhausted context changed");

    /* prefix sharing: B shares A's first 60 tokens while A is still running */
    int32_t pa[100], pb[100];
    for (int i = 0; i < 100; i++) pa[i] = pb[i] = 3000 + i;
    for (int i = 60; i < 100; i++) pb[i] = 4000 + i;
    int st;
    json_t *ref = post_json(port, gen_req(pb, 80, 8, 0, "local"), &st);   /* B alone (fresh slot content) */
    json_decref(post_json(port, gen_req(pb + 40, 40, 1, 0, NULL), &st));   /* push B's prefix out of the way */
    json_decref(post_json(port, gen_req(pb + 20, 60, 1, 0, NULL), &st));
    req a;
    memset(&a, 0, sizeof a);
    a.port = port;
    a.n_prompt = 64;
    memcpy(a.prompt, pa, sizeof(int32_t) * 64);
    a.max_tokens = 40;
    a.stream = 1;
    pthread_create(&th, NULL, req_thread, &a);
    sleep_ms(asan() ? 1500 : 300);
    json_t *b = post_json(port, gen_req(pb, 80, 8, 0, NULL), &st);
    pthread_join(th, NULL);
    CHECK(st == 200 && jint(b, "prefill", "start_pos") >= 60, "shared prefix not reused: start_pos %lld",
          jint(b, "prefill", "start_pos"));
    CHECK(json_equal(json_object_get(b, "tokens"), json_object_get(ref, "tokens")), "shared-prefix request changed tokens");
    json_decref(ref);
    json_decref(b);

    /* arriving together with the same 120-token prefix: the second waits for
     * the first's prompt and copies those rows instead of computing them */
    req twin[2], twin_alone[2];
    for (int k = 0; k < 2; k++) {
        memset(&twin[k], 0, sizeof twin[k]);
        twin[k].port = port;
        twin[k].n_prompt = 140;
        for (int i = 0; i < 140; i++) twin[k].prompt[i] = i < 120 ? 2000 + 7 * i : 900 + 31 * i + k;
        twin[k].max_tokens = 8;
        twin_alone[k] = twin[k];
        twin_alone[k].prefill = "local";
    }
    for (int k = 0; k < 2; k++) req_run(&twin_alone[k]);
    /* evict the prefix from both slots first */
    json_decref(post_json(port, gen_req(pa, 40, 1, 0, NULL), &st));
    json_decref(post_json(port, gen_req(pb + 50, 40, 1, 0, NULL), &st));
    run_all(twin, 2);
    int reused = twin[0].start_pos >= 119 || twin[1].start_pos >= 119;
    CHECK(reused, "simultaneous shared prefix computed twice (start_pos %d, %d)", twin[0].start_pos, twin[1].start_pos);
    for (int k = 0; k < 2; k++)
        CHECK(twin[k].status == 200 && twin[k].n_tok == 8 && !memcmp(twin[k].tok, twin_alone[k].tok, sizeof(int32_t) * 8),
              "twin %d tokens changed by sharing", k);

    CHECK(wait_idle(port, 10000), "slots not idle at the end");
    int fd1 = settled_fds(pid);
    long rss1 = rss_kb(pid);
    CHECK(fd1 <= fd0, "fds %d -> %d", fd0, fd1);
    /* two KV caches of 160 positions are a few MB; allow the allocator some
     * slack (under ASan freed memory sits in its quarantine: not checked) */
    CHECK(asan() || rss1 - rss0 < 16 * 1024, "RSS %ld -> %ld kB", rss0, rss1);
    printf("lifecycle: fds %d -> %d, RSS %ld -> %ld kB, %d of %d got 503 on overflow\n", fd0, fd1, rss0, rss1, busy, N_REQ);
    CHECK(stop_proc(pid, 20000) == 0, "lifecycle node exit status");
}

/* The secret of the split tests' nodes; requests to their decode nodes are
 * signed with the key derived from it, as a router signs them. */
#define BATCH_SECRET "batch-test-secret-5f0c2a9e7b1d4c3a8e6f9b2d1c0a7e5f"

static void test_split(const char *path, const char *dir) {
    static node_auth_key key;
    node_auth_derive(&key, BATCH_SECRET, strlen(BATCH_SECRET), NODE_AUTH_LABEL_DECODE_API);
    sign_key = &key;
    char sf[512];
    snprintf(sf, sizeof sf, "%s/secret", dir);
    FILE *f = fopen(sf, "w");
    if (f) { fputs(BATCH_SECRET "\n", f); fclose(f); }
    int pport, dport;
    char *pextra[] = { "--role", "prefill", "-m", (char *)path, "-t", "1", "--listen", "127.0.0.1:0",
                       "--secret-file", sf, NULL };
    pid_t pp = start_serve(dir, "prefill", pextra, 0, &pport);
    CHECK(pport > 0, "prefill node did not start");
    char addr[64];
    snprintf(addr, sizeof addr, "127.0.0.1:%d", pport);
    char *dextra[] = { "--role", "decode", "-m", (char *)path, "-t", "1", "-c", "512", "--parallel", "4",
                       "--prefill-node", addr, "--secret-file", sf, "--listen", "127.0.0.1:0", NULL };
    pid_t dp = start_serve(dir, "decode", dextra, 0, &dport);
    CHECK(dport > 0, "decode node did not start");
    if (pport > 0 && dport > 0) {
        req r[N_REQ];
        make_reqs(r, dport, 1234, 10, 5000, "remote");
        check_concurrent_equal(r, "split");
        int remote = 0;
        for (int i = 0; i < N_REQ; i++) remote += !strcmp(r[i].mode, "remote");
        CHECK(remote == N_REQ, "split: %d of %d requests prefilled remotely", remote, N_REQ);
    }
    CHECK(stop_proc(dp, 20000) == 0, "decode node exit status");
    CHECK(stop_proc(pp, 20000) == 0, "prefill node exit status");
    sign_key = NULL;
}

/* Concatenated "text" of NDJSON lines (or SSE chunks: choices[0].text),
 * and the finish reason. */
static void collect_text(char *body, int sse, char *out, size_t cap, char *finish, size_t fcap) {
    size_t n = 0;
    out[0] = finish[0] = 0;
    for (char *save = NULL, *l = strtok_r(body, "\n", &save); l; l = strtok_r(NULL, "\n", &save)) {
        if (sse) { if (strncmp(l, "data: ", 6)) continue; l += 6; }
        json_t *o = json_loads(l, 0, NULL);
        json_t *src = sse ? json_array_get(json_object_get(o, "choices"), 0) : o;
        const char *t = json_string_value(json_object_get(src, "text"));
        const char *f = json_string_value(json_object_get(src, "finish_reason"));
        if (t) { size_t k = strlen(t); if (n + k < cap) { memcpy(out + n, t, k); n += k; out[n] = 0; } }
        if (f) snprintf(finish, fcap, "%s", f);
        json_decref(o);
    }
}

/* For several stop strings cut from a greedy generation (some crossing token
 * boundaries), streamed text = the generation up to the stop string. */
static void test_stop_strings(const char *path, const char *dir) {
    int port, rport;
    char *extra[] = { "--role", "local", "-m", (char *)path, "-t", "2", "-c", "512", "--parallel", "2",
                      "--listen", "127.0.0.1:0", NULL };
    pid_t pid = start_serve(dir, "stop", extra, 0, &port);
    char dec[64];
    snprintf(dec, sizeof dec, "m=127.0.0.1:%d", port);
    char *rextra[] = { "--role", "router", "--quiet", "--listen", "127.0.0.1:0", "--decode", dec, NULL };
    pid_t rpid = start_serve(dir, "router", rextra, 0, &rport);
    CHECK(port > 0 && rport > 0, "stop test: servers did not start");
    const char *prompt = "Once upon a time, in a quiet town by the river,";
    json_t *q = json_pack("{s:s, s:i, s:b}", "prompt", prompt, "max_tokens", 24, "ignore_eos", 1);
    int st;
    json_t *o = port > 0 ? post_json(port, q, &st) : (json_decref(q), NULL);
    char full[4096];
    snprintf(full, sizeof full, "%s", jstr(o, "text", NULL));
    json_decref(o);
    size_t fl = strlen(full);
    CHECK(fl >= 16, "stop test: generation too short (%zu bytes)", fl);
    int cases = 0, good = 0;
    for (size_t at = 3; fl >= 16 && at + 6 < fl && cases < 6; at += fl / 6 + 1) {
        /* a whole-character window of 4..7 bytes (stop strings are UTF-8) */
        while (at < fl && ((unsigned char)full[at] & 0xC0) == 0x80) at++;
        size_t e = at + 4;
        while (e < fl && ((unsigned char)full[e] & 0xC0) == 0x80) e++;
        if (e > fl || e - at > 7) continue;
        char stop[8];
        snprintf(stop, sizeof stop, "%.*s", (int)(e - at), full + at);
        size_t cut = (size_t)(strstr(full, stop) - full);
        cases++;
        for (int via = 0; via < 2; via++) {
            char *body = NULL, text[4096], fin[32];
            json_t *r = json_pack("{s:s, s:i, s:b, s:b, s:[s]}", "prompt", prompt, "max_tokens", 24, "stream", 1,
                                  "ignore_eos", 1, "stop", stop);
            if (via) {   /* through the router: an OpenAI completion request */
                json_object_del(r, "ignore_eos");
                json_object_set_new(r, "model", json_string("m"));
                json_object_set_new(r, "temperature", json_integer(0));
            }
            char *s = json_dumps(r, JSON_COMPACT);
            json_decref(r);
            st = http(via ? rport : port, "POST", via ? "/v1/completions" : "/v1/generate", s, &body);
            free(s);
            if (body) collect_text(body, via, text, sizeof text, fin, sizeof fin);
            else text[0] = fin[0] = 0;
            int ok = st == 200 && strlen(text) == cut && !strncmp(text, full, cut) && !strcmp(fin, "stop");
            CHECK(ok, "stop '%s' via %s: status %d, text '%s' (want '%.*s'), finish %s", stop, via ? "router" : "node",
                  st, text, (int)cut, full, fin);
            good += ok;
            free(body);
        }
    }
    printf("stop strings: %d of %d streamed cases end right before the stop string\n", good, cases * 2);
    stop_proc(rpid, 10000);
    CHECK(stop_proc(pid, 20000) == 0, "stop-test node exit status");
}

/* The prefill node interleaves requests chunk by chunk: a short prompt sent
 * while a long one is being prefilled gets its first token first. */
static void test_prefill_interleave(const char *path, const char *dir) {
    static node_auth_key key;
    node_auth_derive(&key, BATCH_SECRET, strlen(BATCH_SECRET), NODE_AUTH_LABEL_DECODE_API);
    sign_key = &key;
    char sf[512];
    snprintf(sf, sizeof sf, "%s/secret", dir);
    int pport, dport;
    char *pextra[] = { "--role", "prefill", "-m", (char *)path, "-t", "1", "-b", "64", "--listen", "127.0.0.1:0",
                       "--secret-file", sf, NULL };
    pid_t pp = start_serve(dir, "prefill2", pextra, 0, &pport);
    char addr[64];
    snprintf(addr, sizeof addr, "127.0.0.1:%d", pport);
    char *dextra[] = { "--role", "decode", "-m", (char *)path, "-t", "1", "-c", "2048", "--parallel", "2",
                       "--prefill-node", addr, "--secret-file", sf, "--listen", "127.0.0.1:0", NULL };
    pid_t dp = start_serve(dir, "decode2", dextra, 0, &dport);
    CHECK(pport > 0 && dport > 0, "interleave: nodes did not start");
    if (pport > 0 && dport > 0) {
        /* the short request is sent a fifth of the way into the long one's
         * prefill, timed first alone on another prompt (no shared prefix) */
        int32_t *longp = malloc(sizeof(int32_t) * 1800);
        for (int i = 0; i < 1800; i++) longp[i] = 600 + (i * 7) % 3000;
        json_t *wq = gen_req(longp, 1800, 1, 0, "remote");
        int wst;
        json_t *wo = post_json(dport, wq, &wst);
        double alone = json_number_value(json_object_get(json_object_get(wo, "prefill"), "ttft_ms"));
        CHECK(wst == 200 && alone > 0, "interleave: long request alone %d", wst);
        json_decref(wo);   /* post_json took wq */
        for (int i = 0; i < 1800; i++) longp[i] = 500 + (i * 13) % 4000;
        json_t *lq = gen_req(longp, 1800, 1, 0, "remote");
        free(longp);
        req shortr;
        memset(&shortr, 0, sizeof shortr);
        shortr.port = dport;
        shortr.n_prompt = 40;
        for (int i = 0; i < 40; i++) shortr.prompt[i] = 700 + i;
        shortr.max_tokens = 1;
        shortr.prefill = "remote";
        shortr.delay_ms = (int)(alone / 5);
        pthread_t th;
        double t0 = now_ms();
        pthread_create(&th, NULL, req_thread, &shortr);
        int st;
        json_t *lo = post_json(dport, lq, &st);
        double t_long = now_ms() - t0;
        pthread_join(th, NULL);
        double t_short = now_ms() - t0;   /* upper bound: joined after the long one */
        (void)t_short;
        CHECK(st == 200 && !strcmp(jstr(lo, "prefill", "mode"), "remote"), "interleave: long request %d %s", st,
              jstr(lo, "prefill", "mode"));
        CHECK(shortr.status == 200 && !strcmp(shortr.mode, "remote"), "interleave: short request %d %s", shortr.status,
              shortr.mode);
        double long_ttft = json_number_value(json_object_get(json_object_get(lo, "prefill"), "ttft_ms"));
        CHECK(shortr.t_done > 0 && shortr.t_done - t0 < long_ttft, "short prompt waited for the long one: done at %.0f ms, "
              "long first token at %.0f ms", shortr.t_done - t0, long_ttft);
        printf("prefill interleave: long (1800 tokens) first token at %.0f ms (%.0f ms alone), short (40) sent at "
               "%d ms, done at %.0f ms\n", long_ttft, alone, shortr.delay_ms, shortr.t_done - t0);
        json_decref(lo);
        (void)t_long;
    }
    CHECK(stop_proc(dp, 20000) == 0, "interleave decode node exit status");
    CHECK(stop_proc(pp, 20000) == 0, "interleave prefill node exit status");
    sign_key = NULL;
}

/* logprobs: greedy tokens are their own top alternative, values are
 * log-probabilities (<= 0, top ones sum to at most 1), stream == non-stream. */
static void test_logprobs(const char *path, const char *dir) {
    int port;
    char *extra[] = { "--role", "local", "-m", (char *)path, "-t", "2", "-c", "256", "--parallel", "2",
                      "--listen", "127.0.0.1:0", NULL };
    pid_t pid = start_serve(dir, "lp", extra, 0, &port);
    CHECK(port > 0, "logprobs node did not start");
    int32_t ids[12] = { 11, 300, 4000, 52, 7, 900, 1234, 77, 15, 2048, 640, 3 };
    json_t *q = gen_req(ids, 12, 6, 0, NULL);
    json_object_set_new(q, "logprobs", json_integer(3));
    int st;
    json_t *o = port > 0 ? post_json(port, q, &st) : (json_decref(q), NULL);
    json_t *lps = json_object_get(o, "logprobs"), *toks = json_object_get(o, "tokens");
    int good = 0;
    for (size_t i = 0; i < json_array_size(lps); i++) {
        json_t *e = json_array_get(lps, i), *top = json_object_get(e, "top_logprobs");
        double lp = json_number_value(json_object_get(e, "logprob")), mass = 0;
        for (size_t t = 0; t < json_array_size(top); t++) mass += exp(json_number_value(json_object_get(json_array_get(top, t), "logprob")));
        good += json_array_size(top) == 3 && lp <= 0 && mass <= 1.0 + 1e-5 &&
                json_integer_value(json_object_get(json_array_get(top, 0), "id")) == json_integer_value(json_array_get(toks, i)) &&
                fabs(json_number_value(json_object_get(json_array_get(top, 0), "logprob")) - lp) < 1e-6 &&
                json_is_string(json_object_get(json_array_get(top, 0), "text"));
    }
    CHECK(st == 200 && json_array_size(lps) == 6 && good == 6, "logprobs: status %d, %zu entries, %d consistent", st,
          json_array_size(lps), good);
    /* streamed: the same values on the token lines */
    json_t *qs = gen_req(ids, 12, 6, 1, NULL);
    json_object_set_new(qs, "logprobs", json_integer(3));
    char *s = json_dumps(qs, JSON_COMPACT), *body = NULL;
    json_decref(qs);
    st = http(port, "POST", "/v1/generate", s, &body);
    free(s);
    int k = 0, same = 0;
    for (char *save = NULL, *l = body ? strtok_r(body, "\n", &save) : NULL; l; l = strtok_r(NULL, "\n", &save)) {
        json_t *line = json_loads(l, 0, NULL);
        if (json_object_get(line, "token") && k < 6) {
            same += fabs(json_number_value(json_object_get(line, "logprob")) -
                         json_number_value(json_object_get(json_array_get(lps, (size_t)k), "logprob"))) < 1e-6;
            k++;
        }
        json_decref(line);
    }
    free(body);
    CHECK(k == 6 && same == 6, "streamed logprobs: %d lines, %d equal", k, same);
    json_decref(o);
    CHECK(stop_proc(pid, 20000) == 0, "logprobs node exit status");
}

/* Completion token ids through the router (logprobs would be another
 * path; here the node's own stream is read for ids). */
static int node_ids(int port, json_t *q, int32_t *ids, int cap) {
    int st, n = 0;
    json_t *o = post_json(port, q, &st);
    json_t *a = json_object_get(o, "tokens");
    for (size_t i = 0; st == 200 && i < json_array_size(a) && n < cap; i++) ids[n++] = (int32_t)json_integer_value(json_array_get(a, i));
    json_decref(o);
    return st == 200 ? n : -1;
}

static int max_repeat(const int32_t *ids, int n) {
    int best = 0;
    for (int i = 0; i < n; i++) {
        int c = 0;
        for (int k = 0; k < n; k++) c += ids[k] == ids[i];
        if (c > best) best = c;
    }
    return best;
}

/* logit_bias bans and boosts; frequency/presence/repetition penalties
 * change greedy output and reduce repeats (stories260K: 512 tokens, whose
 * greedy stories repeat). Through the router's OpenAI fields too. */
static void test_sampling_controls(const char *dir) {
    char path[1024];
    t_fixture_path(path, sizeof path, "models/stories260K.gguf");
    int port, rport;
    char *extra[] = { "--role", "local", "-m", path, "-t", "2", "-c", "256", "--parallel", "2",
                      "--listen", "127.0.0.1:0", NULL };
    pid_t pid = start_serve(dir, "ctl", extra, 0, &port);
    char dec[64];
    snprintf(dec, sizeof dec, "m=127.0.0.1:%d", port);
    char *rextra[] = { "--role", "router", "--quiet", "--listen", "127.0.0.1:0", "--decode", dec, NULL };
    pid_t rpid = start_serve(dir, "ctl-router", rextra, 0, &rport);
    CHECK(port > 0 && rport > 0, "sampling controls: servers did not start");
    int32_t prompt[4] = { 1, 403, 407, 261 }, plain[64], got[64];
    int n = node_ids(port, gen_req(prompt, 4, 64, 0, NULL), plain, 64);
    CHECK(n == 64, "plain greedy: %d tokens", n);
    /* ban the most frequent token: it never appears */
    int32_t top = plain[0];
    for (int i = 0; i < n; i++) { int c = 0, ct = 0; for (int k = 0; k < n; k++) { c += plain[k] == plain[i]; ct += plain[k] == top; } if (c > ct) top = plain[i]; }
    json_t *q = gen_req(prompt, 4, 64, 0, NULL);
    char key[16];
    snprintf(key, sizeof key, "%d", top);
    json_object_set_new(q, "logit_bias", json_pack("{s:i}", key, -100));
    int m = node_ids(port, q, got, 64), seen = 0;
    for (int i = 0; i < m; i++) seen += got[i] == top;
    CHECK(m == 64 && seen == 0, "banned token %d appears %d times", top, seen);
    /* boost a token that never appears: greedy then writes it every time */
    int32_t boost = 300;
    for (int i = 0; i < n; i++) if (plain[i] == boost) boost++;
    q = gen_req(prompt, 4, 16, 0, NULL);
    snprintf(key, sizeof key, "%d", boost);
    json_object_set_new(q, "logit_bias", json_pack("{s:i}", key, 100));
    m = node_ids(port, q, got, 64);
    int all = m == 16;
    for (int i = 0; i < m; i++) all &= got[i] == boost;
    CHECK(all, "boosted token %d not generated throughout", boost);
    /* penalties: fewer repeats than plain greedy */
    static const char *const pens[] = { "frequency_penalty", "presence_penalty", "repetition_penalty" };
    static const double vals[] = { 2.0, 2.0, 1.5 };
    for (int k = 0; k < 3; k++) {
        q = gen_req(prompt, 4, 64, 0, NULL);
        json_object_set_new(q, pens[k], json_real(vals[k]));
        m = node_ids(port, q, got, 64);
        CHECK(m == 64 && memcmp(got, plain, sizeof plain) && max_repeat(got, m) < max_repeat(plain, n),
              "%s %.1f: max repeat %d vs %d plain", pens[k], vals[k], m > 0 ? max_repeat(got, m) : -1, max_repeat(plain, n));
    }
    /* the same ban through the router, as OpenAI clients send it */
    char body[512], *resp = NULL;
    snprintf(body, sizeof body, "{\"model\":\"m\",\"prompt\":\"Once upon a time\",\"max_tokens\":48,\"temperature\":0,"
             "\"logprobs\":0,\"logit_bias\":{\"%d\":-100},\"frequency_penalty\":0.5}", top);
    int st = http(rport, "POST", "/v1/completions", body, &resp);
    CHECK(st == 200, "router accepts logit_bias and penalties: %d %s", st, resp ? resp : "");
    free(resp);
    /* OpenAI logprobs, non-stream and streamed */
    resp = NULL;
    st = http(rport, "POST", "/v1/completions",
              "{\"model\":\"m\",\"prompt\":\"Once upon a time\",\"max_tokens\":6,\"temperature\":0,\"logprobs\":2}", &resp);
    json_t *o = resp ? json_loads(resp, 0, NULL) : NULL;
    json_t *lp = json_object_get(json_array_get(json_object_get(o, "choices"), 0), "logprobs");
    json_t *tl = json_object_get(lp, "token_logprobs"), *tops = json_object_get(lp, "top_logprobs");
    int ok = st == 200 && json_array_size(json_object_get(lp, "tokens")) == 6 && json_array_size(tl) == 6 &&
             json_array_size(tops) == 6 && json_array_size(json_object_get(lp, "text_offset")) == 6;
    for (size_t i = 0; ok && i < 6; i++)
        ok = json_number_value(json_array_get(tl, i)) <= 0 && json_object_size(json_array_get(tops, i)) >= 1 &&
             json_object_size(json_array_get(tops, i)) <= 2;
    CHECK(ok, "completions logprobs: %d %s", st, resp ? resp : "");
    json_decref(o);
    free(resp);
    resp = NULL;
    st = http(rport, "POST", "/v1/completions",
              "{\"model\":\"m\",\"prompt\":\"Once upon a time\",\"max_tokens\":6,\"temperature\":0,\"logprobs\":1,"
              "\"stream\":true}", &resp);
    int with_lp = 0;
    for (char *save = NULL, *l = resp ? strtok_r(resp, "\n", &save) : NULL; l; l = strtok_r(NULL, "\n", &save)) {
        if (strncmp(l, "data: {", 7)) continue;
        json_t *c = json_loads(l + 6, 0, NULL);
        json_t *clp = json_object_get(json_array_get(json_object_get(c, "choices"), 0), "logprobs");
        with_lp += json_array_size(json_object_get(clp, "token_logprobs")) == 1;
        json_decref(c);
    }
    CHECK(st == 200 && with_lp == 6, "streamed completions logprobs on %d of 6 chunks", with_lp);
    free(resp);
    stop_proc(rpid, 10000);
    CHECK(stop_proc(pid, 20000) == 0, "sampling-controls node exit status");
}

int main(void) {
    signal(SIGPIPE, SIG_IGN);
    char dir[] = "/tmp/tandem-test-batch-XXXXXX";
    if (!mkdtemp(dir)) return 1;
    const char *gm = t_models();
    char path[1024];
    struct { const char *dir, *file; int vocab_hi; } models[] = {
        { gm, "qwen3-mini-F16.gguf", 5000 }, { gm, "qwen2-mini-F16.gguf", 5000 },
        { gm, "qwen3moe-mini-F16.gguf", 5000 }, { NULL, "stories260K.gguf", 500 }, { NULL, "stories260K-F16.gguf", 500 },
    };
    for (size_t i = 0; i < sizeof models / sizeof models[0]; i++) {
        if (models[i].dir) snprintf(path, sizeof path, "%s/%s", models[i].dir, models[i].file);
        else {
            char rel[128];
            snprintf(rel, sizeof rel, "models/%s", models[i].file);
            t_fixture_path(path, sizeof path, rel);
        }
        if (t_need(path)) test_model_local(path, dir, models[i].vocab_hi, 17 + (uint32_t)i);
        if (asan() && i >= 1) break;   /* sanitizer run: the same paths on fewer models */
    }
    snprintf(path, sizeof path, "%s/qwen3-mini-F16.gguf", gm);
    if (t_need(path)) {
        test_split(path, dir);
        test_prefill_interleave(path, dir);
        test_lifecycle(path, dir);
        test_stop_strings(path, dir);
        test_logprobs(path, dir);
    }
    test_sampling_controls(dir);
    printf("test_serve_batch: logs in %s\n", dir);
    return t_done("test_serve_batch");
}

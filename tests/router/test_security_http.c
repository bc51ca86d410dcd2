/* test_security_http.c - the HTTP side's defences, against real processes.
 *
 * In-process: logsafe_escape, and node_auth signing / verification / the
 * replay cache. Then, on loopback, with assets/stories260K.gguf:
 *   - a decode node with a secret answers an anonymous, a forged, an
 *     altered, a stale and a replayed POST /v1/generate with 401, and a
 *     request signed as the router signs it with 200;
 *   - "prefill_node" from an anonymous client makes no connection (a node
 *     without secret refuses the field; one with a secret wants a
 *     signature first);
 *   - a signed "prefill_node" carrying a newline and ESC is logged escaped;
 *   - slow clients: 200 slow-loris connections (one header line every 5 s)
 *     against the router and 64 against a decode node: /health answers
 *     within 1 s and a generation through the router completes while they
 *     stay; the whole-request deadline closes them; a flood from one
 *     address is capped at the per-address limit;
 *   - registration: unsigned, replayed and stale registrations are
 *     refused, a registration of a statically configured node is refused
 *     (409) and the node stays up, a new node is accepted;
 *   - `serve --role decode|prefill --router URL` registers by itself and
 *     serves requests through the router;
 *   - a client that half-closes its socket after the request still gets
 *     the answer (router and decode node, streamed and not);
 *   - an 8 MiB prompt is refused by the byte bound, fast.
 */
#include "t.h"
#include "proc.h"

#include <arpa/inet.h>
#include <errno.h>
#include <fcntl.h>
#include <jansson.h>
#include <netinet/in.h>
#include <poll.h>
#include <signal.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

#include "base/logsafe.h"
#include "net/node_auth.h"

#define TS_DIR "build/test_security_http.d"
#define TS_SECRET "security-test-secret-5f0c2a9e7b1d4c3a8e6f9b2d1c0a7e5f"

/* ==== Helpers ==== */

/* Starts argv (its --port-file is TS_DIR/name.port), returns the port. */
static int ts_start(pid_t *pid, char *const argv[], const char *name) {
    return start_named(pid, argv, TS_DIR, name, 1, 60000);
}

static const char *ts_gen_body = "{\"prompt\":\"Once upon a time\",\"max_tokens\":4,\"temperature\":0}";

/* ==== In-process: escaping and signatures ==== */

static void test_logsafe(void) {
    char out[256];
    logsafe_escape(out, sizeof out, "a\nb\r\x1b[31mc\\d\x7f", 13);
    CHECK(!strcmp(out, "a\\nb\\r\\x1b[31mc\\\\d\\x7f"), "escape controls: %s", out);
    const char *u = "caf\xc3\xa9 \xe2\x80\xae \xc2\x9b \xff";
    logsafe_escape(out, sizeof out, u, strlen(u));
    CHECK(!strcmp(out, "caf\xc3\xa9 \\u{202e} \\u{009b} \\xff"), "escape unicode: %s", out);
    size_t n = logsafe_escape(out, 5, "ab\ncd", 5);
    CHECK(n == 4 && !strcmp(out, "ab\\n"), "truncation at a whole escape: '%s' %zu", out, n);
    CHECK(!strchr(out, '\n') && !strchr(out, 0x1b), "no raw control byte survives");
}

static void test_node_auth(void) {
    node_auth_key k, k2;
    node_auth_derive(&k, TS_SECRET, strlen(TS_SECRET), NODE_AUTH_LABEL_DECODE_API);
    node_auth_derive(&k2, TS_SECRET, strlen(TS_SECRET), NODE_AUTH_LABEL_REGISTER);
    CHECK(memcmp(k.k, k2.k, 32) != 0, "one key per purpose");
    node_auth_replay *rp = node_auth_replay_new(4);
    long long now = node_auth_now_ms();
    const char *body = "{\"x\":1}";
    node_auth_sig s;
    char err[256];
    CHECK(node_auth_sign(&k, "POST", "/v1/generate", body, 7, now, &s) == 0, "sign");
    CHECK(node_auth_verify(&k, rp, "POST", "/v1/generate", s.time, s.nonce, s.sig, body, 7, now, err, sizeof err) == 0,
          "valid signature: %s", err);
    CHECK(node_auth_verify(&k, rp, "POST", "/v1/generate", s.time, s.nonce, s.sig, body, 7, now, err, sizeof err) == -1 &&
          strstr(err, "replayed"), "replay refused: %s", err);
    CHECK(node_auth_sign(&k, "POST", "/v1/generate", body, 7, now, &s) == 0 &&
          node_auth_verify(&k, rp, "POST", "/v1/generate", s.time, s.nonce, s.sig, "{\"x\":2}", 7, now, err, sizeof err) == -1,
          "altered body refused");
    CHECK(node_auth_verify(&k2, rp, "POST", "/v1/generate", s.time, s.nonce, s.sig, body, 7, now, err, sizeof err) == -1,
          "registration key does not verify a decode-API signature");
    CHECK(node_auth_verify(&k, rp, "POST", "/v1/other", s.time, s.nonce, s.sig, body, 7, now, err, sizeof err) == -1,
          "other path refused");
    node_auth_sign(&k, "POST", "/v1/generate", body, 7, now - NODE_AUTH_WINDOW_MS - 1000, &s);
    CHECK(node_auth_verify(&k, rp, "POST", "/v1/generate", s.time, s.nonce, s.sig, body, 7, now, err, sizeof err) == -1 &&
          strstr(err, "clock"), "stale time refused: %s", err);
    CHECK(node_auth_precheck(NULL, s.nonce, s.sig, now, err, sizeof err) == -1, "missing header refused");
    /* a full cache forgets the oldest nonce and refuses anything not newer */
    node_auth_replay_free(rp);
    rp = node_auth_replay_new(4);
    long long t0 = now - 10000;
    for (int i = 0; i < 5; i++) {
        node_auth_sign(&k, "POST", "/p", "", 0, t0 + i, &s);
        CHECK(node_auth_verify(&k, rp, "POST", "/p", s.time, s.nonce, s.sig, "", 0, now, err, sizeof err) == 0,
              "fill %d: %s", i, err);
    }
    node_auth_sign(&k, "POST", "/p", "", 0, t0, &s);
    CHECK(node_auth_verify(&k, rp, "POST", "/p", s.time, s.nonce, s.sig, "", 0, now, err, sizeof err) == -1 &&
          strstr(err, "older"), "time at the floor refused after eviction: %s", err);
    node_auth_replay_free(rp);
}

/* ==== Processes ==== */

typedef struct {
    pid_t d, o, r, sd, sp;
    int pd, po, pr;
    node_auth_key api, reg;
} ts_env;

static int ts_setup(ts_env *e) {
    mkdir("build", 0755);
    mkdir(TS_DIR, 0755);
    FILE *f = fopen(TS_DIR "/secret", "w");
    fputs(TS_SECRET "\n", f);
    fclose(f);
    node_auth_derive(&e->api, TS_SECRET, strlen(TS_SECRET), NODE_AUTH_LABEL_DECODE_API);
    node_auth_derive(&e->reg, TS_SECRET, strlen(TS_SECRET), NODE_AUTH_LABEL_REGISTER);
    char b[512];
    snprintf(b, sizeof b, "%s", bin());
    /* D: the decode node with a secret; O: one without */
    char *d[] = { b, "serve", "--role", "decode", "-m", "assets/stories260K.gguf", "-t", "1", "--secret-file", TS_DIR "/secret",
                  "--listen", "127.0.0.1:0", "--request-deadline-ms", "8000", "--max-conns-per-ip", "48",
                  "--port-file", TS_DIR "/d.port", NULL };
    if ((e->pd = ts_start(&e->d, d, "d")) <= 0) return -1;
    char *o[] = { b, "serve", "--role", "local", "-m", "assets/stories260K.gguf", "-t", "1", "--listen", "127.0.0.1:0",
                  "--port-file", TS_DIR "/o.port", NULL };
    if ((e->po = ts_start(&e->o, o, "o")) <= 0) return -1;
    f = fopen(TS_DIR "/r.json", "w");
    fprintf(f, "{\"listen\":\"127.0.0.1:0\",\"secret_file\":\"" TS_DIR "/secret\",\"health_interval_ms\":300,"
               "\"heartbeat_ttl_ms\":1500,\"limits\":{\"request_deadline_ms\":8000,\"max_connections_per_ip\":64},"
               "\"nodes\":[{\"role\":\"decode\",\"model\":\"stories\",\"addr\":\"127.0.0.1:%d\"}]}\n", e->pd);
    fclose(f);
    char *r[] = { b, "serve", "--role", "router", "--config", TS_DIR "/r.json", "--port-file", TS_DIR "/r.port", NULL };
    return (e->pr = ts_start(&e->r, r, "r")) > 0 ? 0 : -1;
}

/* The router's status for a node address ("up", "registered"), -1 if absent. */
static int ts_node_flag(int rport, const char *addr, const char *flag) {
    char *body = NULL;
    http_request(rport, &(http_req){ .method = "GET", .path = "/health" }, &body);
    json_t *o = json_loads(body, 0, NULL), *nodes = json_object_get(o, "nodes");
    int v = -1;
    for (size_t i = 0; i < json_array_size(nodes); i++) {
        json_t *n = json_array_get(nodes, i);
        if (!strcmp(json_string_value(json_object_get(n, "addr")) ? json_string_value(json_object_get(n, "addr")) : "", addr))
            v = json_is_true(json_object_get(n, flag));
    }
    json_decref(o);
    free(body);
    return v;
}

/* Anonymous, forged, altered, stale and replayed requests to a decode node. */
static void test_decode_auth(ts_env *e) {
    char *body = NULL;
    http_req q = { .method = "POST", .path = "/v1/generate", .body = ts_gen_body };
    int st = http_request(e->pd, &q, &body);
    CHECK(st == 401 && strstr(body, "X-Tandem-Signature"), "anonymous POST: %d %s", st, body);
    free(body);
    node_auth_key wrong;
    node_auth_derive(&wrong, "not-the-secret", 14, NODE_AUTH_LABEL_DECODE_API);
    q.sign = &wrong;
    st = http_request(e->pd, &q, &body);
    CHECK(st == 401 && strstr(body, "bad X-Tandem-Signature"), "wrong key: %d %s", st, body);
    free(body);
    q.sign = &e->reg;
    st = http_request(e->pd, &q, &body);
    CHECK(st == 401, "registration key on the decode API: %d", st);
    free(body);
    q.sign = &e->api;
    st = http_request(e->pd, &q, &body);
    CHECK(st == 200 && strstr(body, "\"text\""), "signed request: %d %s", st, body);
    free(body);
    node_auth_sig used = q.used;
    http_req rq = { .method = "POST", .path = "/v1/generate", .body = ts_gen_body, .sig = &used };
    st = http_request(e->pd, &rq, &body);
    CHECK(st == 401 && strstr(body, "replayed"), "replayed request: %d %s", st, body);
    free(body);
    /* the captured signature on another body */
    rq.body = "{\"prompt\":\"Something else entirely\",\"max_tokens\":4}";
    st = http_request(e->pd, &rq, &body);
    CHECK(st == 401, "signature moved to another body: %d", st);
    free(body);
    node_auth_sig stale;
    node_auth_sign(&e->api, "POST", "/v1/generate", ts_gen_body, strlen(ts_gen_body),
                   node_auth_now_ms() - NODE_AUTH_WINDOW_MS - 5000, &stale);
    rq.body = ts_gen_body;
    rq.sig = &stale;
    st = http_request(e->pd, &rq, &body);
    CHECK(st == 401 && strstr(body, "clock"), "stale request: %d %s", st, body);
    free(body);
    st = http_request(e->pd, &(http_req){ .method = "GET", .path = "/health" }, &body);
    CHECK(st == 200, "GET /health stays open: %d", st);
    free(body);
}

static int ts_accepted(int lfd) {
    int n = 0, c;
    while ((c = accept(lfd, NULL, NULL)) >= 0) { n++; close(c); }
    return n;
}

static void test_ssrf_and_log(ts_env *e) {
    int lport = 0, lfd = listen_loopback(&lport, 1);   /* counts the connections it gets (the SSRF target) */
    CHECK(lfd >= 0, "listener");
    char req[512], *body = NULL;
    snprintf(req, sizeof req, "{\"prompt\":\"Once upon a time\",\"max_tokens\":2,\"prefill\":\"remote\","
             "\"prefill_node\":\"127.0.0.1:%d\"}", lport);
    http_req q = { .method = "POST", .path = "/v1/generate", .body = req };
    int st = http_request(e->po, &q, &body);
    CHECK(st == 400 && strstr(body, "authenticated router"), "prefill_node at a node without secret: %d %s", st, body);
    free(body);
    st = http_request(e->pd, &q, &body);
    CHECK(st == 401, "anonymous prefill_node at a node with a secret: %d", st);
    free(body);
    sleep_ms(200);
    CHECK(ts_accepted(lfd) == 0, "no connection was made to the named address");
    close(lfd);
    /* a signed request (the router's privilege) naming a hostile string: logged escaped */
    const char *evil = "{\"prompt\":\"Once upon a time\",\"max_tokens\":2,\"prefill\":\"remote\","
                       "\"prefill_node\":\"127.0.0.1:1\\n[forged] tandem decode: all is fine\\u001b[2J\"}";
    http_req s = { .method = "POST", .path = "/v1/generate", .body = evil, .sign = &e->api };
    st = http_request(e->pd, &s, &body);
    CHECK(st == 200 && strstr(body, "fallback_reason"), "signed hostile prefill_node falls back: %d %s", st, body);
    free(body);
    char *log = slurp(TS_DIR "/d.log");
    CHECK(strstr(log, "\\n[forged] tandem decode: all is fine\\x1b[2J") != NULL, "hostile address logged escaped");
    CHECK(!strstr(log, "\n[forged]") && !strchr(log, 0x1b), "no forged line, no ESC in the log");
    free(log);
}

/* ==== Slow clients ==== */

typedef struct { int fd; int closed; } ts_loris;

/* n connections from src addresses 127.0.(first..).1, k per address, each
 * sending a request line and one header line. Each address is in a /24 of
 * its own, so the servers' per-block shares (httpd.h) do not join them. */
static int ts_loris_open(ts_loris *l, int n, int port, int first, int per_addr) {
    int ok = 0;
    for (int i = 0; i < n; i++) {
        char src[32];
        snprintf(src, sizeof src, "127.0.%d.1", first + i / per_addr);
        l[i].fd = connect_from(port, src, 30000);
        l[i].closed = 0;
        const char *start = "POST /v1/completions HTTP/1.1\r\nHost: x\r\n";
        if (l[i].fd >= 0 && send(l[i].fd, start, strlen(start), MSG_NOSIGNAL) > 0) ok++;
    }
    return ok;
}

static void ts_loris_drip(ts_loris *l, int n) {
    for (int i = 0; i < n; i++)
        if (l[i].fd >= 0 && !l[i].closed && send(l[i].fd, "X-Slow: 1\r\n", 11, MSG_NOSIGNAL) < 0) l[i].closed = 1;
}

/* How many the server has closed (EOF or reset), without blocking. */
static int ts_loris_closed(ts_loris *l, int n) {
    int c = 0;
    for (int i = 0; i < n; i++) {
        if (l[i].fd < 0) { c++; continue; }
        struct pollfd p = { .fd = l[i].fd, .events = POLLIN };
        if (!l[i].closed && poll(&p, 1, 0) > 0) {
            char b[256];
            ssize_t r = recv(l[i].fd, b, sizeof b, MSG_DONTWAIT);
            if (r <= 0) l[i].closed = 1;
        }
        c += l[i].closed;
    }
    return c;
}

static void ts_loris_close(ts_loris *l, int n) {
    for (int i = 0; i < n; i++) if (l[i].fd >= 0) close(l[i].fd);
}

/* GET /health latency in ms, or -1 if it did not answer 200. */
static double ts_health_ms(int port) {
    char *body = NULL;
    double t0 = now_ms();
    int st = http_request(port, &(http_req){ .method = "GET", .path = "/health" }, &body);
    free(body);
    return st == 200 ? now_ms() - t0 : -1;
}

static void test_slow_clients(ts_env *e) {
    enum { NR = 200, ND = 64, NFLOOD = 120 };
    static ts_loris lr[NR], ld[ND], fr[NFLOOD], fd_[NFLOOD];
    double t0 = now_ms();
    /* 25 per address: under the per-address caps, so only capacity protects /health */
    int okr = ts_loris_open(lr, NR, e->pr, 2, 25);
    int okd = ts_loris_open(ld, ND, e->pd, 20, 16);
    CHECK(okr == NR && okd == ND, "slow clients connected: router %d/%d, decode %d/%d", okr, NR, okd, ND);
    /* one address flooding: capped at the per-address limit (router 64, decode 48) */
    ts_loris_open(fr, NFLOOD, e->pr, 40, NFLOOD);
    ts_loris_open(fd_, NFLOOD, e->pd, 41, NFLOOD);
    sleep_ms(500);
    int fr_open = NFLOOD - ts_loris_closed(fr, NFLOOD), fd_open = NFLOOD - ts_loris_closed(fd_, NFLOOD);
    CHECK(fr_open <= 64 && fr_open >= 32, "router: one address holds %d connections (cap 64)", fr_open);
    CHECK(fd_open <= 48 && fd_open >= 24, "decode node: one address holds %d connections (cap 48)", fd_open);
    double worst_r = 0, worst_d = 0;
    int gen_ok = 0, dripped = 0;
    char *body = NULL;
    while (now_ms() - t0 < 6500) {
        double hr = ts_health_ms(e->pr), hd = ts_health_ms(e->pd);
        if (hr < 0 || hr > worst_r) worst_r = hr < 0 ? 1e9 : hr;
        if (hd < 0 || hd > worst_d) worst_d = hd < 0 ? 1e9 : hd;
        if (!dripped && now_ms() - t0 > 5000) { ts_loris_drip(lr, NR); ts_loris_drip(ld, ND); dripped = 1; }
        if (!gen_ok) {
            http_req q = { .method = "POST", .path = "/v1/completions",
                         .body = "{\"model\":\"stories\",\"prompt\":\"Once upon a time\",\"max_tokens\":8}" };
            gen_ok = http_request(e->pr, &q, &body) == 200 && strstr(body, "\"finish_reason\":\"length\"");
            free(body);
        }
        sleep_ms(250);
    }
    int still_r = NR - ts_loris_closed(lr, NR), still_d = ND - ts_loris_closed(ld, ND);
    printf("test_security_http: slow clients held %.1f s: router /health worst %.1f ms, decode /health worst %.1f ms, "
           "still open %d/%d and %d/%d\n", (now_ms() - t0) / 1e3, worst_r, worst_d, still_r, NR, still_d, ND);
    CHECK(still_r == NR && still_d == ND, "the slow clients were still connected (%d, %d)", still_r, still_d);
    CHECK(worst_r < 1000, "router /health answered within 1 s throughout (worst %.1f ms)", worst_r);
    CHECK(worst_d < 1000, "decode node /health answered within 1 s throughout (worst %.1f ms)", worst_d);
    CHECK(gen_ok, "a generation through the router completed under the slow clients");
    /* the 8 s whole-request deadline closes every incomplete request */
    while (now_ms() - t0 < 10500 && (ts_loris_closed(lr, NR) < NR || ts_loris_closed(ld, ND) < ND)) sleep_ms(100);
    int cr = ts_loris_closed(lr, NR), cd = ts_loris_closed(ld, ND);
    CHECK(cr == NR && cd == ND, "deadline closed the slow requests: router %d/%d, decode %d/%d after %.1f s", cr, NR, cd, ND,
          (now_ms() - t0) / 1e3);
    ts_loris_close(lr, NR);
    ts_loris_close(ld, ND);
    ts_loris_close(fr, NFLOOD);
    ts_loris_close(fd_, NFLOOD);
}

/* ==== Registration ==== */

static int ts_register(int rport, const node_auth_key *k, const char *body, const node_auth_sig *sig, node_auth_sig *used,
                       char **resp) {
    http_req q = { .method = "POST", .path = "/v1/nodes/register", .body = body, .sign = sig ? NULL : k, .sig = sig };
    int st = http_request(rport, &q, resp);
    if (used) *used = q.used;
    return st;
}

static void test_registration(ts_env *e) {
    char *resp = NULL, body[256], daddr[64];
    snprintf(daddr, sizeof daddr, "127.0.0.1:%d", e->pd);
    int st = ts_register(e->pr, NULL, "{\"role\":\"decode\",\"model\":\"x\",\"addr\":\"127.0.0.1:9\"}", NULL, NULL, &resp);
    CHECK(st == 401, "unsigned registration: %d %s", st, resp);
    free(resp);
    st = ts_register(e->pr, &e->api, "{\"role\":\"decode\",\"model\":\"x\",\"addr\":\"127.0.0.1:9\"}", NULL, NULL, &resp);
    CHECK(st == 401, "registration signed with the decode-API key: %d", st);
    free(resp);
    /* takeover of the static decode node */
    snprintf(body, sizeof body, "{\"role\":\"decode\",\"model\":\"stories\",\"addr\":\"%s\"}", daddr);
    st = ts_register(e->pr, &e->reg, body, NULL, NULL, &resp);
    CHECK(st == 409 && strstr(resp, "configuration"), "registration of a static node: %d %s", st, resp);
    free(resp);
    snprintf(body, sizeof body, "{\"role\":\"decode\",\"model\":\"hijack\",\"addr\":\"%s\"}", daddr);
    st = ts_register(e->pr, &e->reg, body, NULL, NULL, &resp);
    CHECK(st == 409, "renaming a static node by registration: %d", st);
    free(resp);
    sleep_ms(2000);   /* beyond heartbeat_ttl_ms (1500): a hijacked node would now be down */
    CHECK(ts_node_flag(e->pr, daddr, "up") == 1 && ts_node_flag(e->pr, daddr, "registered") == 0,
          "static node still up and still static after the attempts");
    http_req q = { .method = "POST", .path = "/v1/completions", .body = "{\"model\":\"stories\",\"prompt\":\"Once\",\"max_tokens\":2}" };
    st = http_request(e->pr, &q, &resp);
    CHECK(st == 200, "requests still served: %d %s", st, resp);
    free(resp);
    /* a new node; then its registration replayed; a stale one; bad fields */
    const char *nb = "{\"role\":\"prefill\",\"model\":\"stories\",\"addr\":\"127.0.0.1:9\"}";
    node_auth_sig used;
    st = ts_register(e->pr, &e->reg, nb, NULL, &used, &resp);
    CHECK(st == 200, "signed registration of a new node: %d %s", st, resp);
    free(resp);
    CHECK(ts_node_flag(e->pr, "127.0.0.1:9", "registered") == 1, "new node listed as registered");
    st = ts_register(e->pr, NULL, nb, &used, NULL, &resp);
    CHECK(st == 401 && strstr(resp, "replayed"), "replayed registration: %d %s", st, resp);
    free(resp);
    node_auth_sig stale;
    node_auth_sign(&e->reg, "POST", "/v1/nodes/register", nb, strlen(nb), node_auth_now_ms() + NODE_AUTH_WINDOW_MS + 60000, &stale);
    st = ts_register(e->pr, NULL, nb, &stale, NULL, &resp);
    CHECK(st == 401, "future-dated registration: %d %s", st, resp);
    free(resp);
    st = ts_register(e->pr, &e->reg, "{\"role\":\"decode\",\"model\":\"m\\n[forged]\",\"addr\":\"127.0.0.1:8\"}", NULL, NULL, &resp);
    CHECK(st == 400, "control characters in a registration: %d %s", st, resp);
    free(resp);
    char *log = slurp(TS_DIR "/r.log");
    CHECK(!strstr(log, "\n[forged]"), "no forged router log line");
    free(log);
}

/* `serve --role decode|prefill --router URL` registers by itself. */
static void test_self_registration(ts_env *e) {
    char b[512], url[64];
    snprintf(b, sizeof b, "%s", bin());
    snprintf(url, sizeof url, "http://127.0.0.1:%d", e->pr);
    char *sd[] = { b, "serve", "--role", "decode", "-m", "assets/stories260K.gguf", "-t", "1", "--secret-file", TS_DIR "/secret",
                   "--listen", "127.0.0.1:0", "--router", url, "--model-name", "selfreg", "--port-file", TS_DIR "/sd.port", NULL };
    int sdp = ts_start(&e->sd, sd, "sd");
    char *sp[] = { b, "serve", "--role", "prefill", "-m", "assets/stories260K.gguf", "-t", "1", "--secret-file", TS_DIR "/secret",
                   "--listen", "127.0.0.1:0", "--router", url, "--model-name", "selfreg", "--port-file", TS_DIR "/sp.port", NULL };
    int spp = ts_start(&e->sp, sp, "sp");
    char daddr[64], paddr[64], *resp = NULL;
    snprintf(daddr, sizeof daddr, "127.0.0.1:%d", sdp);
    snprintf(paddr, sizeof paddr, "127.0.0.1:%d", spp);
    int listed = 0, up = 0;
    for (int i = 0; i < 100 && !(listed && up); i++) {
        http_request(e->pr, &(http_req){ .method = "GET", .path = "/v1/models" }, &resp);
        listed = strstr(resp, "\"selfreg\"") != NULL;
        free(resp);
        up = ts_node_flag(e->pr, daddr, "up") == 1 && ts_node_flag(e->pr, paddr, "up") == 1;
        sleep_ms(100);
    }
    CHECK(listed, "self-registered decode node's model in /v1/models");
    CHECK(up && ts_node_flag(e->pr, daddr, "registered") == 1, "self-registered decode and prefill nodes are up");
    http_req q = { .method = "POST", .path = "/v1/completions",
                 .body = "{\"model\":\"selfreg\",\"prompt\":\"Once upon a time there was\",\"max_tokens\":4}" };
    int st = http_request(e->pr, &q, &resp);
    CHECK(st == 200 && strstr(resp, "\"finish_reason\":\"length\""), "request through the router to it: %d %s", st, resp);
    free(resp);
    sleep_ms(2000);   /* heartbeats keep it up beyond heartbeat_ttl_ms */
    CHECK(ts_node_flag(e->pr, daddr, "up") == 1, "still up after heartbeat_ttl_ms");
    CHECK(stop_proc(e->sd, 10000) == 0 && stop_proc(e->sp, 10000) == 0, "self-registering nodes stop cleanly");
    e->sd = e->sp = 0;
}

/* ==== Half-close, oversized prompts ==== */

static void test_half_close(ts_env *e) {
    const char *bodies[2] = { "{\"model\":\"stories\",\"prompt\":\"Once upon a time\",\"max_tokens\":32}",
                              "{\"model\":\"stories\",\"prompt\":\"Once upon a time\",\"max_tokens\":32,\"stream\":true}" };
    for (int s = 0; s < 2; s++) {
        char *resp = NULL;
        http_req q = { .method = "POST", .path = "/v1/completions", .body = bodies[s], .half_close = 1 };
        int st = http_request(e->pr, &q, &resp);
        CHECK(st == 200 && (s ? strstr(resp, "[DONE]") != NULL : strstr(resp, "\"finish_reason\":\"length\"") != NULL),
              "router, half-closed client, %s: %d %s", s ? "stream" : "no stream", st, resp);
        free(resp);
        const char *nb = s ? "{\"prompt\":\"Once upon a time\",\"max_tokens\":32,\"stream\":true}"
                           : "{\"prompt\":\"Once upon a time\",\"max_tokens\":32}";
        http_req d = { .method = "POST", .path = "/v1/generate", .body = nb, .sign = &e->api, .half_close = 1 };
        st = http_request(e->pd, &d, &resp);
        CHECK(st == 200 && strstr(resp, "\"finish_reason\":\"length\""), "decode node, half-closed client, %s: %d %s",
              s ? "stream" : "no stream", st, resp);
        free(resp);
    }
}

static void test_big_prompt(ts_env *e) {
    size_t n = 8u << 20;
    char *big = malloc(n + 64);
    int off = sprintf(big, "{\"max_tokens\":1,\"prompt\":\"");
    for (size_t i = 0; i < n - 64; i += 2) { big[off + i] = 'a'; big[off + i + 1] = ' '; }
    strcpy(big + off + n - 64, "\"}");
    char *resp = NULL;
    http_req q = { .method = "POST", .path = "/v1/generate", .body = big };
    double t0 = now_ms(), cpu0 = cpu_ms(e->o);
    int st = http_request(e->po, &q, &resp);
    double ms = now_ms() - t0, cpu = cpu_ms(e->o) - cpu0;
    printf("test_security_http: 8 MiB prompt refused in %.0f ms (node CPU %.0f ms)\n", ms, cpu);
    CHECK(st == 400 && strstr(resp, "context"), "8 MiB prompt: %d %.200s", st, resp);
    /* The node's own CPU time, not wall time: a loaded machine stretches the
     * transfer, but tokenizing 4 M words would cost the node seconds of CPU. */
    CHECK(cpu >= 0 && cpu < 1000, "refused after %.0f ms of node CPU (before tokenizing it whole)", cpu);
    free(resp);
    free(big);
}

int main(void) {
    signal(SIGPIPE, SIG_IGN);
    test_logsafe();
    test_node_auth();
    /* both are part of every build (the binary) and checkout (the model): a
     * missing one fails rather than dropping the process tests */
    int have_bin = access(bin(), X_OK) == 0, have_model = access("assets/stories260K.gguf", R_OK) == 0;
    CHECK(have_bin, "tandem binary %s not executable (set TANDEM_BIN)", bin());
    CHECK(have_model, "assets/stories260K.gguf missing (part of the repository)");
    if (!have_bin || !have_model) return t_done("test_security_http");
    ts_env e;
    memset(&e, 0, sizeof e);
    double t0 = now_ms();
    if (ts_setup(&e) == 0) {
        test_decode_auth(&e);
        test_ssrf_and_log(&e);
        test_half_close(&e);
        test_big_prompt(&e);
        test_registration(&e);
        test_self_registration(&e);
        test_slow_clients(&e);
    }
    CHECK(stop_proc(e.r, 10000) == 0, "router exits cleanly");
    CHECK(stop_proc(e.d, 10000) == 0, "decode node exits cleanly");
    CHECK(stop_proc(e.o, 10000) == 0, "open decode node exits cleanly");
    stop_proc(e.sd, 10000);
    stop_proc(e.sp, 10000);
    fprintf(stderr, "test_security_http: %.1f s\n", (now_ms() - t0) / 1e3);
    return t_done("test_security_http");
}

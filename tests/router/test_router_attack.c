/* test_router_attack.c - the router under the attacks of issue 39 (its
 * router-side items), each against a real router and a real decode node
 * with a shared secret, bounded in time:
 *   - item 1: /tokenize bodies past what the node's context can hold are
 *     refused unread (413), and /tokenize counts against max_concurrent
 *     (429 with Retry-After while generation requests hold it);
 *   - item 8: twenty slow streams from one client address through the
 *     router take at most the node's --client-share of its slots and queue
 *     (the router names the client in X-Tandem-Client), while another
 *     address (127.0.0.2) is served;
 *   - item 5: a node table filled with signed registrations empties itself
 *     at heartbeat expiry, after which a new registration succeeds;
 *   - item 6: registration addresses are HOST:PORT only; link-local and
 *     unspecified addresses are refused, and with registration_addresses
 *     "private" every public address and every name;
 *   - item 7: /detokenize of 100k ids answers 200 with the content;
 *   - item 2, the router's own share: 100 slow connections from one
 *     address keep at most max_connections_per_ip (64 by default).
 * The node runs stories260K (assets/), so nothing here needs fixtures. */
#include "proc.h"

#include <pthread.h>
#include <sys/stat.h>

#include "base/strbuf.h"

#define TA_DIR "build/test_router_attack.d"
#define TA_SECRET "router-attack-secret-41c9-5f0c2a9e7b1d4c3a8e6f9b2d1c0a7e5f"
/* The node's context: 2048 tokens, so /tokenize may carry 2048 x 24 bytes
 * + 64 KiB = 114,688 (router_endpoints.c RT_TOK_BODY_PER_TOKEN). */
#define TA_NCTX "2048"
#define TA_TOK_CAP (2048 * 24 + (64 << 10))

static node_auth_key ta_api_key, ta_reg_key;

/* ==== Helpers ==== */

/* A JSON request to the router from address src (NULL: 127.0.0.1); the
 * status, the body in *body. */
static int ta_post_from(int port, const char *src, const char *path, const char *req, char **body) {
    int fd = connect_from(port, src, 60000);
    *body = NULL;
    if (fd < 0) return -1;
    int st = http_send(fd, "POST", path, req) ? -1 : http_read(fd, body);
    close(fd);
    return st;
}

/* A signed registration of addr; the status, the body in *body. */
static int ta_register(int port, const char *addr, char **body) {
    char req[256];
    snprintf(req, sizeof req, "{\"role\":\"decode\",\"model\":\"stories\",\"addr\":\"%s\"}", addr);
    sign_key = &ta_reg_key;
    int st = http(port, "POST", "/v1/nodes/register", req, body);
    sign_key = NULL;
    return st;
}

/* The node's /v1/stats (signed): slots busy plus requests queued, or -1. */
static int ta_node_load(int port) {
    char *body = NULL;
    sign_key = &ta_api_key;
    int st = http(port, "GET", "/v1/stats", NULL, &body);
    sign_key = NULL;
    json_t *o = st == 200 && body ? json_loads(body, 0, NULL) : NULL;
    int n = o ? (int)(jint(o, "slots_busy", NULL) + jint(o, "queued", NULL)) : -1;
    json_decref(o);
    free(body);
    return n;
}

/* Waits until the node runs nothing (at most 30 s). */
static void ta_wait_idle(int port) {
    for (double t0 = now_ms(); now_ms() - t0 < 30000 && ta_node_load(port) != 0; sleep_ms(50)) {}
}

/* A router's /health "active_requests", or -1. */
static int ta_router_active(int port) {
    char *body = NULL;
    int st = http(port, "GET", "/health", NULL, &body);
    json_t *o = st == 200 && body ? json_loads(body, 0, NULL) : NULL;
    int n = o ? (int)jint(o, "active_requests", NULL) : -1;
    json_decref(o);
    free(body);
    return n;
}

/* A long streamed completion sent from src and left unread: the socket. */
static int ta_open_slow(int port, const char *src) {
    const char *req = "{\"model\":\"stories\",\"prompt\":\"Once upon a time\",\"max_tokens\":1900,\"ignore_eos\":true,\"stream\":true}";
    int fd = connect_from(port, src, 60000);
    if (fd >= 0 && http_send(fd, "POST", "/v1/completions", req)) { close(fd); fd = -1; }
    return fd;
}

/* ==== Item 1: /tokenize bounded by the context and by max_concurrent ==== */

static void test_tokenize_bounds(int rport, int r2port, int nport) {
    char *body = NULL;
    int st = ta_post_from(rport, NULL, "/tokenize", "{\"content\":\"Once upon a time\"}", &body);
    CHECK(st == 200 && body && strstr(body, "\"tokens\""), "small /tokenize: 200 with tokens (%d %.200s)", st, body ? body : "");
    free(body);
    /* a body just past the context's bound, sent whole: refused by size */
    size_t n = TA_TOK_CAP + 1000;
    char *big = malloc(n + 1);
    memcpy(big, "{\"content\":\"", 12);
    memset(big + 12, 'a', n - 14);
    memcpy(big + n - 2, "\"}", 3);
    double t0 = now_ms();
    st = ta_post_from(rport, NULL, "/tokenize", big, &body);
    double ms = now_ms() - t0;
    CHECK(st == 413 && body && strstr(body, "request_too_large") && strstr(body, "context"),
          "/tokenize of %zu bytes (cap %d): 413 for the context (%d %.200s)", n, TA_TOK_CAP, st, body ? body : "");
    printf("test_router_attack: /tokenize of %zu bytes: %d in %.0f ms\n", n, st, ms);
    free(body);
    free(big);
    /* a declared 8 MB body: refused before any of it is read */
    int fd = http_connect(rport);
    char head[256];
    snprintf(head, sizeof head, "POST /tokenize HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                                "Content-Length: %d\r\nConnection: close\r\n\r\n", 8 << 20);
    t0 = now_ms();
    st = fd >= 0 && send(fd, head, strlen(head), MSG_NOSIGNAL) > 0 ? http_read(fd, &body) : -1;
    ms = now_ms() - t0;
    CHECK(st == 413 && ms < 2000, "/tokenize declaring 8 MB: 413 unread in %.0f ms (%d)", ms, st);
    free(body);
    body = NULL;
    if (fd >= 0) close(fd);
    /* /detokenize is not bounded by the context: its reply is the big part */
    /* max_concurrent: router 2 allows 2; two long streams hold it */
    int s1 = ta_open_slow(r2port, NULL), s2 = ta_open_slow(r2port, NULL);
    for (t0 = now_ms(); now_ms() - t0 < 10000 && ta_router_active(r2port) < 2; sleep_ms(10)) {}
    char *raw = NULL;
    st = http_raw(r2port, "POST", "/tokenize", NULL, "{\"content\":\"Once upon a time\"}", &raw);
    char ra[16];
    http_header(raw ? raw : "", "Retry-After", ra, sizeof ra);
    CHECK(st == 429 && ra[0] && raw && strstr(raw, "too_many_requests"),
          "/tokenize past max_concurrent 2: 429 with Retry-After \"%s\" (%d)", ra, st);
    free(raw);
    raw = NULL;
    st = http_raw(r2port, "POST", "/detokenize", NULL, "{\"tokens\":[1,2,3]}", &raw);
    CHECK(st == 429, "/detokenize past max_concurrent 2: 429 (%d)", st);
    free(raw);
    if (s1 >= 0) close(s1);
    if (s2 >= 0) close(s2);
    for (t0 = now_ms(); now_ms() - t0 < 30000 && ta_router_active(r2port) != 0; sleep_ms(50)) {}
    st = ta_post_from(r2port, NULL, "/tokenize", "{\"content\":\"Once upon a time\"}", &body);
    CHECK(st == 200, "/tokenize once the streams ended: 200 (%d)", st);
    free(body);
    ta_wait_idle(nport);
}

/* ==== Item 7: /detokenize of 100k ids ==== */

static void test_detokenize_big(int rport) {
    enum { N = 100000 };
    strbuf b = {0};
    strbuf_puts(&b, "{\"tokens\":[");
    for (int i = 0; i < N; i++) strbuf_printf(&b, "%s%d", i ? "," : "", 100 + i % 300);
    strbuf_puts(&b, "]}");
    char *body = NULL;
    double t0 = now_ms();
    int st = b.p ? ta_post_from(rport, NULL, "/detokenize", b.p, &body) : -1;
    double ms = now_ms() - t0;
    json_t *o = st == 200 && body ? json_loads(body, 0, NULL) : NULL;
    const char *content = o ? jstr(o, "content", NULL) : NULL;
    CHECK(st == 200 && content && strlen(content) > N, "/detokenize of %d ids (%zu bytes): 200 with %zu bytes of content (%d)",
          N, b.len, content ? strlen(content) : 0, st);
    printf("test_router_attack: /detokenize of %d ids: %d, %zu bytes of content in %.0f ms\n", N, st,
           content ? strlen(content) : 0, ms);
    json_decref(o);
    free(body);
    free(b.p);
}

/* ==== Item 8: one client's share of the node's slots ==== */

static void test_client_share(int rport, int nport) {
    enum { NA = 20, NB = 5 };
    int fds[NA];
    for (int i = 0; i < NA; i++) fds[i] = ta_open_slow(rport, "127.0.0.1");
    /* the node's load while A's streams run: at most its share of 4 slots + 16 queued */
    int peak = 0;
    for (double t0 = now_ms(); now_ms() - t0 < 1500; sleep_ms(20)) {
        int l = ta_node_load(nport);
        if (l > peak) peak = l;
    }
    /* meanwhile client B, from another address */
    int b_ok = 0;
    double worst = 0;
    for (int i = 0; i < NB; i++) {
        char *body = NULL;
        double t0 = now_ms();
        int st = ta_post_from(rport, "127.0.0.2", "/v1/completions", "{\"model\":\"stories\",\"prompt\":\"Once\",\"max_tokens\":4}", &body);
        double ms = now_ms() - t0;
        if (ms > worst) worst = ms;
        b_ok += st == 200;
        if (st != 200) fprintf(stderr, "client B answer %d: %.200s\n", st, body ? body : "");
        free(body);
    }
    int l = ta_node_load(nport);
    if (l > peak) peak = l;
    int a_ok = 0, a_429 = 0;
    for (int i = 0; i < NA; i++) {
        char *body = NULL;
        int st = fds[i] >= 0 ? http_read(fds[i], &body) : -1;
        a_ok += st == 200;
        a_429 += st == 429;
        free(body);
        if (fds[i] >= 0) close(fds[i]);
    }
    printf("test_router_attack: 20 slow streams from one address: node load peaked at %d, %d served, %d refused (429); "
           "another address %d of %d served (slowest %.0f ms)\n", peak, a_ok, a_429, b_ok, NB, worst);
    CHECK(peak >= 1 && peak <= 11, "the node's load stayed within one client's share (10) plus B's one: peak %d", peak);
    CHECK(a_ok <= 10 && a_429 >= NA - 10 && a_ok + a_429 == NA, "one address held to its share: %d served, %d refused",
          a_ok, a_429);
    CHECK(b_ok == NB, "another address served while one holds its share: %d of %d", b_ok, NB);
    ta_wait_idle(nport);
}

/* ==== The router's per-address connection share ==== */

/* 100 connections from one address, each holding half a request: the
 * router keeps at most max_connections_per_ip (default a 16th of 1024:
 * 64) and serves another address meanwhile. */
static void test_conn_share(int rport) {
    enum { N = 100 };
    int fds[N], opened = 0, open_now = 0;
    for (int i = 0; i < N; i++) {
        fds[i] = connect_from(rport, "127.0.0.9", 2000);
        if (fds[i] >= 0 && send(fds[i], "POST /v1/completions HTTP/1.1\r\nHost: x\r\n", 40, MSG_NOSIGNAL) != 40) {
            close(fds[i]);
            fds[i] = -1;
        }
        opened += fds[i] >= 0;
    }
    sleep_ms(300);
    for (int i = 0; i < N; i++) {
        char c;
        if (fds[i] < 0) continue;
        ssize_t r = recv(fds[i], &c, 1, MSG_PEEK | MSG_DONTWAIT);
        open_now += r < 0 && (errno == EAGAIN || errno == EWOULDBLOCK);   /* nothing to read and not closed */
    }
    char *body = NULL;
    double t0 = now_ms();
    int st = ta_post_from(rport, "127.0.0.2", "/v1/completions", "{\"model\":\"stories\",\"prompt\":\"Once\",\"max_tokens\":4}", &body);
    double ms = now_ms() - t0;
    free(body);
    printf("test_router_attack: 100 slow connections from one address: %d connected, %d kept open; another address %d in %.0f ms\n",
           opened, open_now, st, ms);
    CHECK(open_now <= 64 && open_now >= 32, "one address held to its connection share: %d of %d kept (share 64)", open_now, N);
    CHECK(st == 200 && ms < 5000, "another address served meanwhile: %d in %.0f ms", st, ms);
    for (int i = 0; i < N; i++) if (fds[i] >= 0) close(fds[i]);
}

/* ==== Item 6: registration addresses ==== */

static void ta_expect_refused(int port, const char *addr, const char *why) {
    char *body = NULL;
    int st = ta_register(port, addr, &body);
    CHECK(st == 400 && body && strstr(body, "Bad registration") && strstr(body, why),
          "registration of \"%s\": 400 \"%s\" (%d %.200s)", addr, why, st, body ? body : "");
    free(body);
}

static void test_reg_addresses(int rport, int r2port) {
    ta_expect_refused(rport, "127.0.0.1:80/admin?x=:1", "HOST:PORT only");
    ta_expect_refused(rport, "127.0.0.1:80/admin", "port of 1-65535");
    ta_expect_refused(rport, "127.0.0.1/admin:80", "HOST:PORT only");
    ta_expect_refused(rport, "127.0.0.1?x:80", "HOST:PORT only");
    ta_expect_refused(rport, "127.0.0.1#x:80", "HOST:PORT only");
    ta_expect_refused(rport, "user@127.0.0.1:80", "HOST:PORT only");
    ta_expect_refused(rport, "user:pw@127.0.0.1:80", "HOST:PORT only");
    ta_expect_refused(rport, "127.0.0.1 :80", "\\\"addr\\\" must be HOST:PORT");
    ta_expect_refused(rport, "127.0.0.1:0", "port of 1-65535");
    ta_expect_refused(rport, "127.0.0.1:65536", "port of 1-65535");
    ta_expect_refused(rport, "169.254.169.254:80", "link-local");
    ta_expect_refused(rport, "[fe80::1]:80", "link-local");
    ta_expect_refused(rport, "[::ffff:169.254.169.254]:80", "link-local");
    ta_expect_refused(rport, "0.0.0.0:80", "unspecified");
    ta_expect_refused(rport, "[::]:80", "unspecified");
    ta_expect_refused(rport, "fe80::1:80", "HOST:PORT only");
    /* "private": public addresses and names refused, loopback and private ones taken */
    ta_expect_refused(r2port, "8.8.8.8:80", "loopback or private");
    ta_expect_refused(r2port, "[2001:db8::1]:80", "loopback or private");
    ta_expect_refused(r2port, "example.com:80", "loopback or private");
    char *body = NULL;
    int st = ta_register(r2port, "127.0.0.7:9", &body);
    CHECK(st == 200, "registration of 127.0.0.7:9 under \"private\": 200 (%d %.200s)", st, body ? body : "");
    free(body);
    st = ta_register(r2port, "10.1.2.3:9", &body);
    CHECK(st == 200, "registration of 10.1.2.3:9 under \"private\": 200 (%d %.200s)", st, body ? body : "");
    free(body);
}

/* ==== Item 5: expired registrations removed ==== */

/* Registered nodes in a router's /health, or -1. */
static int ta_registered(int port) {
    char *body = NULL;
    int st = http(port, "GET", "/health", NULL, &body);
    json_t *o = st == 200 && body ? json_loads(body, 0, NULL) : NULL;
    json_t *a = json_object_get(o, "nodes");
    int n = json_is_array(a) ? 0 : -1;
    for (size_t i = 0; json_is_array(a) && i < json_array_size(a); i++)
        n += json_is_true(json_object_get(json_array_get(a, i), "registered"));
    json_decref(o);
    free(body);
    return n;
}

static void test_reg_expiry(int rport) {
    /* the static decode node holds one entry of 64: 63 registrations fill the table */
    int ok = 0;
    char addr[64], *body = NULL;
    for (int i = 0; i < 63; i++) {
        snprintf(addr, sizeof addr, "127.0.3.%d:%d", 1 + i, 20000 + i);
        int st = ta_register(rport, addr, &body);
        ok += st == 200;
        free(body);
    }
    CHECK(ok == 63, "63 signed registrations fill the table: %d answered 200", ok);
    int st = ta_register(rport, "127.0.4.1:20100", &body);
    CHECK(st == 503 && body && strstr(body, "Node table full"), "the 64th: 503 table full (%d %.200s)", st, body ? body : "");
    free(body);
    /* heartbeat_ttl_ms 1500, health every 200 ms: gone within about 2 s */
    double t0 = now_ms();
    int left = 63;
    while (now_ms() - t0 < 10000 && (left = ta_registered(rport)) > 0) sleep_ms(100);
    printf("test_router_attack: 63 expired registrations removed after %.0f ms\n", now_ms() - t0);
    CHECK(left == 0, "expired registrations removed from the table: %d left", left);
    st = ta_register(rport, "127.0.4.1:20100", &body);
    CHECK(st == 200, "a new registration once they expired: 200 (%d %.200s)", st, body ? body : "");
    free(body);
    char *sbody = NULL;
    st = ta_post_from(rport, NULL, "/v1/completions", "{\"model\":\"stories\",\"prompt\":\"Once\",\"max_tokens\":4}", &sbody);
    CHECK(st == 200, "the static node still serves after the churn: %d", st);
    free(sbody);
}

/* A registration_addresses value other than "any" or "private": the
 * router refuses to start (exit 2) with the key's name. */
static void test_bad_policy(void) {
    write_text(TA_DIR "/bad.json", "{\"listen\":\"127.0.0.1:0\",\"secret\":\"0f1e2d3c4b5a69788796a5b4c3d2e1f00f1e2d3c4b5a69788796a5b4c3d2e1f0\",\"registration_addresses\":\"public\"}\n");
    char *a[] = { (char *)bin(), "serve", "--role", "router", "--config", TA_DIR "/bad.json", NULL };
    pid_t pid = spawn_log(a, TA_DIR "/bad.log", 1);
    int st = -1, code = -1;
    for (double t0 = now_ms(); now_ms() - t0 < 10000; sleep_ms(20))
        if (waitpid(pid, &st, WNOHANG) == pid) { code = WIFEXITED(st) ? WEXITSTATUS(st) : -1; break; }
    if (code < 0) stop_proc(pid, 1000);
    char *log = read_text(TA_DIR "/bad.log");
    CHECK(code == 2 && log && strstr(log, "registration_addresses"), "registration_addresses \"public\": exit %d (%.200s)",
          code, log ? log : "");
    free(log);
}

int main(void) {
    signal(SIGPIPE, SIG_IGN);
    mkdir("build", 0755);
    mkdir(TA_DIR, 0755);
    write_text(TA_DIR "/secret", TA_SECRET "\n");
    node_auth_derive(&ta_api_key, TA_SECRET, strlen(TA_SECRET), NODE_AUTH_LABEL_DECODE_API);
    node_auth_derive(&ta_reg_key, TA_SECRET, strlen(TA_SECRET), NODE_AUTH_LABEL_REGISTER);
    test_bad_policy();
    int tmo = asan() ? 60000 : 20000;
    char *nargv[] = { (char *)bin(), "serve", "--role", "decode", "-m", "assets/stories260K.gguf", "-t", "1", "-c", TA_NCTX,
                      "--parallel", "4", "--queue", "16", "--client-share", "50", "--secret-file", TA_DIR "/secret",
                      "--listen", "127.0.0.1:0", "--port-file", TA_DIR "/d.port", NULL };
    pid_t np = 0, r1 = 0, r2 = 0;
    int nport = start_named(&np, nargv, TA_DIR, "d", 1, tmo), rport = -1, r2port = -1;
    if (nport > 0) {
        char cfg[1024];
        snprintf(cfg, sizeof cfg,
                 "{\"listen\":\"127.0.0.1:0\",\"secret_file\":\"" TA_DIR "/secret\",\"health_interval_ms\":200,"
                 "\"heartbeat_ttl_ms\":1500,\"limits\":{\"max_tokens\":2000},"
                 "\"nodes\":[{\"role\":\"decode\",\"model\":\"stories\",\"addr\":\"127.0.0.1:%d\"}]}\n", nport);
        write_text(TA_DIR "/r1.json", cfg);
        snprintf(cfg, sizeof cfg,
                 "{\"listen\":\"127.0.0.1:0\",\"secret_file\":\"" TA_DIR "/secret\",\"health_interval_ms\":200,"
                 "\"registration_addresses\":\"private\",\"heartbeat_ttl_ms\":60000,"
                 "\"limits\":{\"max_tokens\":2000,\"max_concurrent\":2},"
                 "\"nodes\":[{\"role\":\"decode\",\"model\":\"stories\",\"addr\":\"127.0.0.1:%d\"}]}\n", nport);
        write_text(TA_DIR "/r2.json", cfg);
        char *a1[] = { (char *)bin(), "serve", "--role", "router", "--config", TA_DIR "/r1.json", "--port-file", TA_DIR "/r1.port", NULL };
        char *a2[] = { (char *)bin(), "serve", "--role", "router", "--config", TA_DIR "/r2.json", "--port-file", TA_DIR "/r2.port", NULL };
        rport = start_named(&r1, a1, TA_DIR, "r1", 1, tmo);
        r2port = start_named(&r2, a2, TA_DIR, "r2", 1, tmo);
    }
    if (rport > 0 && r2port > 0) {
        test_tokenize_bounds(rport, r2port, nport);
        test_detokenize_big(rport);
        test_client_share(rport, nport);
        test_conn_share(rport);
        test_reg_addresses(rport, r2port);
        test_reg_expiry(rport);
    }
    CHECK(stop_proc(r1, 5000) == 0, "router r1 stops cleanly");
    CHECK(stop_proc(r2, 5000) == 0, "router r2 stops cleanly");
    CHECK(stop_proc(np, 5000) == 0, "decode node stops cleanly");
    return t_done("test_router_attack");
}

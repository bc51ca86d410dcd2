/* test_router_ops.c - what an operator meets (issue 40), on real processes:
 *   - configuration refused, not corrected: ports outside 1..65535 (router
 *     --listen, --decode, a config node, decode --listen and
 *     --prefill-node), one node under two model names, weak secrets (short,
 *     repetitive; file, environment and config), each named on stderr with
 *     exit 2; the entropy rule in-process (cliopt_check_secret);
 *   - a router whose secret its decode node does not share (or that has
 *     none for a node that has one) stops at start-up with one message;
 *   - a router on 0.0.0.0 without an API key warns loudly; with one, not;
 *   - with an API key, /health answers everyone but lists nodes only to
 *     a caller with the key; /metrics is open unless --metrics-auth;
 *   - graceful drain: a stream in flight through the router when the
 *     router (and separately the decode node) gets SIGTERM: the whole
 *     answer with a long --drain-timeout, an error event and [DONE] with a
 *     short one, never a silent cut; new connections are refused while
 *     draining; a draining registered node deregisters at once.
 * The drain parts need a model slow enough for a stream to be in flight
 * (qwen3-mini-Q8_0 from the fixture set, one thread: ~600 tokens/s here).
 */
#include "t.h"
#include "proc.h"

#include <poll.h>

#include "base/cliopt.h"

#define TO_DIR "build/test_router_ops.d"
/* 64 hex characters: 32 bytes (what `openssl rand -hex 32` writes) */
#define TO_SECRET "8c1f0e7d2b6a59487f3e1d0c9b8a7f6e5d4c3b2a1908f7e6d5c4b3a291807f6e"
#define TO_OTHER "0a9b8c7d6e5f40312213041526374859a6b7c8d9eaf0b1c2d3e4f5061728394a"

static const char *g_stories = "assets/stories260K.gguf";
static char g_qwen[512];

/* ==== Helpers ==== */

/* Runs argv to its end with its output in TO_DIR/name.log: the exit
 * status; *log gets the log text (malloc'd). */
static int to_run(char *const argv[], const char *name, char **log) {
    char path[256];
    snprintf(path, sizeof path, TO_DIR "/%s.log", name);
    pid_t pid = spawn_log(argv, path, 1);
    int rc = wait_exit(pid, 60000);
    *log = slurp(path);
    if (!*log) *log = strdup("");
    return rc;
}

static int to_start(pid_t *pid, char *const argv[], const char *name) {
    return start_named(pid, argv, TO_DIR, name, 1, 60000);
}

static void to_port_arg(char *out, size_t n, const char *model, int port) {
    snprintf(out, n, "%s=127.0.0.1:%d", model, port);
}

/* ==== Configuration refused ==== */

static void test_secret_rule(void) {
    char err[400];
    CHECK(!cliopt_check_secret(TO_SECRET, 64, err, sizeof err), "64 hex characters pass: %s", err);
    const char *b64 = "q83vEjRWeJq83vEjRWeJq83vEjRWeJq83vEjRWeJ+/0=";   /* 44 base64 characters: 32 bytes */
    CHECK(!cliopt_check_secret(b64, strlen(b64), err, sizeof err), "44 base64 characters pass: %s", err);
    CHECK(cliopt_check_secret("0123456789abcdef0123456789abcdef", 32, err, sizeof err) && strstr(err, "16 bytes"),
          "32 hex characters are 16 bytes: %s", err);
    CHECK(cliopt_check_secret("correct-horse-battery-staple", 28, err, sizeof err) && strstr(err, "at least 32"),
          "a short passphrase is refused: %s", err);
    char same[65];
    memset(same, 'a', 64);
    same[64] = 0;
    CHECK(cliopt_check_secret(same, 64, err, sizeof err) && strstr(err, "repeats"), "one character: %s", err);
    const char *ab = "abababababababababababababababababababababababababababababababab";
    CHECK(cliopt_check_secret(ab, strlen(ab), err, sizeof err) && strstr(err, "repeats"), "two characters: %s", err);
    const char *txt = "Our cluster's secret: the 3 ravens fly at 04:00 over Oslo!";   /* 58 bytes of text */
    CHECK(!cliopt_check_secret(txt, strlen(txt), err, sizeof err), "a long passphrase with spaces passes: %s", err);
    CHECK(!cliopt_check_hostport("--listen", "127.0.0.1:0", 1, err, sizeof err) &&
          cliopt_check_hostport("--decode", "127.0.0.1:0", 0, err, sizeof err) &&
          cliopt_check_hostport("--listen", "127.0.0.1:65536", 1, err, sizeof err) &&
          cliopt_check_hostport("--listen", "127.0.0.1:99999999999", 1, err, sizeof err) &&
          cliopt_check_hostport("--listen", "127.0.0.1:-1", 1, err, sizeof err) &&
          !cliopt_check_hostport("--listen", "[::1]:65535", 0, err, sizeof err),
          "port rules: %s", err);
}

static void test_refusals(void) {
    const char *b = bin();
    char *log;
    write_text(TO_DIR "/weak", "hunter2\n");
    write_text(TO_DIR "/same", "0000000000000000000000000000000000000000000000000000000000000000\n");
    write_text(TO_DIR "/good", TO_SECRET "\n");
    struct { const char *name, *want; char *argv[16]; } c[] = {
        {"listen_port", "port 70000 of '127.0.0.1:70000' is not within 0-65535",
         {(char *)b, "serve", "--role", "router", "--listen", "127.0.0.1:70000", "--decode", "m=127.0.0.1:9", NULL}},
        {"decode_port", "127.0.0.1:65536: \"addr\" must be HOST:PORT with a port of 1-65535",
         {(char *)b, "serve", "--role", "router", "--listen", "127.0.0.1:0", "--decode", "m=127.0.0.1:65536", NULL}},
        {"decode_port0", "port of 1-65535",
         {(char *)b, "serve", "--role", "router", "--listen", "127.0.0.1:0", "--decode", "m=127.0.0.1:0", NULL}},
        {"node_twice", "decode node 127.0.0.1:9 is listed twice (as model \"a\" and \"b\")",
         {(char *)b, "serve", "--role", "router", "--decode", "a=127.0.0.1:9", "--decode", "b=127.0.0.1:9", NULL}},
        {"router_weak", "the shared secret in " TO_DIR "/weak: it holds 5 bytes (7 base64 characters); at least 32",
         {(char *)b, "serve", "--role", "router", "--secret-file", TO_DIR "/weak", NULL}},
        {"router_same", "repeats itself",
         {(char *)b, "serve", "--role", "router", "--secret-file", TO_DIR "/same", NULL}},
        {"dn_listen", "--listen: port 65537",
         {(char *)b, "serve", "--role", "decode", "-m", (char *)g_stories, "--listen", "127.0.0.1:65537", NULL}},
        {"dn_prefill", "--prefill-node: port 123456",
         {(char *)b, "serve", "--role", "decode", "-m", (char *)g_stories, "--prefill-node", "127.0.0.1:123456", NULL}},
        {"dn_weak", "it holds 5 bytes",
         {(char *)b, "serve", "--role", "decode", "-m", (char *)g_stories, "--secret-file", TO_DIR "/weak", NULL}},
        {"pf_weak", "it holds 5 bytes",
         {(char *)b, "serve", "--role", "prefill", "-m", (char *)g_stories, "--secret-file", TO_DIR "/weak", NULL}},
    };
    for (size_t i = 0; i < sizeof c / sizeof c[0]; i++) {
        int rc = to_run(c[i].argv, c[i].name, &log);
        CHECK(rc == 2 && strstr(log, c[i].want), "%s: exit %d (want 2) and '%s' in: %.400s", c[i].name, rc, c[i].want, log);
        free(log);
    }
    /* the environment's secret meets the same rule */
    setenv("TANDEM_SECRET", "short-secret", 1);
    char *argv_env[] = {(char *)b, "serve", "--role", "router", NULL};
    int rc = to_run(argv_env, "env_weak", &log);
    CHECK(rc == 2 && strstr(log, "the shared secret in TANDEM_SECRET: it holds"), "TANDEM_SECRET weak: exit %d: %.300s", rc, log);
    free(log);
    unsetenv("TANDEM_SECRET");
    /* a config file: a weak "secret", a port past 65535, a node twice */
    struct { const char *json, *want; } cf[] = {
        {"{\"secret\":\"k\",\"nodes\":[{\"role\":\"decode\",\"model\":\"m\",\"addr\":\"127.0.0.1:9\"}]}", "config: \"secret\": it holds"},
        {"{\"nodes\":[{\"role\":\"decode\",\"model\":\"m\",\"addr\":\"127.0.0.1:65600\"}]}", "port of 1-65535"},
        {"{\"listen\":\"127.0.0.1:65600\",\"nodes\":[{\"role\":\"decode\",\"model\":\"m\",\"addr\":\"127.0.0.1:9\"}]}", "port 65600"},
        {"{\"nodes\":[{\"role\":\"decode\",\"model\":\"a\",\"addr\":\"127.0.0.1:9\"},"
         "{\"role\":\"decode\",\"model\":\"b\",\"addr\":\"127.0.0.1:9\"}]}", "listed twice"},
        {"{\"metrics_auth\":1,\"nodes\":[{\"role\":\"decode\",\"model\":\"m\",\"addr\":\"127.0.0.1:9\"}]}", "\"metrics_auth\" must be true or false"},
    };
    for (size_t i = 0; i < sizeof cf / sizeof cf[0]; i++) {
        write_text(TO_DIR "/cfg.json", cf[i].json);
        char *argv[] = {(char *)b, "serve", "--role", "router", "--config", TO_DIR "/cfg.json", NULL};
        rc = to_run(argv, "config", &log);
        CHECK(rc == 2 && strstr(log, cf[i].want), "config %zu: exit %d, want '%s': %.300s", i, rc, cf[i].want, log);
        free(log);
    }
}

/* ==== Start-up: the secret, the open router, /health and /metrics ==== */

static void test_secret_mismatch(void) {
    const char *b = bin();
    write_text(TO_DIR "/other", TO_OTHER "\n");
    pid_t dp;
    char *dargv[] = {(char *)b, "serve", "--role", "decode", "-m", (char *)g_stories, "--listen", "127.0.0.1:0",
                     "--secret-file", TO_DIR "/good", "--port-file", TO_DIR "/dsec.port", NULL};
    int dport = to_start(&dp, dargv, "dsec");
    if (dport <= 0) return;
    char node[64], *log;
    to_port_arg(node, sizeof node, "s", dport);
    char *r1[] = {(char *)b, "serve", "--role", "router", "--listen", "127.0.0.1:0", "--secret-file", TO_DIR "/other",
                  "--decode", node, NULL};
    double t0 = now_ms();
    int rc = to_run(r1, "rsec_other", &log);
    CHECK(rc == 1 && strstr(log, "refused the router's signed request (HTTP 401): the router and the node do not share "
                                 "the secret"),
          "another secret: exit %d after %.0f ms: %.400s", rc, now_ms() - t0, log);
    CHECK(!strstr(log, "listening on port"), "the router never listened");
    free(log);
    char *r2[] = {(char *)b, "serve", "--role", "router", "--listen", "127.0.0.1:0", "--decode", node, NULL};
    rc = to_run(r2, "rsec_none", &log);
    CHECK(rc == 1 && strstr(log, "the node has a secret and the router none"), "no secret: exit %d: %.400s", rc, log);
    free(log);
    /* the same secret: the router starts and serves */
    pid_t rp;
    char *r3[] = {(char *)b, "serve", "--role", "router", "--listen", "127.0.0.1:0", "--secret-file", TO_DIR "/good",
                  "--decode", node, "--port-file", TO_DIR "/rsec.port", NULL};
    int rport = to_start(&rp, r3, "rsec");
    char *body = NULL;
    int st = rport > 0 ? http(rport, "POST", "/v1/completions", "{\"model\":\"s\",\"prompt\":\"Once\",\"max_tokens\":3}", &body) : -1;
    CHECK(st == 200, "the same secret serves: %d %.200s", st, body ? body : "");
    free(body);
    CHECK(stop_proc(rp, 30000) == 0, "router exits 0");
    CHECK(stop_proc(dp, 30000) == 0, "decode node exits 0");
}

static void test_open_and_auth(void) {
    const char *b = bin();
    pid_t dp, rp;
    char *dargv[] = {(char *)b, "serve", "--role", "decode", "-m", (char *)g_stories, "--listen", "127.0.0.1:0",
                     "--port-file", TO_DIR "/dauth.port", NULL};
    int dport = to_start(&dp, dargv, "dauth");
    if (dport <= 0) return;
    char node[64];
    to_port_arg(node, sizeof node, "s", dport);
    /* every interface without a key: loud */
    char *r1[] = {(char *)b, "serve", "--role", "router", "--listen", "0.0.0.0:0", "--decode", node,
                  "--port-file", TO_DIR "/ropen.port", NULL};
    int rport = to_start(&rp, r1, "ropen");
    char *log = slurp(TO_DIR "/ropen.log");
    CHECK(rport > 0 && log && count_str(log, " WARN router req=- *** ") == 3 && strstr(log, "without an API key"),
          "0.0.0.0 without a key warns: %.600s", log ? log : "");
    free(log);
    CHECK(stop_proc(rp, 30000) == 0, "open router exits 0");
    /* with a key: no warning; /health lists nodes only with the key */
    write_text(TO_DIR "/key", "ops-test-api-key\n");
    char *r2[] = {(char *)b, "serve", "--role", "router", "--listen", "0.0.0.0:0", "--decode", node, "--api-key-file",
                  TO_DIR "/key", "--port-file", TO_DIR "/rkey.port", NULL};
    rport = to_start(&rp, r2, "rkey");
    log = slurp(TO_DIR "/rkey.log");
    CHECK(log && !strstr(log, "***"), "with a key: no warning: %.300s", log ? log : "");
    free(log);
    char *raw = NULL;
    char addr[32];
    snprintf(addr, sizeof addr, "127.0.0.1:%d", dport);
    int st = http_raw(rport, "GET", "/health", NULL, NULL, &raw);
    CHECK(st == 200 && raw && strstr(raw, "\"status\":\"ok\"") && !strstr(raw, addr) && !strstr(raw, "stories260K") &&
          !strstr(raw, "\"nodes\""), "anonymous /health: status only: %d %.300s", st, raw ? raw : "");
    free(raw);
    st = http_raw(rport, "GET", "/health", "Authorization: Bearer ops-test-api-key\r\n", NULL, &raw);
    CHECK(st == 200 && raw && strstr(raw, addr) && strstr(raw, "\"nodes\""), "/health with the key lists nodes: %d %.300s", st,
          raw ? raw : "");
    free(raw);
    st = http_raw(rport, "GET", "/metrics", NULL, NULL, &raw);
    CHECK(st == 200, "/metrics open by default: %d", st);
    free(raw);
    CHECK(stop_proc(rp, 30000) == 0, "keyed router exits 0");
    char *r3[] = {(char *)b, "serve", "--role", "router", "--decode", node, "--api-key-file", TO_DIR "/key",
                  "--metrics-auth", "--listen", "127.0.0.1:0", "--port-file", TO_DIR "/rmet.port", NULL};
    rport = to_start(&rp, r3, "rmet");
    st = http_raw(rport, "GET", "/metrics", NULL, NULL, &raw);
    CHECK(st == 401 && raw && strstr(raw, "invalid_api_key"), "--metrics-auth: anonymous 401: %d", st);
    free(raw);
    st = http_raw(rport, "GET", "/metrics", "Authorization: Bearer ops-test-api-key\r\n", NULL, &raw);
    CHECK(st == 200 && raw && strstr(raw, "tandem_router_requests_total"), "--metrics-auth: with the key 200: %d", st);
    free(raw);
    CHECK(stop_proc(rp, 30000) == 0, "metrics-auth router exits 0");
    CHECK(stop_proc(dp, 30000) == 0, "decode node exits 0");
}

/* ==== Drain ==== */

/* Opens a stream of max_tokens through port and waits for its first bytes:
 * the socket, or -1. */
static int to_stream_open(int port, int max_tokens) {
    json_t *q = json_pack("{s:s, s:s, s:i, s:b, s:f}", "model", "q", "prompt", "Once upon a time", "max_tokens", max_tokens,
                          "stream", 1, "temperature", 0.0);
    int fd = http_open_json(port, "/v1/completions", q);
    if (fd < 0) return -1;
    struct pollfd p = {.fd = fd, .events = POLLIN};
    if (poll(&p, 1, 30000) != 1) { close(fd); return -1; }
    return fd;
}

/* What a stream ended with: 0 whole ([DONE] after a finish_reason, no
 * error), 1 an error event then [DONE], -1 anything else (a silent cut).
 * *tokens counts the token chunks. */
static int to_stream_end(int fd, int *tokens, char **text) {
    char *body = NULL;
    int st = http_read(fd, &body);
    close(fd);
    *tokens = body ? count_str(body, "\"finish_reason\":null") : 0;
    *text = body ? body : strdup("");
    if (st != 200 || !body) return -1;
    const char *done = strstr(body, "data: [DONE]");
    const char *err = strstr(body, "data: {\"error\"");
    if (!done || strstr(done + 1, "data: ")) return -1;   /* [DONE] must be the last event */
    if (err) return err < done && strstr(err, "\"code\":") ? 1 : -1;
    return strstr(body, "\"finish_reason\":\"length\"") ? 0 : -1;
}

/* One decode node (registered with the router when reg) and a router;
 * which: 0 SIGTERM to the router, 1 to the decode node. drain_ms: that
 * process's --drain-timeout. */
static void to_drain_case(int which, int drain_ms, int max_tokens, int want, const char *what) {
    const char *b = bin();
    char dt[16], node[64], url[64];
    snprintf(dt, sizeof dt, "%d", drain_ms);
    pid_t dp = 0, rp = 0;
    int rport, dport;
    if (which == 0) {   /* a router with a static node */
        char *dargv[] = {(char *)b, "serve", "--role", "decode", "-m", g_qwen, "-t", "1", "--listen", "127.0.0.1:0",
                         "--secret-file", TO_DIR "/good", "--port-file", TO_DIR "/ddr.port", NULL};
        dport = to_start(&dp, dargv, "ddr");
        to_port_arg(node, sizeof node, "q", dport);
        char *rargv[] = {(char *)b, "serve", "--role", "router", "--listen", "127.0.0.1:0", "--secret-file", TO_DIR "/good",
                         "--decode", node, "--drain-timeout", dt, "--port-file", TO_DIR "/rdr.port", NULL};
        rport = to_start(&rp, rargv, "rdr");
    } else {            /* a node that registers itself */
        char *rargv[] = {(char *)b, "serve", "--role", "router", "--listen", "127.0.0.1:0", "--secret-file", TO_DIR "/good",
                         "--port-file", TO_DIR "/rdr.port", NULL};
        rport = to_start(&rp, rargv, "rdr");
        snprintf(url, sizeof url, "http://127.0.0.1:%d", rport);
        char *dargv[] = {(char *)b, "serve", "--role", "decode", "-m", g_qwen, "-t", "1", "--listen", "127.0.0.1:0",
                         "--secret-file", TO_DIR "/good", "--router", url, "--model-name", "q", "--drain-timeout", dt,
                         "--port-file", TO_DIR "/ddr.port", NULL};
        dport = to_start(&dp, dargv, "ddr");
        CHECK(wait_file_has(TO_DIR "/rdr.log", "registered", 30000), "%s: the node registered", what);
        sleep_ms(300);   /* the router's first health probe of it */
    }
    if (rport <= 0 || dport <= 0) { stop_proc(rp, 5000); stop_proc(dp, 5000); return; }
    int fd = to_stream_open(rport, max_tokens);
    CHECK(fd >= 0, "%s: the stream started", what);
    if (fd < 0) { stop_proc(rp, 5000); stop_proc(dp, 5000); return; }
    pid_t victim = which == 0 ? rp : dp;
    double t0 = now_ms();
    kill(victim, SIGTERM);
    sleep_ms(150);
    if (which == 0) {
        int fd2 = http_connect(rport);
        CHECK(fd2 < 0, "%s: a new connection is refused while draining", what);
        if (fd2 >= 0) close(fd2);
    } else {
        CHECK(wait_file_has(TO_DIR "/rdr.log", "deregistered: it is shutting down", 5000), "%s: the node deregistered", what);
        char *body = NULL;
        int st = http(rport, "POST", "/v1/completions", "{\"model\":\"q\",\"prompt\":\"Hi\",\"max_tokens\":2}", &body);
        CHECK(st == 503, "%s: no new request goes to the draining node: %d %.200s", what, st, body ? body : "");
        free(body);
    }
    int tokens = 0;
    char *text;
    int end = to_stream_end(fd, &tokens, &text);
    const char *tail = strlen(text) > 400 ? text + strlen(text) - 400 : text;
    CHECK(end == want, "%s: the stream ended %s (want %s) after %d tokens: ...%s", what,
          end == 0 ? "whole" : end == 1 ? "with an error event and [DONE]" : "cut silently",
          want == 0 ? "whole" : "error event + [DONE]", tokens, tail);
    if (want == 0) CHECK(tokens == max_tokens, "%s: all %d tokens came (%d)", what, max_tokens, tokens);
    if (want == 1) CHECK(strstr(text, which == 0 ? "\"code\":\"shutting_down\"" : "shutting down"), "%s: the error says why", what);
    free(text);
    int rc = wait_exit(victim, drain_ms + 15000);
    printf("%s: %d tokens, exit %d after %.0f ms (drain timeout %d ms)\n", what, tokens, rc, now_ms() - t0, drain_ms);
    CHECK(rc == 0, "%s: it exits 0 (%d)", what, rc);
    char *log = slurp(which == 0 ? TO_DIR "/rdr.log" : TO_DIR "/ddr.log");
    CHECK(log && strstr(log, want == 0 ? "drained in" : "drain timeout"), "%s: the log says how the drain went", what);
    free(log);
    if (which == 0) stop_proc(dp, 30000);
    else stop_proc(rp, 30000);
}

/* A registered prefill node that gets SIGTERM deregisters at once and
 * exits 0 (nothing in flight: no wait). */
static void test_prefill_leaves(void) {
    const char *b = bin();
    pid_t rp, pp;
    char *rargv[] = {(char *)b, "serve", "--role", "router", "--listen", "127.0.0.1:0", "--secret-file", TO_DIR "/good",
                     "--port-file", TO_DIR "/rpf.port", NULL};
    int rport = to_start(&rp, rargv, "rpf");
    if (rport <= 0) return;
    char url[64];
    snprintf(url, sizeof url, "http://127.0.0.1:%d", rport);
    char *pargv[] = {(char *)b, "serve", "--role", "prefill", "-m", (char *)g_stories, "-t", "1", "--listen", "127.0.0.1:0",
                     "--secret-file", TO_DIR "/good", "--router", url, "--drain-timeout", "5000",
                     "--port-file", TO_DIR "/ppf.port", NULL};
    int pport = to_start(&pp, pargv, "ppf");
    CHECK(pport > 0 && wait_file_has(TO_DIR "/rpf.log", "registered", 30000), "the prefill node registered");
    double t0 = now_ms();
    int rc = stop_proc(pp, 15000);
    CHECK(rc == 0, "the prefill node exits 0 on SIGTERM (%d) after %.0f ms", rc, now_ms() - t0);
    CHECK(wait_file_has(TO_DIR "/rpf.log", "prefill node 127.0.0.1:", 100) &&
          wait_file_has(TO_DIR "/rpf.log", "deregistered: it is shutting down", 2000), "the router saw it leave");
    char *log = slurp(TO_DIR "/ppf.log");
    CHECK(log && strstr(log, "shutting down: draining") && strstr(log, "deregistered from router"), "its log says so");
    free(log);
    CHECK(stop_proc(rp, 30000) == 0, "router exits 0");
}

static void test_drain(void) {
    if (!t_need(g_qwen)) return;
    /* ~600 tokens/s on one thread here: 400 tokens finish well inside
     * 60 s; 4000 do not finish inside 300 ms */
    to_drain_case(0, 60000, 400, 0, "router SIGTERM, long drain");
    to_drain_case(0, 300, 4000, 1, "router SIGTERM, short drain");
    to_drain_case(1, 60000, 400, 0, "decode SIGTERM, long drain");
    to_drain_case(1, 300, 4000, 1, "decode SIGTERM, short drain");
}

int main(void) {
    mkdir("build", 0755);
    mkdir(TO_DIR, 0755);
    t_fixture_path(g_qwen, sizeof g_qwen, "models/qwen3-mini-Q8_0.gguf");
    test_secret_rule();
    test_refusals();
    test_secret_mismatch();
    test_open_and_auth();
    test_prefill_leaves();
    test_drain();
    return t_done("test_router_ops");
}

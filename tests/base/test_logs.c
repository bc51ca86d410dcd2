/* test_logs.c - one log format for every server role (src/base/log.c).
 *
 * In-process: level names, request ids, `--log-level` taken out of argv
 * and TANDEM_LOG_LEVEL, one escaped line per call.
 * Real processes (assets/stories260K.gguf):
 *   - a prefill node, a decode node and a router configured with one more
 *     decode node that is not there: every line of the three logs has the
 *     format (UTC time within minutes of now, level, role, request id); the
 *     router logs every configured node as reachable or unreachable at
 *     start-up, the missing one with the connection error; the request id
 *     the router returns (X-Request-Id) is on exactly one INFO line of the
 *     router, the decode node and the prefill node for each request;
 *   - a local node takes a valid X-Request-Id, draws its own for a bad one;
 *   - --log-level warn leaves out INFO lines, TANDEM_LOG_LEVEL=error all
 *     but errors; a bad level is refused with exit status 2 and a message
 *     naming the valid values.
 */
#include "proc.h"

#include <regex.h>

#include "base/log.h"

#define TL_MODEL "assets/stories260K.gguf"

static char g_dir[64];
static regex_t g_re;

/* ==== Helpers ==== */

static void tl_file(char *out, size_t n, const char *name, const char *ext) {
    snprintf(out, n, "%s/%s.%s", g_dir, name, ext);
}

static char *tl_log(const char *name) {
    char p[256];
    tl_file(p, sizeof p, name, "log");
    return slurp(p);
}

/* Starts argv (its --port-file is DIR/name.port, its stderr DIR/name.log, a new one). */
static int tl_start(pid_t *pid, char *const argv[], const char *name) {
    return start_named(pid, argv, g_dir, name, 1, asan() ? 90000 : 30000);
}

/* Runs argv to its end with stderr into DIR/name.log; the exit status. */
static int tl_run(char *const argv[], const char *name) {
    char lg[256];
    tl_file(lg, sizeof lg, name, "log");
    unlink(lg);
    pid_t pid = spawn(argv, lg);
    int st = 0;
    if (waitpid(pid, &st, 0) != pid) return -1;
    return WIFEXITED(st) ? WEXITSTATUS(st) : 128 + WTERMSIG(st);
}

/* A log line's timestamp within 10 minutes of now, read as UTC. */
static int tl_time_ok(const char *line) {
    struct tm tm;
    memset(&tm, 0, sizeof tm);
    if (!strptime(line, "%Y-%m-%dT%H:%M:%S", &tm)) return 0;
    double d = difftime(timegm(&tm), time(NULL));
    return d > -600 && d < 600;
}

/* Lines of log that break the format (or name another role); prints the first. */
static int tl_bad_lines(const char *log, const char *role, int *lines) {
    int bad = 0;
    *lines = 0;
    char want[32];
    snprintf(want, sizeof want, " %s req=", role);
    for (const char *p = log; *p;) {
        const char *e = strchr(p, '\n');
        size_t n = e ? (size_t)(e - p) : strlen(p);
        char *l = strndup(p, n);
        (*lines)++;
        int ok = regexec(&g_re, l, 0, NULL, 0) == 0 && strstr(l, want) && tl_time_ok(l);
        if (!ok && !bad++) fprintf(stderr, "  bad %s log line: %s\n", role, l);
        free(l);
        p += n + (e ? 1 : 0);
    }
    return bad;
}

/* Lines containing all of a, b (b may be NULL). */
static int tl_count(const char *log, const char *a, const char *b) {
    int k = 0;
    for (const char *p = log; *p;) {
        const char *e = strchr(p, '\n');
        size_t n = e ? (size_t)(e - p) : strlen(p);
        char *l = strndup(p, n);
        k += strstr(l, a) && (!b || strstr(l, b));
        free(l);
        p += n + (e ? 1 : 0);
    }
    return k;
}

/* " INFO <role> req=<rid> " */
static void tl_key(char *out, size_t n, const char *level, const char *role, const char *rid) {
    snprintf(out, n, " %s %s req=%s ", level, role, rid);
}

/* ==== In-process ==== */

static void test_api(void) {
    enum log_level l = LOGL_ERROR;
    CHECK(log_level_parse("warn", &l) == 0 && l == LOGL_WARN, "warn parses");
    CHECK(log_level_parse("Debug", &l) == 0 && l == LOGL_DEBUG, "Debug parses (any case)");
    CHECK(log_level_parse("verbose", &l) == -1 && log_level_parse(NULL, &l) == -1, "verbose and NULL refused");

    uint32_t id = 0;
    char s[LOG_ID_CHARS + 1];
    CHECK(log_id_parse("0badc0de", &id) == 0 && id == 0x0badc0de, "an id parses");
    CHECK(log_id_parse("0BADC0DE", &id) == 0 && id == 0x0badc0de, "upper case too");
    CHECK(log_id_parse("00000000", &id) && log_id_parse("0badc0d", &id) && log_id_parse("0badc0de0", &id) &&
          log_id_parse("0badc0dg", &id) && log_id_parse("", &id) && log_id_parse(NULL, &id), "zero, short, long, non-hex refused");
    log_id_format(0x1234abcd, s);
    CHECK(!strcmp(s, "1234abcd"), "format: %s", s);
    log_id_format(0, s);
    CHECK(!strcmp(s, "-"), "id 0 is \"-\": %s", s);
    uint32_t a = log_id_new(), b = log_id_new();
    CHECK(a && b && a != b, "fresh ids: %08x %08x", a, b);

    char err[200];
    char *argv[] = { "--role", "router", "--log-level", "debug", "--listen", "x", NULL };
    int argc = 6;
    unsetenv("TANDEM_LOG_LEVEL");
    CHECK(log_cli_take(&argc, argv, err, sizeof err) == 0 && argc == 4 && !strcmp(argv[2], "--listen") &&
          !strcmp(argv[3], "x") && argv[4] == NULL && log_enabled(LOGL_DEBUG), "--log-level debug taken out of argv");
    char *argv2[] = { "--log-level=warn", "-m", "x", NULL };
    argc = 3;
    CHECK(log_cli_take(&argc, argv2, err, sizeof err) == 0 && argc == 2 && !strcmp(argv2[0], "-m") &&
          log_enabled(LOGL_WARN) && !log_enabled(LOGL_INFO), "--log-level=warn");
    char *argv3[] = { "-m", "x", "--log-level", NULL };
    argc = 3;
    CHECK(log_cli_take(&argc, argv3, err, sizeof err) == -1 && strstr(err, "error, warn, info, debug"),
          "--log-level without a value refused: %s", err);
    char *argv4[] = { "-m", "x", NULL };
    argc = 2;
    setenv("TANDEM_LOG_LEVEL", "error", 1);
    CHECK(log_cli_take(&argc, argv4, err, sizeof err) == 0 && argc == 2 && !log_enabled(LOGL_WARN) &&
          log_enabled(LOGL_ERROR), "TANDEM_LOG_LEVEL=error");
    setenv("TANDEM_LOG_LEVEL", "loud", 1);
    CHECK(log_cli_take(&argc, argv4, err, sizeof err) == -1 && strstr(err, "TANDEM_LOG_LEVEL"), "bad env refused: %s", err);
    unsetenv("TANDEM_LOG_LEVEL");
    CHECK(log_cli_take(&argc, argv4, err, sizeof err) == 0 && log_enabled(LOGL_INFO) && !log_enabled(LOGL_DEBUG),
          "info without option or env");

    /* one escaped line per call, nothing below the level */
    char path[128];
    tl_file(path, sizeof path, "inproc", "log");
    int fd = open(path, O_WRONLY | O_CREAT | O_TRUNC, 0644), saved = dup(2);
    dup2(fd, 2);
    log_set_role("router");
    log_info("0badc0de", "hello\n%s forged", "2026-01-01T00:00:00.000Z ERROR router req=- \x1b[2J");
    log_debug(NULL, "not shown at info");
    log_warn("not-an-id", "warned");
    dup2(saved, 2);
    close(saved);
    close(fd);
    log_set_role("cli");
    char *log = slurp(path);
    int lines = 0;
    CHECK(tl_bad_lines(log, "router", &lines) == 0 && lines == 2, "two well-formed lines (%d): %s", lines, log);
    CHECK(strstr(log, " INFO router req=0badc0de hello\\n2026-01-01T00:00:00.000Z ERROR router req=- \\x1b[2J forged\n") != NULL,
          "the message escaped on its one line: %s", log);
    CHECK(strstr(log, " WARN router req=- warned\n") != NULL, "a malformed id logged as -");
    CHECK(!strstr(log, "not shown"), "debug left out at info");
    free(log);
}

/* ==== Processes ==== */

/* log_limit: burst lines per window, the rest counted and reported by the
 * first line of a later window (httpd's MHD messages, log_refused). */
static void test_limit(void) {
    log_limit l = { .window_ms = 1000.0, .burst = 3 };
    unsigned long dropped = 99;
    int passed = 0;
    for (int i = 0; i < 10; i++) passed += log_limit_take(&l, 5000.0 + i, &dropped);
    CHECK(passed == 3 && dropped == 0, "3 of 10 lines in one window: %d passed", passed);
    CHECK(log_limit_take(&l, 5999.0, &dropped) == 0, "still the same window at +999 ms");
    CHECK(log_limit_take(&l, 6001.0, &dropped) == 1 && dropped == 8, "next window: passes, 8 left out before (%lu)", dropped);
    CHECK(log_limit_take(&l, 6002.0, &dropped) == 1 && dropped == 0, "the count is reported once");
}

static void test_bad_level(void) {
    char b[512];
    snprintf(b, sizeof b, "%s", bin());
    char *r[] = { b, "serve", "--role", "router", "--listen", "127.0.0.1:0", "--log-level", "verbose", NULL };
    int rc = tl_run(r, "bad-router");
    char *log = tl_log("bad-router");
    CHECK(rc == 2 && strstr(log, "--log-level must be one of error, warn, info, debug (got \"verbose\")"),
          "router refuses --log-level verbose: rc %d, %s", rc, log);
    free(log);
    char *d[] = { b, "serve", "--role", "decode", "-m", TL_MODEL, "--log-level", "loud", NULL };
    rc = tl_run(d, "bad-decode");
    log = tl_log("bad-decode");
    CHECK(rc == 2 && strstr(log, "error, warn, info, debug"), "decode refuses --log-level loud: rc %d, %s", rc, log);
    free(log);
    setenv("TANDEM_LOG_LEVEL", "chatty", 1);
    char *p[] = { b, "serve", "--role", "prefill", "-m", TL_MODEL, NULL };
    rc = tl_run(p, "bad-env");
    unsetenv("TANDEM_LOG_LEVEL");
    log = tl_log("bad-env");
    CHECK(rc == 2 && strstr(log, "TANDEM_LOG_LEVEL must be one of"), "prefill refuses TANDEM_LOG_LEVEL=chatty: rc %d, %s", rc, log);
    free(log);
}

static void test_cluster(void) {
    char b[512], secret[256], pport[256], dport[256], rport[256];
    snprintf(b, sizeof b, "%s", bin());
    tl_file(secret, sizeof secret, "secret", "txt");
    FILE *f = fopen(secret, "w");
    if (f) { fputs("test-logs-secret-0123456789abcdef0123456789\n", f); fclose(f); }
    tl_file(pport, sizeof pport, "prefill", "port");
    tl_file(dport, sizeof dport, "decode", "port");
    tl_file(rport, sizeof rport, "router", "port");
    pid_t pp = 0, dp = 0, rp = 0;
    char *pa[] = { b, "serve", "--role", "prefill", "-m", TL_MODEL, "-t", "1", "--secret-file", secret,
                   "--listen", "127.0.0.1:0", "--port-file", pport, NULL };
    int pport_n = tl_start(&pp, pa, "prefill");
    char paddr[64], daddr[64], pnode[80], dnode[80], dead[80];
    snprintf(paddr, sizeof paddr, "127.0.0.1:%d", pport_n);
    char *da[] = { b, "serve", "--role", "decode", "-m", TL_MODEL, "-t", "1", "--secret-file", secret,
                   "--listen", "127.0.0.1:0", "--port-file", dport, "--prefill-node", paddr, NULL };
    int dport_n = pport_n > 0 ? tl_start(&dp, da, "decode") : -1;
    snprintf(daddr, sizeof daddr, "127.0.0.1:%d", dport_n);
    int dead_p = dead_port();
    snprintf(pnode, sizeof pnode, "m=%s", paddr);
    snprintf(dnode, sizeof dnode, "m=%s", daddr);
    snprintf(dead, sizeof dead, "m=127.0.0.1:%d", dead_p);
    char *ra[] = { b, "serve", "--role", "router", "--listen", "127.0.0.1:0", "--port-file", rport, "--secret-file", secret,
                   "--decode", dnode, "--decode", dead, "--prefill", pnode, "--split", "always",
                   "--health-interval-ms", "3000", NULL };   /* probes wait 3 s: a loaded CI machine */
    int rport_n = dport_n > 0 ? tl_start(&rp, ra, "router") : -1;
    char rid[2][32] = { "", "" };
    if (rport_n > 0) {
        const char *bodies[2] = {
            "{\"model\":\"m\",\"prompt\":\"Once upon a time there was a little girl who liked to play in the park\",\"max_tokens\":3}",
            "{\"model\":\"m\",\"prompt\":\"One day a big dog came to the park and the little girl was very happy\",\"max_tokens\":3,\"stream\":true}",
        };
        for (int i = 0; i < 2; i++) {
            char *raw = NULL;
            int st = http_raw(rport_n, "POST", "/v1/completions", NULL, bodies[i], &raw);
            char plan[32];
            http_header(raw, "X-Request-Id", rid[i], sizeof rid[i]);
            http_header(raw, "X-Tandem-Prefill-Plan", plan, sizeof plan);
            uint32_t id;
            CHECK(st == 200 && log_id_parse(rid[i], &id) == 0 && !strcmp(plan, "split"),
                  "request %d through the router: %d, X-Request-Id %s, plan %s", i, st, rid[i], plan);
            free(raw);
        }
        CHECK(strcmp(rid[0], rid[1]), "two requests, two ids");
        char *raw = NULL;
        int st = http_raw(rport_n, "POST", "/v1/completions", NULL, "{\"model\":\"nope\",\"prompt\":\"x\"}", &raw);
        CHECK(st == 404, "unknown model: %d", st);
        free(raw);
    }
    /* the decode node called directly draws its own id */
    node_auth_key key;
    node_auth_derive(&key, "test-logs-secret-0123456789abcdef0123456789", 43, NODE_AUTH_LABEL_DECODE_API);
    sign_key = &key;
    char *body = NULL;
    int st = dport_n > 0 ? http(dport_n, "POST", "/v1/generate", "{\"prompt\":\"Once upon a time\",\"max_tokens\":2}", &body) : -1;
    sign_key = NULL;
    CHECK(st == 200, "a direct request to the decode node: %d %s", st, body ? body : "");
    free(body);
    stop_proc(rp, 10000);
    stop_proc(dp, 10000);
    stop_proc(pp, 10000);

    char *rl = tl_log("router"), *dl = tl_log("decode"), *pl = tl_log("prefill");
    int n = 0, bad = tl_bad_lines(rl, "router", &n);
    CHECK(bad == 0 && n >= 6, "router: %d of %d lines break the format", bad, n);
    bad = tl_bad_lines(dl, "decode", &n);
    CHECK(bad == 0 && n >= 4, "decode: %d of %d lines break the format", bad, n);
    bad = tl_bad_lines(pl, "prefill", &n);
    CHECK(bad == 0 && n >= 3, "prefill: %d of %d lines break the format", bad, n);

    char k[128];
    snprintf(k, sizeof k, "decode node 127.0.0.1:%d (model m) unreachable at start-up: ", dead_p);
    CHECK(tl_count(rl, " WARN router req=- ", k) == 1 && tl_count(rl, k, "onnect") == 1,
          "the missing decode node is logged at start-up with the connection error");
    snprintf(k, sizeof k, "decode node %s (model m) reachable at start-up", daddr);
    CHECK(tl_count(rl, " INFO router req=- ", k) == 1, "the decode node is logged reachable at start-up");
    snprintf(k, sizeof k, "prefill node %s (model m) reachable at start-up", paddr);
    CHECK(tl_count(rl, " INFO router req=- ", k) == 1, "the prefill node is logged reachable at start-up");

    CHECK(tl_count(rl, " WARN router req=", " refused status=404 error=The model 'nope' does not exist") == 1,
          "a request refused before routing has its line (a 4xx: WARN)");
    for (int i = 0; i < 2 && rid[i][0]; i++) {
        tl_key(k, sizeof k, "INFO", "router", rid[i]);
        CHECK(tl_count(rl, k, NULL) == 1 && tl_count(rl, k, " done status=200 ") == 1,
              "request %d: one INFO line on the router (%s)", i, rid[i]);
        tl_key(k, sizeof k, "INFO", "decode", rid[i]);
        CHECK(tl_count(dl, k, NULL) == 1 && tl_count(dl, k, " done finish=length prompt=") == 1 &&
              tl_count(dl, k, " completion=3 ") == 1 && tl_count(dl, k, " prefill=remote@") == 1,
              "request %d: one INFO line on the decode node, same id", i);
        tl_key(k, sizeof k, "INFO", "prefill", rid[i]);
        CHECK(tl_count(pl, k, NULL) == 1 && tl_count(pl, k, " done tokens=") == 1,
              "request %d: one INFO line on the prefill node, same id", i);
    }
    /* three requests reached the decode node: three done lines, the direct
     * one with an id the router never saw */
    int done = tl_count(dl, " INFO decode req=", " done finish=");
    int direct = done == 3 && rid[0][0] && rid[1][0] ? 1 : 0;
    for (const char *p = dl; direct && (p = strstr(p, " done finish=")); p++) {
        const char *ls = p;
        while (ls > dl && ls[-1] != '\n') ls--;
        const char *r = strstr(ls, "req=");
        if (r && r < p && strncmp(r + 4, rid[0], 8) && strncmp(r + 4, rid[1], 8)) direct = 2;
    }
    CHECK(direct == 2, "the direct request logged with an id of its own (%d done lines)", done);
    free(rl);
    free(dl);
    free(pl);
}

/* A local node: request ids from X-Request-Id; --log-level warn. */
static void test_local(void) {
    char b[512], port[256];
    snprintf(b, sizeof b, "%s", bin());
    tl_file(port, sizeof port, "local", "port");
    pid_t lp = 0;
    char *la[] = { b, "serve", "--role", "local", "-m", TL_MODEL, "-t", "1", "--listen", "127.0.0.1:0", "--port-file", port, NULL };
    int lport = tl_start(&lp, la, "local");
    const char *req = "{\"prompt\":\"Once upon a time\",\"max_tokens\":2}";
    char *raw = NULL;
    int st1 = lport > 0 ? http_raw(lport, "POST", "/v1/generate", "X-Request-Id: 0badc0de\r\n", req, &raw) : -1;
    free(raw);
    int st2 = lport > 0 ? http_raw(lport, "POST", "/v1/generate", "X-Request-Id: not-an-id\r\n", req, &raw) : -1;
    free(raw);
    int st3 = lport > 0 ? http_raw(lport, "POST", "/v1/generate", NULL, "{\"prompt\":", &raw) : -1;
    free(raw);
    CHECK(st1 == 200 && st2 == 200 && st3 == 400, "local node answers: %d %d %d", st1, st2, st3);
    stop_proc(lp, 10000);
    char *log = tl_log("local");
    int n = 0;
    CHECK(tl_bad_lines(log, "local", &n) == 0 && n >= 3, "local: every one of %d lines has the format", n);
    CHECK(tl_count(log, " INFO local req=0badc0de done finish=length ", NULL) == 1, "the given id is used");
    CHECK(!strstr(log, "not-an-id") && tl_count(log, " INFO local req=", " done finish=") == 2,
          "a malformed id is replaced by the node's own");
    CHECK(tl_count(log, " WARN local req=", " refused status=400 ") == 1, "a refused request has its line too (WARN)");
    CHECK(tl_count(log, " WARN local req=- no shared secret", NULL) == 1, "the open node warns");
    free(log);

    tl_file(port, sizeof port, "local-warn", "port");
    char *wa[] = { b, "serve", "--role", "local", "-m", TL_MODEL, "-t", "1", "--listen", "127.0.0.1:0", "--port-file", port,
                   "--log-level", "warn", NULL };
    lport = tl_start(&lp, wa, "local-warn");
    st1 = lport > 0 ? http_raw(lport, "POST", "/v1/generate", NULL, req, &raw) : -1;
    free(raw);
    CHECK(st1 == 200, "warn-level node answers: %d", st1);
    stop_proc(lp, 10000);
    log = tl_log("local-warn");
    CHECK(tl_bad_lines(log, "local", &n) == 0 && n >= 1, "warn level: %d well-formed lines", n);
    CHECK(!strstr(log, " INFO ") && strstr(log, " WARN local req=- no shared secret"),
          "--log-level warn: warnings only: %s", log);
    free(log);

    /* TANDEM_LOG_LEVEL=error: a healthy start-up and request say nothing */
    tl_file(port, sizeof port, "local-error", "port");
    char *ea[] = { b, "serve", "--role", "local", "-m", TL_MODEL, "-t", "1", "--listen", "127.0.0.1:0", "--port-file", port, NULL };
    setenv("TANDEM_LOG_LEVEL", "error", 1);
    lport = tl_start(&lp, ea, "local-error");
    unsetenv("TANDEM_LOG_LEVEL");
    st1 = lport > 0 ? http_raw(lport, "POST", "/v1/generate", NULL, req, &raw) : -1;
    free(raw);
    stop_proc(lp, 10000);
    log = tl_log("local-error");
    CHECK(st1 == 200 && log[0] == 0, "TANDEM_LOG_LEVEL=error: no lines (%d): %s", st1, log);
    free(log);
}

int main(void) {
    snprintf(g_dir, sizeof g_dir, "/tmp/tandem-test-logs-XXXXXX");
    if (!mkdtemp(g_dir)) { perror("mkdtemp"); return 1; }
    int rc = regcomp(&g_re, "^[0-9]{4}-[0-9]{2}-[0-9]{2}T[0-9]{2}:[0-9]{2}:[0-9]{2}\\.[0-9]{3}Z "
                            "(ERROR|WARN|INFO|DEBUG) (router|prefill|decode|local|cli) req=([0-9a-f]{8}|-) [^[:cntrl:]]+$",
                     REG_EXTENDED | REG_NOSUB);
    CHECK(rc == 0, "regex compiles");
    test_api();
    test_limit();
    /* the model is in the repository and the binary is what make builds: a
     * missing one is a broken checkout or a wrong TANDEM_BIN, which must fail
     * rather than quietly drop the process checks (62 checks down to 24) */
    int have_model = access(TL_MODEL, R_OK) == 0, have_bin = access(bin(), X_OK) == 0;
    CHECK(have_model, "%s missing (part of the repository)", TL_MODEL);
    CHECK(have_bin, "tandem binary %s not executable (set TANDEM_BIN)", bin());
    if (have_model && have_bin) {
        test_bad_level();
        test_cluster();
        test_local();
    }
    regfree(&g_re);
    if (!t_fail) {
        char cmd[128];
        snprintf(cmd, sizeof cmd, "rm -rf %s", g_dir);
        if (system(cmd)) {}
    }
    return t_done("test_logs");
}

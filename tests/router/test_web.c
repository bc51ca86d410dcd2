/* test_web.c - the router's chat page (GET /, src/router/web_page.html)
 * with real processes: a qwen3 fixture node and a router with an API key.
 *   - GET / without the key: 200, the page (under 15 KB, nothing it would
 *     load from elsewhere), its Content-Security-Policy, X-Frame-Options
 *     and the other headers; HEAD / says a key is wanted; the API itself
 *     still refuses the anonymous caller
 *   - the page in headless Chromium (tests/clients/web_check.py through
 *     tools/chromium.sh, the DevTools protocol): the key typed, the model
 *     picked from /v1/models, a message typed and sent with Enter, the
 *     answer streamed into the page equal to the same request through the
 *     API, a screenshot whose answer box holds text it did not hold
 *     before, a fetch elsewhere refused by the CSP, no console error.
 *     Without Chromium: a "chromium" skip (apt-get install chromium). */
#include "proc.h"

#include <jansson.h>

#include "base/strbuf.h"

#define TW_DIR "build/test_web.d"
#define TW_KEY "tw-page-key-0123456789"
#define TW_MAX_TOKENS 32     /* the page's answer: long enough to be seen growing */
#define TW_PAGE_MAX 15360    /* the page's size budget (bytes) */

typedef struct {
    pid_t node, router;
    int pnode, prouter;
    char model[512];
} tw_env;

static int tw_setup(tw_env *e) {
    char b[512];
    snprintf(b, sizeof b, "%s", bin());
    char *node[] = {b, "serve", "--role", "local", "-m", e->model, "-t", "1", "-c", "512", "--listen", "127.0.0.1:0",
                    "--port-file", TW_DIR "/node.port", NULL};
    e->pnode = start_named(&e->node, node, TW_DIR, "node", 1, 60000);
    if (e->pnode <= 0) return -1;
    write_text(TW_DIR "/key", TW_KEY);
    char dn[64];
    snprintf(dn, sizeof dn, "qwen3=127.0.0.1:%d", e->pnode);
    char *r[] = {b, "serve", "--role", "router", "--listen", "127.0.0.1:0", "--decode", dn, "--api-key-file",
                 TW_DIR "/key", "--health-interval-ms", "200", "--port-file", TW_DIR "/router.port", NULL};
    e->prouter = start_named(&e->router, r, TW_DIR, "router", 1, 30000);
    return e->prouter > 0 ? 0 : -1;
}

/* ==== GET / over HTTP ==== */

static void test_page_http(tw_env *e) {
    char *raw = NULL, v[600];
    int st = http_raw(e->prouter, "GET", "/", NULL, NULL, &raw);
    const char *body = raw ? strstr(raw, "\r\n\r\n") : NULL;
    body = body ? body + 4 : "";
    size_t len = strlen(body);
    CHECK(st == 200 && strstr(body, "<title>tandem chat</title>"), "GET / without the key: %d", st);
    CHECK(len > 1000 && len < TW_PAGE_MAX, "the page is %zu bytes (budget %d)", len, TW_PAGE_MAX);
    CHECK(!strstr(body, "http://") && !strstr(body, "https://") && !strstr(body, "src=") && !strstr(body, "@import") &&
          !strstr(body, "url("), "the page names nothing to load from elsewhere");
    http_header(raw, "Content-Type", v, sizeof v);
    CHECK(!strcmp(v, "text/html; charset=utf-8"), "Content-Type: %s", v);
    http_header(raw, "Content-Security-Policy", v, sizeof v);
    CHECK(strstr(v, "default-src 'none'") && strstr(v, "script-src 'sha256-") && strstr(v, "style-src 'sha256-") &&
          strstr(v, "connect-src 'self'") && strstr(v, "frame-ancestors 'none'") && strstr(v, "base-uri 'none'") &&
          strstr(v, "form-action 'none'") && !strstr(v, "unsafe"), "Content-Security-Policy: %s", v);
    http_header(raw, "X-Frame-Options", v, sizeof v);
    CHECK(!strcmp(v, "DENY"), "X-Frame-Options: %s", v);
    http_header(raw, "X-Content-Type-Options", v, sizeof v);
    CHECK(!strcmp(v, "nosniff"), "X-Content-Type-Options: %s", v);
    http_header(raw, "Referrer-Policy", v, sizeof v);
    CHECK(!strcmp(v, "no-referrer"), "Referrer-Policy: %s", v);
    free(raw);
    st = http_raw(e->prouter, "HEAD", "/", NULL, NULL, &raw);
    http_header(raw, "X-Tandem-Auth", v, sizeof v);
    CHECK(st == 200 && !strcmp(v, "key"), "HEAD /: %d, X-Tandem-Auth: %s", st, v);
    free(raw);
    raw = NULL;
    /* a router without a key says so: the page asks for none */
    char b[512], dn[64];
    snprintf(b, sizeof b, "%s", bin());
    snprintf(dn, sizeof dn, "qwen3=127.0.0.1:%d", e->pnode);
    char *open_r[] = {b, "serve", "--role", "router", "--listen", "127.0.0.1:0", "--decode", dn, "--port-file",
                      TW_DIR "/open.port", NULL};
    pid_t open_pid = 0;
    int popen_ = start_named(&open_pid, open_r, TW_DIR, "open", 1, 30000);
    st = popen_ > 0 ? http_raw(popen_, "HEAD", "/", NULL, NULL, &raw) : -1;
    http_header(raw, "X-Tandem-Auth", v, sizeof v);
    CHECK(st == 200 && !strcmp(v, "none"), "HEAD / of a router without a key: %d, X-Tandem-Auth: %s", st, v);
    free(raw);
    if (open_pid) stop_proc(open_pid, 5000);
    char *out = NULL;
    st = http(e->prouter, "GET", "/v1/models", NULL, &out);
    CHECK(st == 401, "GET /v1/models without the key: %d", st);
    free(out);
    st = http(e->prouter, "POST", "/", "{}", &out);
    CHECK(st == 405, "POST /: %d", st);
    free(out);
}

/* ==== The page in Chromium ==== */

/* The API's answer to what the page sends (temperature 0), or "". */
static void tw_want(tw_env *e, const char *msg, char *out, size_t cap) {
    char body[512], *resp = NULL;
    snprintf(body, sizeof body,
             "{\"model\":\"qwen3\",\"messages\":[{\"role\":\"user\",\"content\":\"%s\"}],\"stream\":true,"
             "\"stream_options\":{\"include_usage\":true},\"temperature\":0,\"max_tokens\":%d}", msg, TW_MAX_TOKENS);
    http_req q = {.method = "POST", .path = "/v1/chat/completions", .body = body,
                  .extra = "Authorization: Bearer " TW_KEY "\r\n"};
    int st = http_request(e->prouter, &q, &resp);
    sse_choices s;
    memset(&s, 0, sizeof s);
    if (st == 200) sse_gather(resp, 1, 1, &s);
    snprintf(out, cap, "%s", st == 200 ? s.text[0] : "");
    CHECK(st == 200 && out[0], "the API's streamed answer to the page's request: %d", st);
    free(resp);
}

/* Runs argv (python3 on PATH) and counts its "ok NAME" / "FAIL NAME: why"
 * lines as checks; its other output is shown when a check failed or none
 * ran. Returns the number of check lines. */
static int tw_run_checks(char *const argv[]) {
    int p[2];
    if (pipe(p)) return 0;
    pid_t pid = fork();
    if (pid == 0) {
        dup2(p[1], 1);
        dup2(p[1], 2);
        close(p[0]);
        close(p[1]);
        execvp(argv[0], argv);
        _exit(127);
    }
    close(p[1]);
    FILE *f = fdopen(p[0], "r");
    char line[4096];
    int n = 0, bad = 0;
    strbuf other = {0};
    while (f && fgets(line, sizeof line, f)) {
        line[strcspn(line, "\n")] = 0;
        if (!strncmp(line, "ok ", 3)) { n++; CHECK(1, "chromium: %s", line + 3); }
        else if (!strncmp(line, "FAIL ", 5)) { n++; bad++; CHECK(0, "chromium: %s", line + 5); }
        else if (other.len < 8192) strbuf_printf(&other, "%s\n", line);
    }
    if (f) fclose(f);
    else close(p[0]);
    int st = 0;
    waitpid(pid, &st, 0);
    if ((bad || !n) && other.len) fprintf(stderr, "web_check.py said:\n%s", other.p);
    strbuf_free(&other);
    return n;
}

static void test_page_browser(tw_env *e) {
    if (system("command -v chromium >/dev/null 2>&1 || command -v chromium-browser >/dev/null 2>&1")) {
        t_skip_what("chromium", "no Chromium here (Debian: apt-get install chromium); the page was not opened");
        return;
    }
    char want[4096], url[64], maxtok[16];
    tw_want(e, "Hello", want, sizeof want);
    snprintf(url, sizeof url, "http://127.0.0.1:%d/", e->prouter);
    snprintf(maxtok, sizeof maxtok, "%d", TW_MAX_TOKENS);
    char *argv[] = {"python3", "tests/clients/web_check.py", "--url", url, "--key", TW_KEY, "--model", "qwen3",
                    "--message", "Hello", "--want", want, "--max-tokens", maxtok, "--shot", TW_DIR, NULL};
    int n = tw_run_checks(argv);
    CHECK(n == 7, "web_check.py ran %d of 7 checks", n);
}

int main(void) {
    signal(SIGPIPE, SIG_IGN);
    mkdir("build", 0755);
    mkdir(TW_DIR, 0755);
    unsetenv("TANDEM_API_KEY");
    unsetenv("TANDEM_SECRET");
    tw_env e;
    memset(&e, 0, sizeof e);
    snprintf(e.model, sizeof e.model, "%s/models/qwen3-mini-Q8_0.gguf", t_fixtures());
    CHECK(access(bin(), X_OK) == 0, "tandem binary %s (set TANDEM_BIN)", bin());
    if (access(bin(), X_OK) || !t_need(e.model)) return t_done("test_web");
    if (tw_setup(&e) == 0) {
        test_page_http(&e);
        test_page_browser(&e);
    } else {
        CHECK(0, "node and router start (logs in " TW_DIR ")");
    }
    if (e.router) CHECK(stop_proc(e.router, 5000) == 0, "router stops cleanly");
    if (e.node) stop_proc(e.node, 5000);
    return t_done("test_web");
}

/* test_grade_check.c - `tandem grade`'s checks besides grading (issue 40):
 * in-process, what is text, where a problem points, which halves of a
 * failed record are kept; then real processes on loopback (a router over
 * two local nodes with chat templates and one, stories260K, without):
 *   - the preflight stops before the first submission, with one message
 *     and no record, when a model is not served, when the router cannot be
 *     reached, and when the feedback model cannot chat;
 *   - empty and binary submissions are flagged, not sent to the models;
 *   - a failed record's finished half is kept: a rerun asks only for the
 *     missing one (the router's chat count moves by exactly that);
 *   - every problem of a graded analysis says whether its file and line
 *     exist in the submission.
 */
#include "proc.h"

#include <sys/stat.h>

#include "grade/grade_check.h"

#define TC_DIR "build/test_grade_check.d"

/* ==== In-process ==== */

static void test_text(void) {
    const char bin_bytes[] = "\x7f" "ELF\x02\x01\x01\0\0\0";
    CHECK(grade_is_text("print(1)\n", 9) && grade_is_text("a\tb\r\n\f", 6) && grade_is_text("", 0), "text is text");
    CHECK(!grade_is_text(bin_bytes, sizeof bin_bytes - 1), "an ELF header is not text");
    char ctl[128];
    for (int i = 0; i < 128; i++) ctl[i] = (char)(i % 8 == 0 ? 1 : 'a');   /* 1 control byte in 8 */
    CHECK(!grade_is_text(ctl, sizeof ctl), "many control bytes: not text");
    CHECK(grade_is_blank(" \n\t\r\n", 5) && grade_is_blank("", 0) && !grade_is_blank(" x ", 3), "blank");
}

static void test_problems(void) {
    json_t *files = json_loads("[{\"path\":\"main.py\",\"lines\":10,\"bytes\":100},{\"path\":\"src/util.py\",\"lines\":3,\"bytes\":30},"
                               "{\"path\":\"a.out\",\"bytes\":900,\"skipped\":\"binary\"}]", 0, NULL);
    json_t *a = json_loads("{\"problems\":["
                           "{\"file\":\"main.py\",\"line\":10,\"description\":\"ok\"},"
                           "{\"file\":\"./main.py\",\"line\":1,\"description\":\"ok with ./\"},"
                           "{\"file\":\"util.py\",\"line\":2,\"description\":\"base name of src/util.py\"},"
                           "{\"file\":\"main.py\",\"line\":11,\"description\":\"past the end\"},"
                           "{\"file\":\"nothere.py\",\"line\":1,\"description\":\"no such file\"},"
                           "{\"file\":\"a.out\",\"line\":1,\"description\":\"a binary file has no lines\"}]}", 0, NULL);
    int bad = -1;
    json_t *ps = grade_check_problems(a, files, &bad);
    int want[6] = {1, 1, 1, 0, 0, 0};
    int ok = bad == 3;
    for (int i = 0; i < 6; i++) ok &= json_is_true(json_object_get(json_array_get(ps, (size_t)i), "located")) == want[i];
    CHECK(ok && json_array_size(ps) == 6, "problems located: %d not located (want 3)", bad);
    CHECK(!json_object_get(json_array_get(json_object_get(a, "problems"), 0), "located"), "the analysis itself is left as is");
    const char *e = json_string_value(json_object_get(json_array_get(ps, 3), "error"));
    CHECK(e && strstr(e, "line 11 is not in main.py (10 lines)"), "past the end says so: %s", e ? e : "?");
    e = json_string_value(json_object_get(json_array_get(ps, 4), "error"));
    CHECK(e && strstr(e, "no file 'nothere.py'"), "a missing file says so: %s", e ? e : "?");
    json_decref(ps);
    json_decref(a);
    json_decref(files);
}

static void test_halves(void) {
    json_t *prev = json_loads("{\"status\":\"failed\",\"analysis_valid\":true,\"analysis\":{\"total\":3},\"scores\":{},\"total\":3,"
                              "\"feedback\":null,\"timings\":{\"analysis\":{\"total_ms\":5.0}},\"nodes\":{\"analysis\":{\"model\":\"a\"}}}",
                              0, NULL);
    int ha, hb;
    grade_prev_halves(prev, 0, &ha, &hb);
    CHECK(ha && !hb, "analysis done, feedback not: %d %d", ha, hb);
    json_object_set_new(prev, "analysis_valid", json_false());
    grade_prev_halves(prev, 1, &ha, &hb);
    CHECK(!ha, "an invalid analysis is redone under --regrade-invalid");
    grade_prev_halves(prev, 0, &ha, &hb);
    CHECK(ha, "an invalid analysis is a finished half otherwise");
    json_t *rec = json_loads("{\"timings\":{\"analysis\":{},\"feedback\":{}},\"nodes\":{\"analysis\":{},\"feedback\":{}}}", 0, NULL);
    grade_reuse_half(rec, prev, 0);
    CHECK(json_integer_value(json_object_get(rec, "total")) == 3 &&
          json_is_true(json_object_get(json_object_get(json_object_get(rec, "timings"), "analysis"), "reused")) &&
          json_object_get(json_object_get(json_object_get(rec, "timings"), "analysis"), "total_ms") &&
          !strcmp(json_string_value(json_object_get(json_object_get(json_object_get(rec, "nodes"), "analysis"), "model")), "a"),
          "the analysis half copied, marked reused");
    json_decref(rec);
    json_decref(prev);
}

/* ==== Real processes ==== */

typedef struct { pid_t a, b, c, r; int pr; } tc_cluster;

static pid_t tc_node(const char *model, const char *name, int *port) {
    char pf[128];
    snprintf(pf, sizeof pf, TC_DIR "/%s.port", name);
    char *argv[] = {(char *)bin(), "serve", "--role", "local", "-m", (char *)model, "-t", "1", "-c", "2048",
                    "--parallel", "2", "--listen", "127.0.0.1:0", "--port-file", pf, NULL};
    pid_t pid;
    *port = start_named(&pid, argv, TC_DIR, name, 1, asan() ? 120000 : 30000);
    return pid;
}

static int tc_start(tc_cluster *c, const char *ma, const char *mb) {
    int pa, pb, pc;
    c->a = tc_node(ma, "coder", &pa);
    c->b = tc_node(mb, "writer", &pb);
    c->c = tc_node("assets/stories260K.gguf", "base", &pc);
    if (pa <= 0 || pb <= 0 || pc <= 0) return -1;
    char da[64], db[64], dc[64];
    snprintf(da, sizeof da, "coder=127.0.0.1:%d", pa);
    snprintf(db, sizeof db, "writer=127.0.0.1:%d", pb);
    snprintf(dc, sizeof dc, "base=127.0.0.1:%d", pc);
    char *argv[] = {(char *)bin(), "serve", "--role", "router", "--listen", "127.0.0.1:0", "--port-file", TC_DIR "/router.port",
                    "--decode", da, "--decode", db, "--decode", dc, "--health-interval-ms", "100", NULL};
    c->pr = start_named(&c->r, argv, TC_DIR, "router", 1, 20000);
    return c->pr > 0 ? 0 : -1;
}

/* The router's count of chat requests answered 200 (its /metrics). */
static double tc_chat_200(int port) {
    return metric_value(port, "tandem_router_requests_total{endpoint=\"chat\",status=\"200\"} ");
}

/* `tandem grade` with the given models on subs (NULL-terminated); exit
 * status; its stdout and stderr in *log. */
static int tc_grade(int router_port, const char *model_b, const char *out, const char *const *subs, char **log) {
    char url[64];
    if (router_port > 0) snprintf(url, sizeof url, "http://127.0.0.1:%d", router_port);
    else snprintf(url, sizeof url, "http://127.0.0.1:%d", dead_port());
    char *argv[32] = {(char *)bin(), "grade", "--router", url, "--rubric", TC_DIR "/rubric.md", "--analysis-model", "coder",
                      "--feedback-model", (char *)model_b, "--out", (char *)out, "--parallel", "1",
                      "--analysis-tokens", "160", "--feedback-tokens", "12", "--retries", "0", "--quiet"};
    int n = 0;
    while (argv[n]) n++;
    for (int i = 0; subs[i] && n < 31; i++) argv[n++] = (char *)subs[i];
    argv[n] = NULL;
    char path[256];
    snprintf(path, sizeof path, "%s.log", out);
    pid_t pid = spawn_log(argv, path, 1);
    int rc = wait_exit(pid, asan() ? 600000 : 240000);
    *log = slurp(path);
    if (!*log) *log = strdup("");
    return rc;
}

static json_t *tc_rec(const char *out, const char *stem) {
    char path[512];
    snprintf(path, sizeof path, "%s/%s.json", out, stem);
    return json_load_file(path, 0, NULL);
}

static void tc_class(void) {
    mkdir(TC_DIR "/class", 0755);
    mkdir(TC_DIR "/class/binonly", 0755);
    write_text(TC_DIR "/rubric.md", "# Lab\n\n## Correctness (6 points)\nPrints 1 to 5.\n\n## Style (4 points)\nClear names.\n");
    write_text(TC_DIR "/class/alice.py", "for i in range(1, 6):\n    print(i)\n");
    write_text(TC_DIR "/class/empty.py", "  \n\n\t\n");
    FILE *f = fopen(TC_DIR "/class/binonly/prog", "wb");
    for (int i = 0; f && i < 4096; i++) fputc(i % 7 ? i & 0xff : 0, f);
    if (f) fclose(f);
}

static void test_preflight(const tc_cluster *c) {
    const char *subs[] = {TC_DIR "/class/alice.py", NULL};
    char *log;
    double before = tc_chat_200(c->pr);
    if (system("rm -rf " TC_DIR "/pre-*")) {}
    int rc = tc_grade(c->pr, "nosuch", TC_DIR "/pre-model", subs, &log);
    CHECK(rc == 1 && strstr(log, "stopped before the first submission: the router at ") &&
          strstr(log, "serves no model 'nosuch' (it serves: "), "unknown model: exit %d: %.400s", rc, log);
    free(log);
    json_t *r = tc_rec(TC_DIR "/pre-model", "alice.py");
    CHECK(!r, "no record written for an unknown model");
    json_decref(r);
    rc = tc_grade(-1, "writer", TC_DIR "/pre-dead", subs, &log);
    CHECK(rc == 1 && strstr(log, "cannot reach the router at "), "no router: exit %d: %.400s", rc, log);
    free(log);
    /* a model without a chat template: stopped at the preflight, before any analysis */
    char *body = NULL;
    int st = http(c->pr, "POST", "/v1/chat/completions",
                  "{\"model\":\"base\",\"messages\":[{\"role\":\"user\",\"content\":\"hi\"}],\"max_tokens\":1}", &body);
    free(body);
    double mid = tc_chat_200(c->pr);
    rc = tc_grade(c->pr, "base", TC_DIR "/pre-base", subs, &log);
    if (st == 400) {
        CHECK(rc == 1 && strstr(log, "the feedback model 'base' cannot serve a chat request: HTTP 400"),
              "a feedback model that cannot chat: exit %d: %.400s", rc, log);
        r = tc_rec(TC_DIR "/pre-base", "alice.py");
        CHECK(!r, "no analysis spent before learning the feedback model cannot chat");
        json_decref(r);
        /* the preflight's own one-token request to the analysis model only */
        CHECK(tc_chat_200(c->pr) - mid == 1, "one chat request (the preflight's) went out: %.0f", tc_chat_200(c->pr) - mid);
    } else {   /* a fallback template serves it (--chat-template): the preflight lets it through */
        CHECK(st == 200 && rc == 0, "a model that can chat passes the preflight: chat %d, grade exit %d: %.300s", st, rc, log);
    }
    free(log);
    printf("preflight: stopped runs sent %.0f chat request(s) in all\n", mid - before);
}

static void test_flags_and_halves(const tc_cluster *c) {
    const char *out = TC_DIR "/class-out";
    if (system("rm -rf " TC_DIR "/class-out")) {}
    const char *subs[] = {TC_DIR "/class/alice.py", TC_DIR "/class/empty.py", TC_DIR "/class/binonly", NULL};
    char *log;
    double c0 = tc_chat_200(c->pr);
    int rc = tc_grade(c->pr, "writer", out, subs, &log);
    double c1 = tc_chat_200(c->pr);
    CHECK(rc == 0 && strstr(log, "1 graded") && strstr(log, "2 flagged"), "flagged ones do not fail the run: exit %d: %.500s", rc, log);
    free(log);
    /* the preflight's two requests and alice's two: nothing for the flagged */
    CHECK(c1 - c0 == 4, "chat requests: %.0f (want 2 preflight + 2 for alice)", c1 - c0);
    json_t *e = tc_rec(out, "empty.py"), *b = tc_rec(out, "binonly"), *a = tc_rec(out, "alice.py");
    CHECK(e && !strcmp(json_string_value(json_object_get(e, "status")), "flagged") &&
          !strcmp(json_string_value(json_object_get(e, "flag")), "empty"), "empty.py flagged empty");
    CHECK(b && !strcmp(json_string_value(json_object_get(b, "status")), "flagged") &&
          !strcmp(json_string_value(json_object_get(b, "flag")), "binary") &&
          strstr(json_string_value(json_object_get(b, "error")), "only binary files"), "binonly flagged binary");
    CHECK(a && !strcmp(json_string_value(json_object_get(a, "status")), "graded"), "alice graded");
    /* every problem of a valid analysis says whether it points at a real line */
    if (a && json_is_true(json_object_get(a, "analysis_valid"))) {
        json_t *ps = json_object_get(json_object_get(a, "analysis"), "problems"), *pc = json_object_get(a, "problem_checks");
        int unloc = 0, marked = json_array_size(pc) == json_array_size(ps);
        for (size_t i = 0; i < json_array_size(pc); i++) {
            json_t *l = json_object_get(json_array_get(pc, i), "located");
            marked &= json_is_boolean(l);
            unloc += json_is_false(l);
        }
        CHECK(marked && json_integer_value(json_object_get(a, "problems_unlocated")) == unloc,
              "each of %zu problems checked, located or not (%d not)", json_array_size(ps), unloc);
    }
    char *report = slurp(TC_DIR "/class-out/report.md");
    CHECK(report && strstr(report, "flagged: ") && !strstr(report, "failed: flagged"), "the report says flagged");
    free(report);
    /* the feedback half failed last time: a rerun asks for it alone */
    if (a) {
        json_t *keep = json_deep_copy(a);
        json_object_set_new(a, "status", json_string("failed"));
        json_object_set_new(a, "feedback", json_null());
        json_object_set_new(a, "error", json_string("feedback: HTTP 502: test"));
        json_dump_file(a, TC_DIR "/class-out/alice.py.json", JSON_INDENT(2));
        const char *one[] = {TC_DIR "/class/alice.py", NULL};
        c0 = tc_chat_200(c->pr);
        rc = tc_grade(c->pr, "writer", out, one, &log);
        c1 = tc_chat_200(c->pr);
        json_t *n = tc_rec(out, "alice.py");
        CHECK(rc == 0 && c1 - c0 == 3, "rerun: exit %d, %.0f chat requests (want 2 preflight + the feedback)", rc, c1 - c0);
        CHECK(n && !strcmp(json_string_value(json_object_get(n, "status")), "graded") &&
              json_is_string(json_object_get(n, "feedback")) &&
              json_equal(json_object_get(n, "analysis_valid"), json_object_get(keep, "analysis_valid")) &&
              json_equal(json_object_get(n, "total"), json_object_get(keep, "total")) &&
              json_is_true(json_object_get(json_object_get(json_object_get(n, "timings"), "analysis"), "reused")),
              "the analysis kept, the feedback redone: %.300s", log);
        free(log);
        /* the analysis half missing: only it is asked for */
        json_object_set_new(n, "status", json_string("failed"));
        json_object_del(n, "analysis_valid");
        json_object_del(n, "analysis");
        json_object_del(n, "scores");
        json_object_del(n, "total");
        json_object_set_new(n, "error", json_string("analysis: HTTP 502: test"));
        json_t *fb = json_incref(json_object_get(n, "feedback"));
        json_dump_file(n, TC_DIR "/class-out/alice.py.json", JSON_INDENT(2));
        c0 = tc_chat_200(c->pr);
        rc = tc_grade(c->pr, "writer", out, one, &log);
        c1 = tc_chat_200(c->pr);
        json_t *m = tc_rec(out, "alice.py");
        CHECK(rc == 0 && c1 - c0 == 3 && m && !strcmp(json_string_value(json_object_get(m, "status")), "graded") &&
              json_equal(json_object_get(m, "feedback"), fb) && json_is_boolean(json_object_get(m, "analysis_valid")),
              "the feedback kept, the analysis redone: exit %d, %.0f requests: %.300s", rc, c1 - c0, log);
        free(log);
        json_decref(fb);
        json_decref(m);
        json_decref(n);
        json_decref(keep);
    }
    json_decref(a);
    json_decref(b);
    json_decref(e);
}

int main(void) {
    signal(SIGPIPE, SIG_IGN);
    test_text();
    test_problems();
    test_halves();
    mkdir("build", 0755);
    mkdir(TC_DIR, 0755);
    tc_class();
    char ma[600], mb[600];
    t_fixture_path(ma, sizeof ma, "models/qwen3-mini-Q8_0.gguf");
    t_fixture_path(mb, sizeof mb, "models/qwen2-mini-Q4_0.gguf");
    const char *need[] = {ma, mb, NULL};
    tc_cluster c;
    memset(&c, 0, sizeof c);
    if (t_need_all(need)) {
        if (tc_start(&c, ma, mb) == 0) {
            test_preflight(&c);
            test_flags_and_halves(&c);
        } else {
            CHECK(0, "cluster did not start (see " TC_DIR "/*.log)");
        }
    }
    if (c.r > 0) stop_proc(c.r, 10000);
    if (c.a > 0) stop_proc(c.a, 10000);
    if (c.b > 0) stop_proc(c.b, 10000);
    if (c.c > 0) stop_proc(c.c, 10000);
    return t_done("test_grade_check");
}

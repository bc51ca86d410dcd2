/* test_grade.c - `tandem grade`: the rubric parser, the derived schema and
 * its validator, templates and the report renderer in-process; then real
 * processes on loopback: a router and two local nodes serving two different
 * fixture models grade a class of 5 small submissions (records validated
 * against the schema, the report, both requests of a submission in flight at
 * once, the rubric prefix reused from the nodes' caches), a rerun that grades
 * nothing twice, and a node killed mid-run (restarted at once): the failed
 * submission is recorded, the others are graded, a rerun grades only it. */
#include "proc.h"

#include <sys/stat.h>

#include "grade/grade.h"
#include "api/http_api.h"

#define TG_DIR "build/test_grade.d"

/* ==== Helpers ==== */

static grade_rubric tg_rubric(const char *text) {
    grade_rubric r;
    char err[256];
    if (grade_rubric_parse(text, strlen(text), &r, err, sizeof err)) { fprintf(stderr, "rubric: %s\n", err); memset(&r, 0, sizeof r); }
    return r;
}

static int tg_valid(json_t *schema, const char *json, char *err, size_t errlen) {
    json_t *v = json_loads(json, JSON_DECODE_ANY, NULL);
    if (!v) { snprintf(err, errlen, "test JSON does not parse: %s", json); return -2; }
    int rc = grade_schema_validate(schema, v, err, errlen);
    json_decref(v);
    return rc;
}

/* ==== Rubric ==== */

static const char tg_rubric_md[] =
    "# Lab 1: FizzBuzz\n\nGrade the program against these items.\n\n"
    "## Correctness (6 points)\nPrints Fizz, Buzz and FizzBuzz at the right numbers.\n\n"
    "```\n## Not an item (3 points)\n```\n"
    "## Style (4 pts)\n- clear names\n- no dead code\n\n## Notes\nnot part of Style\n";

static void test_rubric(void) {
    grade_rubric r = tg_rubric(tg_rubric_md);
    CHECK(r.n_items == 2 && r.max_total == 10, "heading rubric: %d items, %d points", r.n_items, r.max_total);
    if (r.n_items == 2) {
        CHECK(!strcmp(r.items[0].name, "Correctness") && !strcmp(r.items[0].key, "correctness") && r.items[0].max_points == 6,
              "item 0: %s/%s/%d", r.items[0].name, r.items[0].key, r.items[0].max_points);
        /* a fenced block is description (an example), never an item */
        CHECK(r.items[0].description && strstr(r.items[0].description, "FizzBuzz") && strstr(r.items[0].description, "Not an item"),
              "item 0 description: %s", r.items[0].description);
        CHECK(!strcmp(r.items[1].key, "style") && r.items[1].description && strstr(r.items[1].description, "dead code") &&
              !strstr(r.items[1].description, "not part"), "item 1 description: %s", r.items[1].description);
        CHECK(!strcmp(r.title, "Lab 1: FizzBuzz"), "title %s", r.title);
    }
    grade_rubric_free(&r);
    r = tg_rubric("Intro\n- **Correctness** (5 pts): handles empty input\n1. Style! (3 points) - tidy\n"
                  "* Style? (2 pt)\n+ 2nd try (1 Point)\n  - a sub-bullet without points\n");
    CHECK(r.n_items == 4 && r.max_total == 11, "list rubric: %d items, %d points", r.n_items, r.max_total);
    if (r.n_items == 4) {
        CHECK(!strcmp(r.items[0].name, "Correctness") && !strcmp(r.items[0].description, "handles empty input"),
              "list item 0: '%s' '%s'", r.items[0].name, r.items[0].description);
        CHECK(!strcmp(r.items[1].key, "style") && !strcmp(r.items[2].key, "style_2") && !strcmp(r.items[3].key, "item_2nd_try"),
              "keys %s %s %s", r.items[1].key, r.items[2].key, r.items[3].key);
        CHECK(!strcmp(r.items[1].description, "tidy"), "list item 1 description '%s'", r.items[1].description);
    }
    grade_rubric_free(&r);
    static const char *const bad[][2] = {
        {"# Title\nno items here\n", "no rubric items"},
        {"## A (3 points)\n- B (2 pts)\n", "one form"},
        {"- A (3 pts)\n- A (2 pts)\n", "twice"},
        {"- A (0 pts)\n", "1 to 1000"},
        {"- A (1001 points)\n", "1 to 1000"},
        {"- (3 pts): nameless\n", "needs a name"},
    };
    for (size_t i = 0; i < sizeof bad / sizeof bad[0]; i++) {
        char err[256] = "";
        int rc = grade_rubric_parse(bad[i][0], strlen(bad[i][0]), &r, err, sizeof err);
        CHECK(rc == -1 && strstr(err, bad[i][1]), "bad rubric %zu: rc %d err '%s'", i, rc, err);
    }
    char many[8192] = "";
    for (int i = 0; i < GRADE_MAX_ITEMS + 1; i++) snprintf(many + strlen(many), sizeof many - strlen(many), "- I%d (1 pt)\n", i);
    char err[256] = "";
    CHECK(grade_rubric_parse(many, strlen(many), &r, err, sizeof err) == -1 && strstr(err, "more than"), "65 items: %s", err);
    /* invalid UTF-8 in a rubric is replaced, not passed to JSON */
    r = tg_rubric("- Caf\xe9 (2 pts): x\n");
    CHECK(r.n_items == 1 && strstr(r.text, "\xEF\xBF\xBD"), "invalid UTF-8 replaced");
    grade_rubric_free(&r);
}

/* ==== Schema ==== */

static void test_schema(void) {
    grade_rubric r = tg_rubric(tg_rubric_md);
    json_t *s = grade_rubric_schema(&r);
    char err[512];
    const char *ok = "{\"scores\":{\"correctness\":{\"score\":5,\"justification\":\"good\"},"
                     "\"style\":{\"score\":4.0,\"justification\":\"tidy\"}},\"total\":9,"
                     "\"problems\":[{\"file\":\"a.py\",\"line\":3,\"description\":\"off by one\"}]}";
    CHECK(tg_valid(s, ok, err, sizeof err) == 0, "valid analysis refused: %s", err);
    static const char *const bad[][2] = {
        {"{\"scores\":{\"correctness\":{\"score\":7,\"justification\":\"\"},\"style\":{\"score\":1,\"justification\":\"\"}},\"total\":8,\"problems\":[]}", "maximum"},
        {"{\"scores\":{\"correctness\":{\"score\":-1,\"justification\":\"\"},\"style\":{\"score\":1,\"justification\":\"\"}},\"total\":0,\"problems\":[]}", "minimum"},
        {"{\"scores\":{\"correctness\":{\"score\":1},\"style\":{\"score\":1,\"justification\":\"\"}},\"total\":2,\"problems\":[]}", "justification"},
        {"{\"scores\":{\"style\":{\"score\":1,\"justification\":\"\"}},\"total\":1,\"problems\":[]}", "correctness"},
        {"{\"scores\":{\"correctness\":{\"score\":1,\"justification\":\"\"},\"style\":{\"score\":1,\"justification\":\"\"},\"extra\":{}},\"total\":2,\"problems\":[]}", "not allowed"},
        {"{\"scores\":{\"correctness\":{\"score\":1.5,\"justification\":\"\"},\"style\":{\"score\":1,\"justification\":\"\"}},\"total\":2,\"problems\":[]}", "expected integer"},
        {"{\"scores\":{\"correctness\":{\"score\":1,\"justification\":\"\"},\"style\":{\"score\":1,\"justification\":\"\"}},\"total\":2,\"problems\":[{\"file\":\"a\",\"line\":0,\"description\":\"x\"}]}", "minimum"},
        {"{\"scores\":{\"correctness\":{\"score\":1,\"justification\":\"\"},\"style\":{\"score\":1,\"justification\":\"\"}},\"total\":\"2\",\"problems\":[]}", "expected integer"},
        {"{\"scores\":{\"correctness\":{\"score\":1,\"justification\":\"\"},\"style\":{\"score\":1,\"justification\":\"\"}},\"total\":2}", "problems"},
        {"[1]", "expected object"},
    };
    for (size_t i = 0; i < sizeof bad / sizeof bad[0]; i++) {
        err[0] = 0;
        int rc = tg_valid(s, bad[i][0], err, sizeof err);
        CHECK(rc == -1 && strstr(err, bad[i][1]), "bad analysis %zu: rc %d '%s' (want '%s')", i, rc, err, bad[i][1]);
    }
    /* the analysis parser: a fenced answer is accepted, prose is not */
    char *fenced = malloc(strlen(ok) + 32);
    sprintf(fenced, "```json\n%s\n```", ok);
    json_t *a = grade_analysis_parse(&r, s, fenced, err, sizeof err);
    CHECK(a && json_integer_value(json_object_get(a, "total")) == 9, "fenced analysis: %s", err);
    json_decref(a);
    free(fenced);
    CHECK(!grade_analysis_parse(&r, s, "I think it deserves 9/10.", err, sizeof err) && strstr(err, "not JSON"), "prose: %s", err);
    CHECK(!grade_analysis_parse(&r, s, "", err, sizeof err), "empty analysis refused");
    json_decref(s);
    grade_rubric_free(&r);

    /* the rest of the subset: enum, const, anyOf, $ref, arrays, number, boolean, null */
    json_t *g = json_loads("{\"$defs\":{\"pt\":{\"type\":\"object\",\"properties\":{\"x\":{\"type\":\"number\",\"minimum\":-1,\"maximum\":1}},"
                           "\"required\":[\"x\"]}},\"type\":\"object\",\"properties\":{"
                           "\"kind\":{\"type\":\"string\",\"enum\":[\"a\",\"b\"]},\"v\":{\"const\":3},"
                           "\"opt\":{\"anyOf\":[{\"type\":\"null\"},{\"type\":\"boolean\"}]},"
                           "\"pts\":{\"type\":\"array\",\"items\":{\"$ref\":\"#/$defs/pt\"},\"minItems\":1,\"maxItems\":2}},"
                           "\"additionalProperties\":{\"type\":\"integer\"}}", 0, NULL);
    CHECK(g != NULL, "general schema parses");
    CHECK(tg_valid(g, "{\"kind\":\"a\",\"v\":3,\"opt\":null,\"pts\":[{\"x\":0.5}],\"more\":4}", err, sizeof err) == 0, "general valid: %s", err);
    CHECK(tg_valid(g, "{\"opt\":true}", err, sizeof err) == 0, "anyOf boolean: %s", err);
    static const char *const gbad[][2] = {
        {"{\"kind\":\"c\"}", "enum"}, {"{\"v\":4}", "const"}, {"{\"opt\":1}", "anyOf"},
        {"{\"pts\":[]}", "at least"}, {"{\"pts\":[{\"x\":0},{\"x\":0},{\"x\":0}]}", "at most"},
        {"{\"pts\":[{\"x\":2}]}", "maximum"}, {"{\"pts\":[{}]}", "missing required"}, {"{\"more\":\"s\"}", "expected integer"},
    };
    for (size_t i = 0; i < sizeof gbad / sizeof gbad[0]; i++) {
        err[0] = 0;
        int rc = tg_valid(g, gbad[i][0], err, sizeof err);
        CHECK(rc == -1 && strstr(err, gbad[i][1]), "general bad %zu: rc %d '%s'", i, rc, err);
    }
    json_decref(g);
    g = json_loads("{\"type\":\"string\",\"pattern\":\"x\"}", 0, NULL);
    CHECK(tg_valid(g, "\"x\"", err, sizeof err) == -1 && strstr(err, "unsupported keyword"), "unsupported keyword: %s", err);
    json_decref(g);
    g = json_loads("{\"$defs\":{\"a\":{\"$ref\":\"#/$defs/a\"}},\"$ref\":\"#/$defs/a\"}", 0, NULL);
    CHECK(tg_valid(g, "1", err, sizeof err) == -1 && strstr(err, "deeper"), "$ref loop: %s", err);
    json_decref(g);
}

/* ==== Templates, text, router extension ==== */

static void test_templates(void) {
    grade_template t;
    char err[512];
    CHECK(grade_template_parse(grade_default_analysis_template, &t, err, sizeof err) == 0, "default analysis: %s", err);
    grade_vars v1 = {"RUBRIC", "SCHEMA", "ITEMS", "10", "alice", "CODE-A"}, v2 = v1;
    v2.name = "bob";
    v2.submission = "CODE-B";
    char *s1 = grade_template_render(t.system, &v1), *s2 = grade_template_render(t.system, &v2);
    char *u1 = grade_template_render(t.user, &v1);
    CHECK(s1 && s2 && !strcmp(s1, s2) && strstr(s1, "RUBRIC") && strstr(s1, "SCHEMA") && !strstr(s1, "{{"),
          "system message is the same for every submission: %s", s1);
    CHECK(u1 && strstr(u1, "alice") && strstr(u1, "CODE-A") && !strstr(u1, "RUBRIC"), "user message: %s", u1);
    free(s1); free(s2); free(u1);
    grade_template_free(&t);
    CHECK(grade_template_parse(grade_default_feedback_template, &t, err, sizeof err) == 0, "default feedback: %s", err);
    grade_template_free(&t);
    static const char *const bad[][2] = {
        {"[system]\n{{rubric}} {{submission}}\n[user]\n{{submission}}\n", "belong in the [user]"},
        {"[system]\n{{rubric}}\n[user]\n{{code}}\n", "unknown placeholder"},
        {"[system]\n{{rubric}}\n", "no [user]"},
        {"[user]\nno code\n", "no {{submission}}"},
        {"hello\n[user]\n{{submission}}\n", "before the first"},
    };
    for (size_t i = 0; i < sizeof bad / sizeof bad[0]; i++) {
        err[0] = 0;
        int rc = grade_template_parse(bad[i][0], &t, err, sizeof err);
        CHECK(rc == -1 && strstr(err, bad[i][1]), "bad template %zu: '%s'", i, err);
    }
    CHECK(grade_template_parse("[user]\nGrade {{name}}: {{submission}} {{name}}\n", &t, err, sizeof err) == 0 && !t.system[0],
          "user-only template: %s", err);
    grade_vars v = {.name = "x", .submission = "y"};
    char *u = grade_template_render(t.user, &v);
    CHECK(u && !strcmp(u, "Grade x: y x"), "render: %s", u);
    free(u);
    grade_template_free(&t);

    char *c = grade_utf8_clean("a\xff" "b\xc3\xa9\xed\xa0\x80" "c\0d", 12);
    CHECK(c && !strcmp(c, "a\xEF\xBF\xBD" "b\xc3\xa9\xEF\xBF\xBD\xEF\xBF\xBD\xEF\xBF\xBD" "cd"), "utf8 clean: %s", c);
    free(c);
    char stem[64];
    grade_file_stem("../a b/c", stem, sizeof stem);
    CHECK(!strchr(stem, '/') && stem[0] != '.', "stem %s", stem);
    grade_file_stem("..", stem, sizeof stem);
    CHECK(!strcmp(stem, "submission"), "stem of '..': %s", stem);

    /* the router forwards the ignore_eos extension to the decode node */
    api_limits lim;
    api_limits_default(&lim);
    api_request rq;
    api_error e;
    const char *body = "{\"model\":\"m\",\"messages\":[{\"role\":\"user\",\"content\":\"hi\"}],\"ignore_eos\":true}";
    CHECK(api_parse_request(API_CHAT, body, strlen(body), &lim, &rq, &e) == 0 && rq.ignore_eos, "ignore_eos parsed");
    char *up = api_upstream_body(&rq, "local", NULL);
    CHECK(up && strstr(up, "\"ignore_eos\":true"), "ignore_eos forwarded: %s", up);
    free(up);
    api_request_free(&rq);
    body = "{\"model\":\"m\",\"messages\":[{\"role\":\"user\",\"content\":\"hi\"}],\"ignore_eos\":\"yes\"}";
    CHECK(api_parse_request(API_CHAT, body, strlen(body), &lim, &rq, &e) == -1 && !strcmp(e.param, "ignore_eos"), "ignore_eos type");
}

/* ==== Report ==== */

static json_t *tg_record(const char *name, int c, int s, const char *feedback) {
    return json_pack("{s:s, s:s, s:b, s:{s:{s:s,s:i,s:i,s:s}, s:{s:s,s:i,s:i,s:s}}, s:i, s:s, s:{s:[{s:s,s:i,s:s}]}}",
                     "submission", name, "status", "graded", "analysis_valid", 1,
                     "scores", "correctness", "item", "Correctness", "score", c, "max", 6, "justification", "ok <b>",
                     "style", "item", "Style", "score", s, "max", 4, "justification", "tidy",
                     "total", c + s, "feedback", feedback,
                     "analysis", "problems", "file", "a.py", "line", 3, "description", "off by one");
}

static void test_report(void) {
    grade_rubric r = tg_rubric(tg_rubric_md);
    json_t *recs[6] = {
        tg_record("alice.py", 6, 4, "Well done.\n\nNext: tests."),
        tg_record("bob", 3, 2, "Fix line 2."),
        tg_record("carol.c", 5, 3, "Good structure."),
        tg_record("dave <script>alert(1)</script>", 1, 0, "x"),
        json_pack("{s:s, s:s, s:b, s:n, s:n, s:s, s:{s:s,s:s}}", "submission", "erin", "status", "graded", "analysis_valid", 0,
                  "scores", "total", "feedback", "feedback for erin", "analysis_error", "message", "not JSON", "raw", "zzz"),
        json_pack("{s:s, s:s, s:s}", "submission", "frank", "status", "failed", "error", "feedback: HTTP 502 <oops>"),
    };
    /* timings with cached tokens (alice: 90 of 100 and 40 of 50; bob: 10 of
     * 100, 0 of 50; a bad count, cached past the prompt, is left out) */
    json_object_set_new(recs[0], "timings", json_pack("{s:{s:i,s:i}, s:{s:i,s:i}}", "analysis", "prompt_tokens", 100,
                                                      "cached_tokens", 90, "feedback", "prompt_tokens", 50, "cached_tokens", 40));
    json_object_set_new(recs[1], "timings", json_pack("{s:{s:i,s:i}, s:{s:i,s:i}}", "analysis", "prompt_tokens", 100,
                                                      "cached_tokens", 10, "feedback", "prompt_tokens", 50, "cached_tokens", 0));
    json_object_set_new(recs[2], "timings", json_pack("{s:{s:i,s:i}}", "analysis", "prompt_tokens", 10, "cached_tokens", 11));
    mkdir("build", 0755);
    mkdir(TG_DIR, 0755);
    if (system("rm -rf " TG_DIR "/render")) {}
    mkdir(TG_DIR "/render", 0755);
    char err[256];
    /* the records as files too, as a run leaves them: tools/report_check.sh follows the links */
    for (int i = 0; i < 6; i++) {
        char stem[128], path[256];
        grade_file_stem(json_string_value(json_object_get(recs[i], "submission")), stem, sizeof stem);
        snprintf(path, sizeof path, TG_DIR "/render/%s.json", stem);
        json_dump_file(recs[i], path, JSON_INDENT(2));
    }
    CHECK(grade_report_write(TG_DIR "/render", &r, recs, 6, err, sizeof err) == 0, "report written: %s", err);
    char *html = read_text(TG_DIR "/render/report.html"), *md = read_text(TG_DIR "/render/report.md");
    char *svg = read_text(TG_DIR "/render/totals.svg"), *fb = read_text(TG_DIR "/render/feedback/bob.md");
    CHECK(html && md && svg && fb, "report files exist");
    if (html && md && svg && fb) {
        CHECK(!strstr(html, "<script>") && strstr(html, "dave &lt;script&gt;"), "HTML escapes names");
        CHECK(strstr(html, "HTTP 502 &lt;oops&gt;") && strstr(html, "ok &lt;b&gt;"), "HTML escapes errors and model text");
        CHECK(count_str(html, "<tr class=") == 6 && count_str(html, "<section class=\"student\"") == 6, "one row and section per student");
        CHECK(strstr(html, "href=\"#student-bob\"") && strstr(html, "id=\"student-bob\"") && strstr(html, "href=\"bob.json\""),
              "links to the student's section and record");
        CHECK(count_str(html, "<svg") == 1 && count_str(html, "class=\"bar\"") == 11, "inline SVG with one bar per point value");
        /* totals 10, 5, 8, 1: bins 10, 5, 8, 1 hold one each */
        CHECK(strstr(svg, "<title>10-10: 1</title>") && strstr(svg, "<title>0-0: 0</title>") && strstr(svg, "<title>1-1: 1</title>"),
              "bins of the totals");
        CHECK(strstr(svg, "(4 totals, out of 10 points)"), "chart title counts the totals");
        CHECK(count_str(md, "\n| ") == 7 && strstr(md, "[feedback](feedback/bob.md)") && strstr(md, "failed: feedback: HTTP 502"),
              "markdown table");
        CHECK(strstr(md, "Mean 6.0, median 6.5, lowest 1, highest 10"), "figures: %s", strstr(md, "Mean") ? strstr(md, "Mean") : md);
        CHECK(strstr(fb, "Fix line 2.") && strstr(fb, "Total: 5 / 10"), "feedback file");
        CHECK(strstr(md, "Prompt tokens from the KV cache (usage.prompt_tokens_details.cached_tokens): 140 of 300 (46.7%).") &&
              strstr(html, "<p>Prompt tokens from the KV cache (usage.prompt_tokens_details.cached_tokens): 140 of 300 (46.7%).</p>"),
              "cached prompt tokens summed over the records (the bad count left out)");
    }
    free(html); free(md); free(svg); free(fb);
    for (int i = 0; i < 6; i++) json_decref(recs[i]);
    grade_rubric_free(&r);
}

/* ==== Real processes ==== */

typedef struct { pid_t a, b, r; int pa, pb, pr; char ma[512], mb[512]; } tg_cluster;

static pid_t tg_node(const char *model, int port, const char *name, int *port_out) {
    char listen[64], pf[128];
    snprintf(listen, sizeof listen, "127.0.0.1:%d", port);
    snprintf(pf, sizeof pf, TG_DIR "/%s.port", name);
    char *argv[] = { (char *)bin(), "serve", "--role", "local", "-m", (char *)model, "-t", "1", "-c", "2048",
                     "--parallel", "4", "--listen", listen, "--port-file", pf, NULL };
    pid_t pid;
    *port_out = start_named(&pid, argv, TG_DIR, name, 0, asan() ? 120000 : 30000);
    return pid;
}

static int tg_start(tg_cluster *c) {
    snprintf(c->ma, sizeof c->ma, "%s/models/qwen3-mini-Q8_0.gguf", t_fixtures());
    snprintf(c->mb, sizeof c->mb, "%s/models/qwen2-mini-Q4_0.gguf", t_fixtures());
    c->a = tg_node(c->ma, 0, "node-a", &c->pa);
    c->b = tg_node(c->mb, 0, "node-b", &c->pb);
    if (c->pa <= 0 || c->pb <= 0) return -1;
    char da[64], db[64];
    snprintf(da, sizeof da, "coder=127.0.0.1:%d", c->pa);
    snprintf(db, sizeof db, "writer=127.0.0.1:%d", c->pb);
    char *argv[] = { (char *)bin(), "serve", "--role", "router", "--listen", "127.0.0.1:0", "--port-file", TG_DIR "/router.port",
                     "--decode", da, "--decode", db, "--health-interval-ms", "100", NULL };
    c->pr = start_named(&c->r, argv, TG_DIR, "router", 0, 20000);
    return c->pr > 0 ? 0 : -1;
}

static const char *const tg_names[5] = {"alice.py", "bob", "carol.c", "dave.js", "erin.py"};

static void tg_class(void) {
    mkdir(TG_DIR "/class", 0755);
    mkdir(TG_DIR "/class/bob", 0755);
    write_text(TG_DIR "/rubric.md", tg_rubric_md);
    write_text(TG_DIR "/class/alice.py", "for i in range(1, 16):\n    if i % 15 == 0:\n        print('FizzBuzz')\n"
                                       "    elif i % 3 == 0:\n        print('Fizz')\n    else:\n        print(i)\n");
    write_text(TG_DIR "/class/bob/fb.py", "def fb(n):\n    return 'Fizz' if n % 3 == 0 else str(n)\n");
    write_text(TG_DIR "/class/bob/main.py", "from fb import fb\nfor i in range(20):\n    print(fb(i))\n");
    write_text(TG_DIR "/class/bob/.hidden", "not part of the submission\n");
    write_text(TG_DIR "/class/carol.c", "#include <stdio.h>\nint main(void) {\n    for (int i = 1; i < 16; i++)\n"
                                      "        printf(\"%d\\n\", i);\n}\n");
    write_text(TG_DIR "/class/dave.js", "for (let i = 1; i <= 15; i++)\n  console.log(i % 15 ? i % 5 ? i % 3 ? i : 'Fizz' : 'Buzz' : 'FizzBuzz');\n");
    write_text(TG_DIR "/class/erin.py", "print('\\n'.join('Fizz' * (i % 3 == 0) + 'Buzz' * (i % 5 == 0) or str(i) for i in range(1, 16)))\n");
}

/* Runs `tandem grade` on the class; stdout into *out (malloc'd); exit status. */
static int tg_grade(const tg_cluster *c, const char *outdir, const char *a_tokens, const char *b_tokens, const char *parallel,
                    char **out, pid_t *bg) {
    char url[64], log[256];
    snprintf(url, sizeof url, "http://127.0.0.1:%d", c->pr);
    snprintf(log, sizeof log, "%s.stdout", outdir);
    unlink(log);
    char *argv[] = { (char *)bin(), "grade", "--router", url, "--rubric", TG_DIR "/rubric.md", "--analysis-model", "coder",
                     "--feedback-model", "writer", "--out", (char *)outdir, "--parallel", (char *)parallel,
                     "--analysis-tokens", (char *)a_tokens, "--feedback-tokens", (char *)b_tokens,
                     "--retries", "30", "--backoff", "0.1",
                     TG_DIR "/class/alice.py", TG_DIR "/class/bob", TG_DIR "/class/carol.c", TG_DIR "/class/dave.js",
                     TG_DIR "/class/erin.py", NULL };
    pid_t pid = spawn(argv, log);
    if (bg) { *bg = pid; return 0; }
    int st = 0;
    waitpid(pid, &st, 0);
    *out = read_text(log);
    return WIFEXITED(st) ? WEXITSTATUS(st) : 128 + WTERMSIG(st);
}

static json_t *tg_rec(const char *outdir, const char *name) {
    char path[512];
    snprintf(path, sizeof path, "%s/%s.json", outdir, name);
    return json_load_file(path, 0, NULL);
}

static double tg_chat_200(int router_port) {
    char *body = NULL;
    double v = -1;
    if (http(router_port, "GET", "/metrics", NULL, &body) == 200) {
        const char *k = "tandem_router_requests_total{endpoint=\"chat\",status=\"200\"} ";
        char *p = strstr(body, k);
        if (p) v = atof(p + strlen(k));
    }
    free(body);
    return v;
}

static time_t tg_mtime(const char *outdir, const char *name) {
    char path[512];
    struct stat st;
    snprintf(path, sizeof path, "%s/%s.json", outdir, name);
    if (stat(path, &st)) return 0;
#if defined(__APPLE__)
    struct timespec m = st.st_mtimespec;   /* macOS's name for POSIX's st_mtim */
#else
    struct timespec m = st.st_mtim;
#endif
    return m.tv_sec * 1000000000L + m.tv_nsec;
}

/* Requests in the router's log that reused a cached prefix on their node
 * (computed_local < prompt), per decode port. */
static int tg_reused(const char *log, int port) {
    char key[64];
    snprintf(key, sizeof key, "decode=127.0.0.1:%d ", port);
    int n = 0;
    for (const char *p = log ? strstr(log, key) : NULL; p; p = strstr(p + 1, key)) {
        const char *eol = strchr(p, '\n'), *pr = strstr(p, " prompt="), *cl = strstr(p, " computed_local=");
        if (!pr || !cl || (eol && (pr > eol || cl > eol))) continue;
        if (atoi(cl + 16) < atoi(pr + 8)) n++;
    }
    return n;
}

/* The summary's fraction of prompt tokens served from a cache, -1 without the line. */
static double tg_cached(const char *so, long long *k, long long *p) {
    const char *l = so ? strstr(so, "prompt tokens from the KV cache (usage.prompt_tokens_details.cached_tokens): ") : NULL;
    *k = *p = -1;
    if (!l || sscanf(strchr(l, ':') + 2, "%lld of %lld", k, p) != 2 || *p <= 0) return -1;
    return (double)*k / (double)*p;
}

static void test_class(tg_cluster *c) {
    const char *out = TG_DIR "/class-out";
    char *so = NULL;
    /* the analysis budget holds the largest output the schema allows (every
     * string at its maxLength, the problem list full), so constrained
     * decoding always closes the JSON */
    int rc = tg_grade(c, out, "1400", "48", "2", &so, NULL);
    CHECK(rc == 0 && so && strstr(so, "5 graded") && strstr(so, "0 failed"), "grade run: exit %d, %s", rc, so ? so : "");
    long long k1, p1;
    double f1 = tg_cached(so, &k1, &p1);
    CHECK(f1 >= 0 && f1 <= 1 && p1 > 1000, "first pass: %lld of %lld prompt tokens from the cache", k1, p1);
    CHECK(so && strstr(so, "submissions/hour") && strstr(so, "latency per submission: p50") && strstr(so, "TTFT p50") &&
          strstr(so, "prefilled split 0, local 10"), "summary figures: %s", so ? so : "");
    free(so);
    json_t *schema = json_load_file(TG_DIR "/class-out/schema.json", 0, NULL);
    CHECK(schema != NULL, "schema.json written");
    char da[64], db[64];
    snprintf(da, sizeof da, "127.0.0.1:%d", c->pa);
    snprintf(db, sizeof db, "127.0.0.1:%d", c->pb);
    int valid = 0, overlap = 0;
    for (int i = 0; i < 5; i++) {
        json_t *r = tg_rec(out, tg_names[i]);
        CHECK(r && !strcmp(jstr(r, "status", NULL), "graded") && !strcmp(jstr(r, "submission", NULL), tg_names[i]),
              "%s graded", tg_names[i]);
        if (!r) continue;
        json_t *a = json_object_get(r, "analysis");
        char err[512] = "no analysis";
        if (json_is_true(json_object_get(r, "analysis_valid")) && a && grade_schema_validate(schema, a, err, sizeof err) == 0)
            valid++;
        else
            fprintf(stderr, "%s: analysis does not follow the schema: %s; raw: %.80s\n", tg_names[i],
                    json_is_object(a) ? err : jstr(json_object_get(r, "analysis_error"), "message", NULL),
                    jstr(json_object_get(r, "analysis_error"), "raw", NULL));
        CHECK(json_string_length(json_object_get(r, "feedback")) > 0, "%s: feedback text", tg_names[i]);
        json_t *n = json_object_get(r, "nodes"), *t = json_object_get(r, "timings");
        CHECK(!strcmp(jstr(json_object_get(n, "analysis"), "decode_node", NULL), da) &&
              !strcmp(jstr(json_object_get(n, "feedback"), "decode_node", NULL), db) &&
              !strcmp(jstr(json_object_get(n, "analysis"), "prefill_plan", NULL), "local") &&
              json_is_false(json_object_get(json_object_get(n, "feedback"), "split")), "%s: nodes recorded", tg_names[i]);
        json_t *ta = json_object_get(t, "analysis"), *tb = json_object_get(t, "feedback");
        CHECK(json_number_value(json_object_get(ta, "ttft_ms")) > 0 && json_number_value(json_object_get(tb, "tpot_ms")) > 0 &&
              jint(ta, "prompt_tokens", NULL) > 100, "%s: timings", tg_names[i]);
        double as = json_number_value(json_object_get(ta, "start_ms")), ae = json_number_value(json_object_get(ta, "end_ms"));
        double bs = json_number_value(json_object_get(tb, "start_ms")), be = json_number_value(json_object_get(tb, "end_ms"));
        overlap += as < be && bs < ae;
        if (i == 1) CHECK(json_array_size(json_object_get(r, "files")) == 2, "bob: two files, the hidden one left out");
        json_decref(r);
    }
    CHECK(overlap == 5, "analysis and feedback of each submission in flight at once: %d of 5", overlap);
    /* The acceptance check: every analysis follows the rubric's schema. This
     * needs the router to honour response_format (constrained decoding): the
     * random-weight fixture models write no JSON of their own. */
    CHECK(valid == 5, "analyses that follow the schema: %d of 5", valid);
    json_decref(schema);
    char *log = read_text(TG_DIR "/router.log");
    int ra = tg_reused(log, c->pa), rb = tg_reused(log, c->pb);
    CHECK(ra >= 3 && rb >= 3, "requests that reused the cached rubric prefix: analysis %d, feedback %d of 5", ra, rb);
    free(log);
    char *md = read_text(TG_DIR "/class-out/report.md"), *html = read_text(TG_DIR "/class-out/report.html");
    int listed = 0;
    for (int i = 0; i < 5; i++) listed += md && html && strstr(md, tg_names[i]) && strstr(html, tg_names[i]);
    CHECK(listed == 5 && html && strstr(html, "<svg"), "the report lists all 5 (%d) with the chart", listed);
    free(md);
    free(html);

    /* rerun: nothing is graded twice */
    time_t m0 = tg_mtime(out, "carol.c");
    double before = tg_chat_200(c->pr);
    rc = tg_grade(c, out, "192", "48", "2", &so, NULL);
    double after = tg_chat_200(c->pr);
    CHECK(rc == 0 && so && strstr(so, "0 graded") && strstr(so, "5 skipped"), "rerun skips all: %s", so ? so : "");
    CHECK(before >= 10 && after == before, "rerun sent no request (chat 200s %g -> %g)", before, after);
    CHECK(tg_mtime(out, "carol.c") == m0, "rerun left the records alone");
    free(so);

    /* a second grading pass of the same class (another output directory;
     * short answers: the prompts are what counts): every request finds at
     * least the rubric in a slot (81% here; the first pass computed each
     * node's first prompts whole: 63%) */
    const char *out2 = TG_DIR "/class-out2";
    rc = tg_grade(c, out2, "16", "8", "2", &so, NULL);
    long long k2, p2;
    double f2 = tg_cached(so, &k2, &p2);
    CHECK(rc == 0 && so && strstr(so, "5 graded"), "second pass graded the class: %s", so ? so : "");
    CHECK(p2 == p1 && f2 >= 0.75 && f2 > f1, "second pass: %lld of %lld prompt tokens from the cache (%.1f%%; first pass %.1f%%)",
          k2, p2, 100 * f2, 100 * f1);
    free(so);
    md = read_text(TG_DIR "/class-out2/report.md");
    char want[160];
    snprintf(want, sizeof want, "Prompt tokens from the KV cache (usage.prompt_tokens_details.cached_tokens): %lld of %lld", k2, p2);
    CHECK(md && strstr(md, want), "the second pass's report says %s", want);
    free(md);
}

/* A submission holding a file past --max-bytes is recorded as failed with
 * the reason, and the file is read no further than the limit (no router is
 * needed: the submission fails before any request). */
static void test_oversize(void) {
    const char *sub = TG_DIR "/big-sub", *out = TG_DIR "/big-out";
    if (system("rm -rf " TG_DIR "/big-sub " TG_DIR "/big-out")) {}
    mkdir(sub, 0755);
    write_text(TG_DIR "/rubric.md", tg_rubric_md);
    write_text(TG_DIR "/big-sub/ok.py", "print(1)\n");
    char big[5001];
    memset(big, 'x', 5000);
    big[5000] = 0;
    write_text(TG_DIR "/big-sub/big.py", big);
    char *argv[] = { (char *)bin(), "grade", "--router", "http://127.0.0.1:1", "--rubric", TG_DIR "/rubric.md",
                     "--analysis-model", "a", "--feedback-model", "b", "--out", (char *)out, "--max-bytes", "4096",
                     "--quiet", (char *)sub, NULL };
    pid_t pid = spawn(argv, TG_DIR "/big-out.stdout");
    int st = 0;
    waitpid(pid, &st, 0);
    json_t *r = tg_rec(out, "big-sub");
    const char *e = jstr(r, "error", NULL);
    CHECK(WIFEXITED(st) && WEXITSTATUS(st) == 1 && !strcmp(jstr(r, "status", NULL), "failed") &&
          strstr(e, "big.py is longer than 4096 bytes (the limit is --max-bytes)"),
          "a file past --max-bytes: exit %d, error '%s'", WIFEXITED(st) ? WEXITSTATUS(st) : -1, e);
    json_decref(r);
}

static int tg_busy(int port) {
    char *body = NULL;
    int busy = 0;
    if (http(port, "GET", "/v1/stats", NULL, &body) == 200) {
        json_t *o = json_loads(body, 0, NULL);
        busy = (int)json_integer_value(json_object_get(o, "busy"));
        json_decref(o);
    }
    free(body);
    return busy;
}

static void test_kill(tg_cluster *c) {
    const char *out = TG_DIR "/kill-out";
    pid_t g;
    /* one at a time, long feedback answers: the feedback node is busy most of the run */
    tg_grade(c, out, "32", "400", "1", NULL, &g);
    int killed = 0;
    double t0 = now_ms();
    while (!killed && now_ms() - t0 < 60000) {
        json_t *r = tg_rec(out, "bob");
        int second_done = r != NULL;
        json_decref(r);
        if (second_done && tg_busy(c->pb) > 0) {
            kill(c->b, SIGKILL);
            waitpid(c->b, NULL, 0);
            killed = 1;
        }
        sleep_ms(20);
    }
    CHECK(killed, "feedback node killed mid-run");
    /* back at once on the same port: the rest of the class goes on */
    int port = 0;
    c->b = tg_node(c->mb, c->pb, "node-b2", &port);
    CHECK(port == c->pb, "feedback node restarted on port %d (%d)", c->pb, port);
    int st = 0;
    double tw = now_ms();
    while (waitpid(g, &st, WNOHANG) != g && now_ms() - tw < 90000) sleep_ms(50);
    CHECK(WIFEXITED(st) && WEXITSTATUS(st) == 1, "grade exits 1 when a submission failed (status %d)", st);
    int graded = 0, failed = 0;
    for (int i = 0; i < 5; i++) {
        json_t *r = tg_rec(out, tg_names[i]);
        const char *s = jstr(r, "status", NULL);
        if (!strcmp(s, "graded")) graded++;
        if (!strcmp(s, "failed")) {
            failed++;
            CHECK(strstr(jstr(r, "error", NULL), "feedback") != NULL, "%s: failure names the request: %s", tg_names[i], jstr(r, "error", NULL));
        }
        if (i < 2) CHECK(!strcmp(s, "graded"), "%s (before the kill) graded", tg_names[i]);
        if (i == 4) CHECK(!strcmp(s, "graded"), "the last submission graded after the node came back");
        json_decref(r);
    }
    CHECK(failed >= 1 && graded + failed == 5, "after the kill: %d graded, %d failed", graded, failed);
    char *so = NULL;
    int rc = tg_grade(c, out, "32", "400", "1", &so, NULL);
    char want[64], skipped[64];
    snprintf(want, sizeof want, "%d graded", failed);
    snprintf(skipped, sizeof skipped, "%d skipped", graded);
    CHECK(rc == 0 && so && strstr(so, want) && strstr(so, skipped), "rerun grades only the failed: %s", so ? so : "");
    free(so);
    char *html = read_text(TG_DIR "/kill-out/report.html");
    CHECK(html && count_str(html, "<tr class=\"failed\"") == 0, "after the rerun no failure is left in the report");
    free(html);
}

int main(void) {
    signal(SIGPIPE, SIG_IGN);
    test_rubric();
    test_schema();
    test_templates();
    test_report();
    mkdir("build", 0755);
    mkdir(TG_DIR, 0755);
    if (system("rm -rf " TG_DIR "/class-out " TG_DIR "/class-out2 " TG_DIR "/kill-out")) {}
    tg_class();
    test_oversize();
    tg_cluster c;
    memset(&c, 0, sizeof c);
    char need_a[1024], need_b[1024];
    snprintf(need_a, sizeof need_a, "%s/models/qwen3-mini-Q8_0.gguf", t_fixtures());
    snprintf(need_b, sizeof need_b, "%s/models/qwen2-mini-Q4_0.gguf", t_fixtures());
    const char *need_models[] = { need_a, need_b, NULL };
    int have = t_need_all(need_models);
    if (have && tg_start(&c) == 0) {
        test_class(&c);
        test_kill(&c);
    } else if (have) {
        CHECK(0, "cluster did not start (see " TG_DIR "/*.log)");
    }
    if (c.r > 0) stop_proc(c.r, 5000);
    if (c.a > 0) stop_proc(c.a, 5000);
    if (c.b > 0) stop_proc(c.b, 5000);
    return t_done("test_grade");
}

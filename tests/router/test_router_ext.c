/* test_router_ext.c - what the ecosystem sends beyond OpenAI's fields, on
 * real processes: a router (strict, and one with --lenient-params) and
 * decode nodes on stories260K (a base model: no chat template).
 *
 *  1. an unknown field is a 400 naming it (param, code); --lenient-params
 *     serves it; store: true refused
 *  2. guided_choice, guided_regex, grammar (GBNF), guided_json and
 *     json_schema constrain the output (sampled at temperature 1, checked
 *     by hand-written matchers); a bad one is a 400 naming the field; a
 *     refused schema keyword names itself in param and code
 *  3. stop_token_ids end the output at that token; min_tokens holds it off
 *  4. a prompt plus max_tokens beyond the context: 400 context_length_exceeded
 *  5. chat on a model without a template: the ChatML fallback (health says
 *     "fallback"); --chat-template llama3 chooses (health says "option")
 *  6. X-Request-Id kept (a log id: in the node's log lines too) and echoed;
 *     system_fingerprint in replies and chunks; a 503 carries Retry-After;
 *     a refused request is logged at WARN, a done line names the model
 */
#include "t.h"
#include "proc.h"

#include <ctype.h>
#include <jansson.h>
#include <string.h>

#define TX_DIR "build/test_router_ext.d"
#define TX_SECRET "8412158143d181c6cd8b9ff3fa6fd81415f2fdb3f22a432b68ad339ee62a9fa4"   /* 32 random bytes in hex */

static node_auth_key tx_key;

/* POST to a decode node (signed, as the router signs). */
static int tx_post(int port, const char *path, const char *body, json_t **out);
static int tx_node_post(int port, const char *path, const char *body, json_t **out) {
    sign_key = &tx_key;
    int st = tx_post(port, path, body, out);
    sign_key = NULL;
    return st;
}

static int tx_node_get(int port, const char *path, char **b) {
    sign_key = &tx_key;
    int st = http(port, "GET", path, NULL, b);
    sign_key = NULL;
    return st;
}

typedef struct {
    pid_t na, nb, r, rl, rd;
    int pa, pb, pr, prl, prd;
} tx_env;

/* POST body to port's path: status, parsed reply in *out (or NULL). */
static int tx_post(int port, const char *path, const char *body, json_t **out) {
    char *b = NULL;
    int st = http(port, "POST", path, body, &b);
    *out = b ? json_loads(b, 0, NULL) : NULL;
    free(b);
    return st;
}

static const char *tx_text(json_t *o) {
    json_t *ch = json_array_get(json_object_get(o, "choices"), 0);
    const char *t = json_string_value(json_object_get(ch, "text"));
    return t ? t : json_string_value(json_object_get(json_object_get(ch, "message"), "content"));
}

static void tx_expect_400(int port, const char *path, const char *body, const char *param, const char *code) {
    json_t *o = NULL;
    int st = tx_post(port, path, body, &o);
    json_t *e = json_object_get(o, "error");
    const char *p = json_string_value(json_object_get(e, "param")), *c = json_string_value(json_object_get(e, "code"));
    CHECK(st == 400 && p && c && !strcmp(p, param) && !strcmp(c, code), "%s: status %d param %s code %s (want %s, %s): %s",
          body, st, p ? p : "null", c ? c : "null", param, code, json_string_value(json_object_get(e, "message")));
    json_decref(o);
}

/* ==== Matchers ==== */

/* [0-9]{3}-[a-c]{2} */
static int tx_is_code(const char *s) {
    if (!s || strlen(s) != 6) return 0;
    for (int i = 0; i < 3; i++) if (!isdigit((unsigned char)s[i])) return 0;
    return s[3] == '-' && s[4] >= 'a' && s[4] <= 'c' && s[5] >= 'a' && s[5] <= 'c';
}

/* "<" [a-z]{1,5} ">" */
static int tx_is_tag(const char *s) {
    size_t n = s ? strlen(s) : 0;
    if (n < 3 || n > 7 || s[0] != '<' || s[n - 1] != '>') return 0;
    for (size_t i = 1; i + 1 < n; i++) if (s[i] < 'a' || s[i] > 'z') return 0;
    return 1;
}

static int tx_is_date(const char *s) {
    int y, m, d, k = 0;
    return s && strlen(s) == 10 && sscanf(s, "%4d-%2d-%2d%n", &y, &m, &d, &k) == 3 && k == 10 && m >= 1 && m <= 12 && d >= 1 &&
           d <= 31;
}

/* ==== 1, 2: fields and constraints ==== */

static void test_fields(tx_env *x) {
    tx_expect_400(x->pr, "/v1/completions", "{\"model\":\"stories\",\"prompt\":\"Once\",\"max_tokens\":2,\"best_of_n\":3}",
                  "best_of_n", "unknown_parameter");
    tx_expect_400(x->pr, "/v1/chat/completions", "{\"model\":\"stories\",\"messages\":[{\"role\":\"user\",\"content\":\"hi\"}],"
                  "\"reasoning_effort\":\"low\"}", "reasoning_effort", "unknown_parameter");
    tx_expect_400(x->pr, "/v1/completions", "{\"model\":\"stories\",\"prompt\":\"Once\",\"store\":true}", "store", "unsupported_parameter");
    json_t *o = NULL;
    int st = tx_post(x->prl, "/v1/completions", "{\"model\":\"stories\",\"prompt\":\"Once\",\"max_tokens\":2,\"best_of_n\":3}", &o);
    CHECK(st == 200 && tx_text(o), "--lenient-params serves an unknown field: %d", st);
    json_decref(o);
    st = tx_post(x->pr, "/v1/completions", "{\"model\":\"stories\",\"prompt\":\"Once\",\"max_tokens\":2,\"user\":\"u1\",\"metadata\":{\"a\":\"b\"},"
                 "\"store\":false,\"service_tier\":\"auto\"}", &o);
    CHECK(st == 200, "user, metadata, store false, service_tier auto accepted: %d", st);
    json_decref(o);
}

static void test_constraints(tx_env *x) {
    char body[1024];
    int choice_ok = 0, code_ok = 0, tag_ok = 0, date_ok = 0, uuid_ok = 0;
    for (int seed = 1; seed <= 3; seed++) {
        json_t *o = NULL;
        snprintf(body, sizeof body, "{\"model\":\"stories\",\"prompt\":\"Once upon a time\",\"max_tokens\":20,\"temperature\":1,"
                 "\"seed\":%d,\"guided_choice\":[\"red\",\"green\",\"blue sky\"]}", seed);
        int st = tx_post(x->pr, "/v1/completions", body, &o);
        const char *t = tx_text(o);
        choice_ok += st == 200 && t && (!strcmp(t, "red") || !strcmp(t, "green") || !strcmp(t, "blue sky"));
        json_decref(o);
        snprintf(body, sizeof body, "{\"model\":\"stories\",\"prompt\":\"Once upon a time\",\"max_tokens\":20,\"temperature\":1,"
                 "\"seed\":%d,\"guided_regex\":\"[0-9]{3}-[a-c]{2}\"}", seed);
        st = tx_post(x->pr, "/v1/completions", body, &o);
        code_ok += st == 200 && tx_is_code(tx_text(o));
        if (!(st == 200 && tx_is_code(tx_text(o)))) printf("guided_regex: %d %s\n", st, tx_text(o) ? tx_text(o) : "-");
        json_decref(o);
        snprintf(body, sizeof body, "{\"model\":\"stories\",\"messages\":[{\"role\":\"user\",\"content\":\"A tag?\"}],\"max_tokens\":20,"
                 "\"temperature\":1,\"seed\":%d,\"grammar\":\"root ::= \\\"<\\\" [a-z]{1,5} \\\">\\\"  # a tag\\n\"}", seed);
        st = tx_post(x->pr, "/v1/chat/completions", body, &o);
        tag_ok += st == 200 && tx_is_tag(tx_text(o));
        if (!(st == 200 && tx_is_tag(tx_text(o)))) printf("grammar: %d %s\n", st, tx_text(o) ? tx_text(o) : "-");
        json_decref(o);
        snprintf(body, sizeof body, "{\"model\":\"stories\",\"prompt\":\"Once\",\"max_tokens\":40,\"temperature\":1,\"seed\":%d,"
                 "\"guided_json\":{\"type\":\"object\",\"properties\":{\"d\":{\"type\":\"string\",\"format\":\"date\"}},"
                 "\"required\":[\"d\"],\"additionalProperties\":false}}", seed);
        st = tx_post(x->pr, "/v1/completions", body, &o);
        json_t *v = tx_text(o) ? json_loads(tx_text(o), 0, NULL) : NULL;
        date_ok += st == 200 && tx_is_date(json_string_value(json_object_get(v, "d")));
        if (!(st == 200 && v)) printf("guided_json: %d %s\n", st, tx_text(o) ? tx_text(o) : "-");
        json_decref(v);
        json_decref(o);
        snprintf(body, sizeof body, "{\"model\":\"stories\",\"prompt\":\"Once\",\"max_tokens\":60,\"temperature\":1,\"seed\":%d,"
                 "\"json_schema\":{\"type\":\"string\",\"format\":\"uuid\"}}", seed);
        st = tx_post(x->pr, "/v1/completions", body, &o);
        v = tx_text(o) ? json_loads(tx_text(o), JSON_DECODE_ANY, NULL) : NULL;
        uuid_ok += st == 200 && json_is_string(v) && strlen(json_string_value(v)) == 36 && json_string_value(v)[8] == '-';
        json_decref(v);
        json_decref(o);
    }
    CHECK(choice_ok == 3, "guided_choice: %d of 3 outputs one of the choices", choice_ok);
    CHECK(code_ok == 3, "guided_regex: %d of 3 outputs match", code_ok);
    CHECK(tag_ok == 3, "grammar (GBNF) through chat: %d of 3 outputs match", tag_ok);
    CHECK(date_ok == 3, "guided_json with format date: %d of 3", date_ok);
    CHECK(uuid_ok == 3, "json_schema (top level) with format uuid: %d of 3", uuid_ok);
    tx_expect_400(x->pr, "/v1/completions", "{\"model\":\"stories\",\"prompt\":\"x\",\"guided_regex\":\"(a\"}", "guided_regex", "invalid_regex");
    tx_expect_400(x->pr, "/v1/completions", "{\"model\":\"stories\",\"prompt\":\"x\",\"grammar\":\"expr ::= \\\"a\\\"\"}", "grammar", "invalid_grammar");
    tx_expect_400(x->pr, "/v1/completions", "{\"model\":\"stories\",\"prompt\":\"x\",\"guided_choice\":[]}", "guided_choice", "invalid_value");
    tx_expect_400(x->pr, "/v1/completions", "{\"model\":\"stories\",\"prompt\":\"x\",\"guided_regex\":\"a\",\"guided_choice\":[\"a\"]}",
                  "guided_choice", "invalid_value");
    tx_expect_400(x->pr, "/v1/completions", "{\"model\":\"stories\",\"prompt\":\"x\",\"min_tokens\":3,\"guided_regex\":\"a+\"}",
                  "min_tokens", "invalid_value");
    tx_expect_400(x->pr, "/v1/chat/completions", "{\"model\":\"stories\",\"messages\":[{\"role\":\"user\",\"content\":\"x\"}],"
                  "\"response_format\":{\"type\":\"json_schema\",\"json_schema\":{\"name\":\"n\",\"schema\":{\"type\":\"object\","
                  "\"properties\":{\"h\":{\"type\":\"string\",\"format\":\"hostname\"}}}}}}",
                  "response_format.json_schema.schema#/properties/h/format", "unsupported_schema_keyword");
    tx_expect_400(x->pr, "/v1/completions", "{\"model\":\"stories\",\"prompt\":\"x\",\"guided_json\":{\"oneOf\":[{\"type\":\"string\"}]}}",
                  "guided_json#/oneOf", "unsupported_schema_keyword");
}

/* ==== 3. stop_token_ids, min_tokens ==== */

static void test_stop_ids(tx_env *x) {
    json_t *o = NULL;
    int st = tx_node_post(x->pa, "/v1/generate", "{\"prompt\":\"Once upon a time\",\"max_tokens\":10,\"temperature\":0}", &o);
    json_t *toks = json_object_get(o, "tokens");
    CHECK(st == 200 && json_array_size(toks) == 10, "greedy ids from the node: %d", st);
    /* the first token id that did not occur before it, from the third on */
    int at = -1;
    long long id = -1;
    for (size_t i = 2; i < json_array_size(toks) && at < 0; i++) {
        long long t = json_integer_value(json_array_get(toks, i));
        int seen = 0;
        for (size_t k = 0; k < i; k++) seen |= json_integer_value(json_array_get(toks, k)) == t;
        if (!seen) { at = (int)i; id = t; }
    }
    json_decref(o);
    CHECK(at >= 2, "a token to stop at");
    if (at < 0) return;
    char body[512];
    snprintf(body, sizeof body, "{\"model\":\"stories\",\"prompt\":\"Once upon a time\",\"max_tokens\":10,\"temperature\":0,"
             "\"stop_token_ids\":[%lld]}", id);
    st = tx_post(x->pr, "/v1/completions", body, &o);
    json_t *ch = json_array_get(json_object_get(o, "choices"), 0);
    long long got = json_integer_value(json_object_get(json_object_get(o, "usage"), "completion_tokens"));
    CHECK(st == 200 && got == at && !strcmp(json_string_value(json_object_get(ch, "finish_reason")), "stop"),
          "stop_token_ids [%lld]: %lld tokens, want %d, finish stop", id, got, at);
    json_decref(o);
    snprintf(body, sizeof body, "{\"model\":\"stories\",\"prompt\":\"Once upon a time\",\"max_tokens\":10,\"temperature\":0,"
             "\"stop_token_ids\":[%lld],\"min_tokens\":%d}", id, at + 3);
    st = tx_post(x->pr, "/v1/completions", body, &o);
    got = json_integer_value(json_object_get(json_object_get(o, "usage"), "completion_tokens"));
    CHECK(st == 200 && got >= at + 3, "min_tokens %d holds the stop id off: %lld tokens", at + 3, got);
    json_decref(o);
    tx_expect_400(x->pr, "/v1/completions", "{\"model\":\"stories\",\"prompt\":\"x\",\"stop_token_ids\":[-1]}", "stop_token_ids", "invalid_value");
    st = tx_post(x->pr, "/v1/completions", "{\"model\":\"stories\",\"prompt\":\"x\",\"stop_token_ids\":[99999]}", &o);
    CHECK(st == 400, "a stop id beyond the vocabulary: %d", st);
    json_decref(o);
}

/* ==== 4. Context ==== */

static void test_context(tx_env *x) {
    /* node b: a 64-token context */
    tx_expect_400(x->pr, "/v1/completions", "{\"model\":\"tiny\",\"prompt\":\"Once upon a time\",\"max_tokens\":62}", "prompt",
                  "context_length_exceeded");
    json_t *o = NULL;
    int st = tx_post(x->pr, "/v1/completions", "{\"model\":\"tiny\",\"prompt\":\"Once upon a time\",\"max_tokens\":40}", &o);
    CHECK(st == 200, "within the context: %d", st);
    json_decref(o);
    st = tx_post(x->pr, "/v1/completions", "{\"model\":\"tiny\",\"prompt\":\"Once upon a time\",\"ignore_eos\":true}", &o);
    json_t *ch = json_array_get(json_object_get(o, "choices"), 0);
    CHECK(st == 200 && !strcmp(json_string_value(json_object_get(ch, "finish_reason")), "length"),
          "no max_tokens: until the end of the context (length): %d", st);
    json_decref(o);
}

/* ==== 5. Chat templates ==== */

static void test_templates(tx_env *x) {
    char *b = NULL;
    tx_node_get(x->pa, "/health", &b);
    json_t *h = b ? json_loads(b, 0, NULL) : NULL;
    CHECK(!strcmp(jstr(h, "chat_format", NULL), "chatml") && !strcmp(jstr(h, "chat_template", NULL), "fallback"),
          "a model without a template: ChatML fallback: %s", b);
    json_decref(h);
    free(b);
    tx_node_get(x->pb, "/health", &b);
    h = b ? json_loads(b, 0, NULL) : NULL;
    CHECK(!strcmp(jstr(h, "chat_format", NULL), "llama3") && !strcmp(jstr(h, "chat_template", NULL), "option"),
          "--chat-template llama3: %s", b);
    json_decref(h);
    free(b);
    json_t *o = NULL;
    const char *chat = "{\"model\":\"stories\",\"messages\":[{\"role\":\"user\",\"content\":\"Once upon a time\"}],\"max_tokens\":5}";
    int st = tx_post(x->pr, "/v1/chat/completions", chat, &o);
    CHECK(st == 200 && tx_text(o), "chat on a base model (fallback template): %d", st);
    json_decref(o);
    /* the prompt is the ChatML rendering */
    st = tx_node_post(x->pa, "/v1/tokenize", "{\"messages\":[{\"role\":\"user\",\"content\":\"hi\"}]}", &o);
    json_t *ids = json_object_get(o, "tokens");
    CHECK(st == 200 && json_array_size(ids) > 8, "chat prompt tokenized through the fallback: %d, %zu ids", st, json_array_size(ids));
    json_decref(o);
}

/* ==== 6. Conformance details ==== */

static void test_conformance(tx_env *x) {
    char *raw = NULL, v[128];
    const char *body = "{\"model\":\"stories\",\"prompt\":\"Once\",\"max_tokens\":3}";
    int st = http_raw(x->pr, "POST", "/v1/completions", "X-Request-Id: 0badc0de\r\n", body, &raw);
    CHECK(st == 200 && !strcmp(http_header(raw, "X-Request-Id", v, sizeof v), "0badc0de"), "a log id is echoed: %d '%s'", st, v);
    CHECK(raw && strstr(raw, "\"system_fingerprint\":\"fp_tandem_"), "system_fingerprint in a reply");
    free(raw);
    st = http_raw(x->pr, "POST", "/v1/completions", "X-Request-Id: trace-7f.a:b_c\r\n",
                  "{\"model\":\"stories\",\"prompt\":\"Once\",\"max_tokens\":3,\"stream\":true}", &raw);
    CHECK(st == 200 && !strcmp(http_header(raw, "X-Request-Id", v, sizeof v), "trace-7f.a:b_c"), "a client's own id is echoed: '%s'", v);
    CHECK(raw && count_str(raw, "\"system_fingerprint\":\"fp_tandem_") >= 2, "system_fingerprint in every chunk");
    free(raw);
    st = http_raw(x->pr, "POST", "/v1/completions", "X-Request-Id: trace-refused\r\n", "{\"model\":\"stories\"}", &raw);
    CHECK(st == 400 && !strcmp(http_header(raw, "X-Request-Id", v, sizeof v), "trace-refused"), "a refusal echoes the id: '%s'", v);
    free(raw);
    /* a router whose node is not there: 503 with Retry-After */
    double t0 = now_ms();
    st = 0;
    while (now_ms() - t0 < 8000) {
        st = http_raw(x->prd, "POST", "/v1/completions", NULL, body, &raw);
        if (st == 503) break;
        free(raw);
        raw = NULL;
        sleep_ms(200);
    }
    CHECK(st == 503 && http_header(raw, "Retry-After", v, sizeof v)[0], "503 with Retry-After '%s' (status %d)", v, st);
    free(raw);
    /* logs: the node's line carries the client's log id; refusals at WARN; done names the model */
    sleep_ms(300);
    char *nlog = slurp(TX_DIR "/na.log"), *rlog = slurp(TX_DIR "/r.log");
    CHECK(nlog && strstr(nlog, "req=0badc0de done finish=") && strstr(nlog, " model=stories260K"),
          "the node logs the client's X-Request-Id, its done line names the model");
    CHECK(rlog && strstr(rlog, " WARN router req=") && strstr(rlog, "refused status=400"), "a refusal at WARN");
    CHECK(rlog && strstr(rlog, "model=stories") && strstr(rlog, "client_request_id=trace-7f.a:b_c"),
          "done lines name the model and the client's id");
    free(nlog);
    free(rlog);
}

/* ==== Setup ==== */

static int tx_setup(tx_env *x) {
    mkdir("build", 0755);
    mkdir(TX_DIR, 0755);
    write_text(TX_DIR "/secret", TX_SECRET "\n");
    node_auth_derive(&tx_key, TX_SECRET, strlen(TX_SECRET), NODE_AUTH_LABEL_DECODE_API);
    char *b = (char *)bin();
    char *na[] = {b, "serve", "--role", "local", "-m", "assets/stories260K.gguf", "-t", "1", "--secret-file", TX_DIR "/secret",
                  "--listen", "127.0.0.1:0", "--port-file", TX_DIR "/na.port", NULL};
    if ((x->pa = start_named(&x->na, na, TX_DIR, "na", 1, 60000)) <= 0) return -1;
    char *nb[] = {b, "serve", "--role", "local", "-m", "assets/stories260K.gguf", "-t", "1", "-c", "64", "--chat-template", "llama3",
                  "--secret-file", TX_DIR "/secret", "--listen", "127.0.0.1:0", "--port-file", TX_DIR "/nb.port", NULL};
    if ((x->pb = start_named(&x->nb, nb, TX_DIR, "nb", 1, 60000)) <= 0) return -1;
    char da[64], db[64], dd[64];
    snprintf(da, sizeof da, "stories=127.0.0.1:%d", x->pa);
    snprintf(db, sizeof db, "tiny=127.0.0.1:%d", x->pb);
    snprintf(dd, sizeof dd, "stories=127.0.0.1:%d", dead_port());
    char *r[] = {b, "serve", "--role", "router", "--listen", "127.0.0.1:0", "--secret-file", TX_DIR "/secret", "--decode", da,
                 "--decode", db, "--port-file", TX_DIR "/r.port", NULL};
    if ((x->pr = start_named(&x->r, r, TX_DIR, "r", 1, 60000)) <= 0) return -1;
    char *rl[] = {b, "serve", "--role", "router", "--listen", "127.0.0.1:0", "--secret-file", TX_DIR "/secret", "--decode", da,
                  "--lenient-params", "--port-file", TX_DIR "/rl.port", NULL};
    if ((x->prl = start_named(&x->rl, rl, TX_DIR, "rl", 1, 60000)) <= 0) return -1;
    char *rd[] = {b, "serve", "--role", "router", "--listen", "127.0.0.1:0", "--secret-file", TX_DIR "/secret", "--decode", dd,
                  "--health-interval-ms", "100", "--port-file", TX_DIR "/rd.port", NULL};
    if ((x->prd = start_named(&x->rd, rd, TX_DIR, "rd", 1, 60000)) <= 0) return -1;
    return 0;
}

int main(void) {
    signal(SIGPIPE, SIG_IGN);
    unsetenv("TANDEM_SECRET");
    unsetenv("TANDEM_API_KEY");
    unsetenv("TANDEM_LOG_LEVEL");
    tx_env x;
    memset(&x, 0, sizeof x);
    CHECK(access(bin(), X_OK) == 0, "tandem binary %s", bin());
    if (access(bin(), X_OK) == 0 && tx_setup(&x) == 0) {
        test_fields(&x);
        test_constraints(&x);
        test_stop_ids(&x);
        test_context(&x);
        test_templates(&x);
        test_conformance(&x);
    }
    pid_t all[] = {x.r, x.rl, x.rd, x.na, x.nb};
    for (size_t i = 0; i < sizeof all / sizeof *all; i++)
        if (all[i] > 0) CHECK(stop_proc(all[i], 5000) == 0, "process %zu stops cleanly", i);
    return t_done("test_router_ext");
}

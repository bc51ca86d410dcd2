/* test_router_responses.c - POST /v1/responses (router_responses.c) with
 * real processes: a qwen3 fixture node behind a router.
 *   - malformed bodies: a 400 in the OpenAI error shape whose param names
 *     the field as the Responses body spells it (input[2].role,
 *     text.format.name, max_output_tokens, ...), unknown fields refused by
 *     name (code unknown_parameter), fields the router cannot honour
 *     refused by name (unsupported_parameter); an unknown model 404; GET 405
 *   - the event stream on the wire: every "event: X" line's data has type
 *     X, no chat "[DONE]", a non-stream answer equal to the streamed one
 *   - a decode node killed mid-stream: an "error" event and
 *     response.failed, never a silent end
 *   - the official Python client (tests/clients/responses_checks.py):
 *     text, instructions and input items, the stream, json_schema and
 *     parse(), function calls and their round trip, errors. */
#include "proc.h"

#include <jansson.h>

#include "base/strbuf.h"

#define TR_DIR "build/test_router_responses.d"

typedef struct {
    pid_t node, router, slow, router2;
    int pnode, prouter, pslow, prouter2;
    char model[512];
} tr_env;

static int tr_setup(tr_env *e) {
    char b[512];
    snprintf(b, sizeof b, "%s", bin());
    char *node[] = {b, "serve", "--role", "local", "-m", e->model, "-t", "1", "-c", "512", "--listen", "127.0.0.1:0",
                    "--port-file", TR_DIR "/node.port", NULL};
    e->pnode = start_named(&e->node, node, TR_DIR, "node", 1, 60000);
    if (e->pnode <= 0) return -1;
    char dn[64];
    snprintf(dn, sizeof dn, "qwen3=127.0.0.1:%d", e->pnode);
    char *r[] = {b, "serve", "--role", "router", "--listen", "127.0.0.1:0", "--decode", dn, "--health-interval-ms", "200",
                 "--port-file", TR_DIR "/router.port", NULL};
    e->prouter = start_named(&e->router, r, TR_DIR, "router", 1, 30000);
    return e->prouter > 0 ? 0 : -1;
}

static json_t *tr_post(int port, const char *body, int *status) {
    char *out = NULL;
    *status = http(port, "POST", "/v1/responses", body, &out);
    json_t *o = out ? json_loads(out, 0, NULL) : NULL;
    free(out);
    return o;
}

/* ==== Malformed bodies ==== */

static void test_malformed(tr_env *e) {
    static const struct { const char *body, *param, *code; int status; } cases[] = {
        {"not json", NULL, "invalid_json", 400},
        {"[1]", NULL, "invalid_json", 400},
        {"{\"model\":\"qwen3\"}", "input", "missing_required_parameter", 400},
        {"{\"model\":\"qwen3\",\"input\":5}", "input", "invalid_type", 400},
        {"{\"model\":\"qwen3\",\"input\":[]}", "input", "invalid_type", 400},
        {"{\"model\":\"qwen3\",\"input\":[5]}", "input[0]", "invalid_type", 400},
        {"{\"model\":\"qwen3\",\"input\":[{\"role\":\"user\",\"content\":\"a\"},{\"role\":\"user\",\"content\":\"b\"},"
         "{\"role\":\"robot\",\"content\":\"x\"}]}", "input[2].role", "invalid_value", 400},
        {"{\"model\":\"qwen3\",\"input\":[{\"role\":\"user\",\"content\":\"x\",\"extra\":1}]}", "input[0].extra",
         "unknown_parameter", 400},
        {"{\"model\":\"qwen3\",\"input\":[{\"role\":\"user\",\"content\":[{\"type\":\"input_image\",\"image_url\":\"x\"}]}]}",
         "input[0].content[0]", "unsupported_value", 400},
        {"{\"model\":\"qwen3\",\"input\":[{\"role\":\"user\",\"content\":5}]}", "input[0].content", "invalid_type", 400},
        {"{\"model\":\"qwen3\",\"input\":[{\"type\":\"function_call\",\"name\":\"f\"}]}", "input[0]", "invalid_type", 400},
        {"{\"model\":\"qwen3\",\"input\":[{\"type\":\"function_call_output\",\"call_id\":5,\"output\":\"x\"}]}",
         "input[0].call_id", "invalid_type", 400},
        {"{\"model\":\"qwen3\",\"input\":[{\"type\":\"item_reference\",\"id\":\"x\"}]}", "input[0].type",
         "unsupported_value", 400},
        {"{\"model\":\"qwen3\",\"input\":\"x\",\"text\":{\"format\":{\"type\":\"json_schema\",\"schema\":{}}}}",
         "text.format.name", "missing_required_parameter", 400},
        {"{\"model\":\"qwen3\",\"input\":\"x\",\"text\":{\"format\":{\"type\":\"json_schema\",\"name\":\"n\"}}}",
         "text.format.schema", "missing_required_parameter", 400},
        {"{\"model\":\"qwen3\",\"input\":\"x\",\"text\":{\"format\":{\"type\":\"xml\"}}}", "text.format.type",
         "invalid_value", 400},
        {"{\"model\":\"qwen3\",\"input\":\"x\",\"text\":{\"format\":{\"type\":\"text\",\"x\":1}}}", "text.format.x",
         "unknown_parameter", 400},
        {"{\"model\":\"qwen3\",\"input\":\"x\",\"text\":{\"verbosity\":\"low\"}}", "text.verbosity",
         "unsupported_parameter", 400},
        {"{\"model\":\"qwen3\",\"input\":\"x\",\"tools\":[{\"type\":\"web_search\"}]}", "tools[0].type",
         "unsupported_value", 400},
        {"{\"model\":\"qwen3\",\"input\":\"x\",\"tools\":[{\"type\":\"function\",\"name\":\"f\",\"bogus\":1}]}",
         "tools[0].bogus", "unknown_parameter", 400},
        {"{\"model\":\"qwen3\",\"input\":\"x\",\"tool_choice\":{\"type\":\"mcp\"}}", "tool_choice", "unsupported_value", 400},
        {"{\"model\":\"qwen3\",\"input\":\"x\",\"max_output_tokens\":0}", "max_output_tokens", "invalid_value", 400},
        {"{\"model\":\"qwen3\",\"input\":\"x\",\"temperature\":5}", "temperature", "invalid_value", 400},
        {"{\"model\":\"qwen3\",\"input\":\"x\",\"frobnicate\":1}", "frobnicate", "unknown_parameter", 400},
        {"{\"model\":\"qwen3\",\"input\":\"x\",\"previous_response_id\":\"resp_1\"}", "previous_response_id",
         "unsupported_parameter", 400},
        {"{\"model\":\"qwen3\",\"input\":\"x\",\"truncation\":\"auto\"}", "truncation", "unsupported_parameter", 400},
        {"{\"model\":\"qwen3\",\"input\":\"x\",\"instructions\":5}", "instructions", "invalid_type", 400},
        {"{\"model\":\"qwen3\",\"input\":\"x\",\"metadata\":\"m\"}", "metadata", "invalid_type", 400},
        {"{\"model\":\"nope\",\"input\":\"x\"}", "model", "model_not_found", 404},
    };
    for (size_t i = 0; i < sizeof cases / sizeof cases[0]; i++) {
        int st;
        json_t *o = tr_post(e->prouter, cases[i].body, &st);
        json_t *err = json_object_get(o, "error");
        const char *param = jstr(err, "param", NULL), *code = jstr(err, "code", NULL), *msg = jstr(err, "message", NULL);
        int param_ok = cases[i].param ? param && !strcmp(param, cases[i].param) : json_is_null(json_object_get(err, "param"));
        CHECK(st == cases[i].status && param_ok && code && !strcmp(code, cases[i].code) && msg && *msg &&
              !strcmp(jstr(err, "type", NULL) ? jstr(err, "type", NULL) : "", "invalid_request_error"),
              "%s: %d param %s code %s (%s)", cases[i].body, st, param ? param : "null", code ? code : "null",
              msg ? msg : "-");
        if (i == 21) CHECK(msg && strstr(msg, "'max_output_tokens'") && !strstr(msg, "'max_tokens'"),
                           "the renamed field's message names it as sent: %s", msg ? msg : "-");
        json_decref(o);
    }
    char *out = NULL;
    int st = http(e->prouter, "GET", "/v1/responses", NULL, &out);
    CHECK(st == 405, "GET /v1/responses: %d", st);
    free(out);
    /* harmless values of the fields the router cannot honour otherwise are accepted */
    json_t *o = tr_post(e->prouter, "{\"model\":\"qwen3\",\"input\":\"Hi\",\"max_output_tokens\":2,\"store\":true,"
                                    "\"truncation\":\"disabled\",\"include\":[],\"background\":false,\"reasoning\":null,"
                                    "\"user\":\"u1\",\"metadata\":{\"k\":\"v\"},\"service_tier\":\"auto\"}", &st);
    CHECK(st == 200 && json_is_false(json_object_get(o, "store")) && !strcmp(jstr(o, "user", NULL), "u1") &&
          !strcmp(jstr(json_object_get(o, "metadata"), "k", NULL), "v"),
          "defaults accepted, store answered false, user and metadata echoed: %d", st);
    json_decref(o);
}

/* ==== The stream on the wire ==== */

/* Checks every event of a Responses stream; the concatenated text deltas
 * into text, the last event's type into last. Returns the event count. */
static int tr_events(char *sse, char *text, size_t cap, char *last, size_t lcap, int *bad, int *done_marker) {
    int n = 0;
    size_t tl = 0;
    char ev[80] = "";
    text[0] = last[0] = 0;
    *bad = *done_marker = 0;
    for (char *save = NULL, *l = strtok_r(sse, "\n", &save); l; l = strtok_r(NULL, "\n", &save)) {
        if (!strncmp(l, "event: ", 7)) { snprintf(ev, sizeof ev, "%s", l + 7); continue; }
        if (strncmp(l, "data: ", 6)) continue;
        if (!strcmp(l + 6, "[DONE]")) { (*done_marker)++; continue; }
        json_t *o = json_loads(l + 6, 0, NULL);
        const char *ty = jstr(o, "type", NULL);
        if (!ty || strcmp(ty, ev) || jint(o, "sequence_number", NULL) != n) (*bad)++;
        if (ty && !strcmp(ty, "response.output_text.delta")) {
            const char *d = jstr(o, "delta", NULL);
            size_t dl = d ? strlen(d) : 0;
            if (tl + dl < cap) { memcpy(text + tl, d, dl); tl += dl; text[tl] = 0; }
        }
        snprintf(last, lcap, "%s", ty ? ty : "?");
        ev[0] = 0;
        n++;
        json_decref(o);
    }
    return n;
}

static void test_stream_wire(tr_env *e) {
    int st;
    json_t *o = tr_post(e->prouter, "{\"model\":\"qwen3\",\"input\":\"Once upon a time\",\"max_output_tokens\":12,"
                                    "\"temperature\":0}", &st);
    json_t *item = json_array_get(json_object_get(o, "output"), 0);
    const char *plain = jstr(json_array_get(json_object_get(item, "content"), 0), "text", NULL);
    char *out = NULL, text[4096], last[64];
    int s2 = http(e->prouter, "POST", "/v1/responses", "{\"model\":\"qwen3\",\"input\":\"Once upon a time\","
                                                        "\"max_output_tokens\":12,\"temperature\":0,\"stream\":true}", &out);
    int bad = 0, done = 0;
    int n = out ? tr_events(out, text, sizeof text, last, sizeof last, &bad, &done) : 0;
    CHECK(st == 200 && s2 == 200 && n >= 8 && !bad && !done && !strcmp(last, "response.incomplete"),
          "stream: %d events, %d with a type other than their event line or out of sequence, %d [DONE], last %s",
          n, bad, done, last);
    CHECK(plain && !strcmp(text, plain), "streamed text %s equals the non-stream text %s", text, plain ? plain : "-");
    free(out);
    json_decref(o);
}

/* A decode node killed while it streams: the client is told. */
static void test_stream_failure(tr_env *e) {
    char b[512], dn[64];
    snprintf(b, sizeof b, "%s", bin());
    char *node[] = {b, "serve", "--role", "local", "-m", e->model, "-t", "1", "-c", "512", "--listen", "127.0.0.1:0",
                    "--port-file", TR_DIR "/slow.port", NULL};
    e->pslow = start_named(&e->slow, node, TR_DIR, "slow", 1, 60000);
    snprintf(dn, sizeof dn, "qwen3=127.0.0.1:%d", e->pslow);
    char *r[] = {b, "serve", "--role", "router", "--listen", "127.0.0.1:0", "--decode", dn, "--health-interval-ms", "200",
                 "--port-file", TR_DIR "/router2.port", NULL};
    e->prouter2 = e->pslow > 0 ? start_named(&e->router2, r, TR_DIR, "router2", 1, 30000) : -1;
    if (e->prouter2 <= 0) { CHECK(0, "second node and router start"); return; }
    int fd = http_connect(e->prouter2);
    const char *body = "{\"model\":\"qwen3\",\"input\":\"Tell me a long story.\",\"max_output_tokens\":400,"
                       "\"stream\":true}";
    CHECK(fd >= 0 && http_send(fd, "POST", "/v1/responses", body) == 0, "stream opened");
    /* the first text delta: the node is generating */
    char buf[1 << 16];
    size_t n = 0;
    double t0 = now_ms();
    while (n + 1 < sizeof buf && now_ms() - t0 < 30000) {
        ssize_t r = recv(fd, buf + n, sizeof buf - n - 1, 0);
        if (r <= 0) break;
        n += (size_t)r;
        buf[n] = 0;
        if (strstr(buf, "response.output_text.delta")) break;
    }
    kill(e->slow, SIGKILL);
    waitpid(e->slow, NULL, 0);
    e->slow = 0;
    size_t len;
    char *rest = http_read_all(fd, &len);
    close(fd);
    strbuf all = {0};
    strbuf_put(&all, buf, n);
    if (rest) strbuf_put(&all, rest, len);
    free(rest);
    const char *s = all.p ? all.p : "";
    CHECK(strstr(s, "response.output_text.delta") && strstr(s, "event: error") && strstr(s, "event: response.failed") &&
          strstr(s, "\"status\":\"failed\"") && !strstr(s, "response.completed"),
          "a node killed mid-stream: error event and response.failed (%zu bytes)", all.len);
    strbuf_free(&all);
}

int main(void) {
    signal(SIGPIPE, SIG_IGN);
    mkdir("build", 0755);
    mkdir(TR_DIR, 0755);
    unsetenv("TANDEM_API_KEY");
    unsetenv("TANDEM_SECRET");
    tr_env e;
    memset(&e, 0, sizeof e);
    snprintf(e.model, sizeof e.model, "%s/models/qwen3-mini-Q8_0.gguf", t_fixtures());
    CHECK(access(bin(), X_OK) == 0, "tandem binary %s (set TANDEM_BIN)", bin());
    if (access(bin(), X_OK) || !t_need(e.model)) return t_done("test_router_responses");
    if (tr_setup(&e) == 0) {
        test_malformed(&e);
        test_stream_wire(&e);
        if (py_clients_ready("test_router_responses")) {
            char base[64];
            snprintf(base, sizeof base, "http://127.0.0.1:%d/v1", e.prouter);
            char *args[] = {"responses", "--base", base, "--chat-model", "qwen3", NULL};
            py_clients_run("test_router_responses", args, 18);
        }
        test_stream_failure(&e);
    } else {
        CHECK(0, "node and router start (logs in " TR_DIR ")");
    }
    if (e.router) CHECK(stop_proc(e.router, 5000) == 0, "router stops cleanly");
    if (e.router2) CHECK(stop_proc(e.router2, 5000) == 0, "second router stops cleanly");
    if (e.slow) stop_proc(e.slow, 5000);
    if (e.node) stop_proc(e.node, 5000);
    return t_done("test_router_responses");
}

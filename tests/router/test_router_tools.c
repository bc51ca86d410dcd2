/* test_router_tools.c - the router's agent-framework surface with real
 * processes: a qwen3 fixture node (small context), a second node that is
 * killed, a router in front of both plus a dead address.
 *   - /v1/models lists only models with a healthy decode node (a killed
 *     node's model disappears), /v1/models/{id}
 *   - /tokenize and /detokenize in llama-server's shapes, ids checked
 *     against llama.cpp's tokenizations of the fixture prompts
 *   - a request without max_tokens runs to the end of the context
 *   - tools: forced calls, delta.tool_calls streaming, tool_choice none,
 *     tool history, 400s for what is not applied
 *   - the Python clients (tests/clients/openai_checks.py): the openai
 *     client's and langchain-openai's tool-call round trips and structured
 *     output, and the client's retries on the router's 503 and 429. */
#include "proc.h"

#include <jansson.h>

#define TT_DIR "build/test_router_tools.d"
#define TT_CTX 300          /* the node's context: a default-length request ends here */

typedef struct {
    pid_t node, spare, router, limited;
    int pnode, pspare, prouter, plimited;
    char model[512];
} tt_env;

/* ==== Helpers ==== */

static json_t *tt_req(int port, const char *method, const char *path, const char *body, int *status) {
    char *out = NULL;
    *status = http(port, method, path, body, &out);
    json_t *o = out ? json_loads(out, 0, NULL) : NULL;
    if (!o && out && *status == 200 && strncmp(out, "data:", 5)) fprintf(stderr, "not JSON: %.200s\n", out);
    free(out);
    return o;
}

/* Its log appended to. */
static int tt_start(pid_t *pid, int *port, char *const argv[], const char *name) {
    *port = start_named(pid, argv, TT_DIR, name, 0, 60000);
    return *port > 0 ? 0 : -1;
}

/* A string member (path2 inside path1 when given), or NULL. */
static const char *tt_s(json_t *o, const char *path1, const char *path2) {
    json_t *v = json_object_get(o, path1);
    if (path2) v = json_object_get(v, path2);
    return json_string_value(v);
}

/* 1 if /v1/models lists id. */
static int tt_listed(int port, const char *id) {
    int st, found = 0;
    json_t *o = tt_req(port, "GET", "/v1/models", NULL, &st);
    json_t *d = json_object_get(o, "data");
    for (size_t i = 0; i < json_array_size(d); i++)
        found |= !strcmp(jstr(json_array_get(d, i), "id", NULL) ? jstr(json_array_get(d, i), "id", NULL) : "", id);
    json_decref(o);
    return found;
}

static int tt_setup(tt_env *e) {
    char b[512], ctx[16], dn[64], ds[64], dg[64];
    snprintf(b, sizeof b, "%s", bin());
    snprintf(ctx, sizeof ctx, "%d", TT_CTX);
    char *node[] = {b, "serve", "--role", "local", "-m", e->model, "-t", "1", "-c", ctx, "--listen", "127.0.0.1:0",
                    "--port-file", TT_DIR "/node.port", NULL};
    if (tt_start(&e->node, &e->pnode, node, "node")) return -1;
    node[13] = TT_DIR "/spare.port";
    if (tt_start(&e->spare, &e->pspare, node, "spare")) return -1;
    snprintf(dn, sizeof dn, "qwen3=127.0.0.1:%d", e->pnode);
    snprintf(ds, sizeof ds, "spare=127.0.0.1:%d", e->pspare);
    snprintf(dg, sizeof dg, "ghost=127.0.0.1:%d", dead_port());
    char *r[] = {b, "serve", "--role", "router", "--listen", "127.0.0.1:0", "--decode", dn, "--decode", ds, "--decode", dg,
                 "--health-interval-ms", "200", "--port-file", TT_DIR "/router.port", NULL};
    if (tt_start(&e->router, &e->prouter, r, "router")) return -1;
    double t0 = now_ms();
    while (now_ms() - t0 < 15000 && !(tt_listed(e->prouter, "qwen3") && tt_listed(e->prouter, "spare"))) sleep_ms(100);
    CHECK(tt_listed(e->prouter, "qwen3") && tt_listed(e->prouter, "spare"), "both live models listed");
    return 0;
}

/* ==== /v1/models ==== */

static void test_models(tt_env *e) {
    int st;
    CHECK(!tt_listed(e->prouter, "ghost"), "a model whose only node never answered is not listed");
    json_t *o = tt_req(e->prouter, "GET", "/v1/models/qwen3", NULL, &st);
    CHECK(st == 200 && !strcmp(jstr(o, "id", NULL), "qwen3") && !strcmp(jstr(o, "object", NULL), "model") &&
          json_is_integer(json_object_get(o, "created")) && jstr(o, "owned_by", NULL), "GET /v1/models/qwen3: %d", st);
    json_decref(o);
    o = tt_req(e->prouter, "GET", "/v1/models/ghost", NULL, &st);
    CHECK(st == 404 && !strcmp(jstr(o, "error", "code"), "model_not_found"), "GET /v1/models/ghost: %d", st);
    json_decref(o);
    o = tt_req(e->prouter, "GET", "/v1/models/nope", NULL, &st);
    CHECK(st == 404, "GET /v1/models/nope: %d", st);
    json_decref(o);
}

static void test_model_down(tt_env *e) {
    stop_proc(e->spare, 5000);
    e->spare = 0;
    double t0 = now_ms();
    while (now_ms() - t0 < 5000 && tt_listed(e->prouter, "spare")) sleep_ms(100);
    CHECK(!tt_listed(e->prouter, "spare") && tt_listed(e->prouter, "qwen3"), "the killed node's model is no longer listed");
    int st;
    json_t *o = tt_req(e->prouter, "GET", "/v1/models/spare", NULL, &st);
    CHECK(st == 404, "GET /v1/models/spare after the kill: %d", st);
    json_decref(o);
}

/* ==== /tokenize, /detokenize ==== */

/* The concatenated bytes of with_pieces pieces (strings or byte arrays). */
static void tt_pieces_text(json_t *toks, char *out, size_t cap) {
    size_t n = 0;
    for (size_t i = 0; i < json_array_size(toks); i++) {
        json_t *p = json_object_get(json_array_get(toks, i), "piece");
        if (json_is_string(p)) {
            size_t l = json_string_length(p);
            if (n + l < cap) { memcpy(out + n, json_string_value(p), l); n += l; }
        }
        for (size_t k = 0; json_is_array(p) && k < json_array_size(p); k++)
            if (n + 1 < cap) out[n++] = (char)json_integer_value(json_array_get(p, k));
    }
    out[n] = 0;
}

static int tt_ids_equal(json_t *a, json_t *b, int pieces) {
    if (json_array_size(a) != json_array_size(b)) return 0;
    for (size_t i = 0; i < json_array_size(a); i++) {
        json_t *x = json_array_get(a, i);
        if (pieces) x = json_object_get(x, "id");
        if (json_integer_value(x) != json_integer_value(json_array_get(b, i))) return 0;
    }
    return 1;
}

static void test_tokenize(tt_env *e) {
    char path[1024], line[1 << 16];
    snprintf(path, sizeof path, "%s/tokenize/visible.jsonl", t_fixtures());
    FILE *f = fopen(path, "r");
    CHECK(f != NULL, "open %s", path);
    int prompts = 0, st;
    while (f && fgets(line, sizeof line, f)) {
        json_t *c = json_loads(line, 0, NULL);
        if (strcmp(jstr(c, "type", NULL) ? jstr(c, "type", NULL) : "", "prompt")) { json_decref(c); continue; }
        const char *name = jstr(c, "name", NULL);
        json_t *text = json_object_get(c, "text");
        for (int mode = 0; mode < 3; mode++) {
            json_t *q = json_pack("{s:O, s:s}", "content", text, "model", "qwen3");
            if (mode == 1) json_object_set_new(q, "parse_special", json_false());
            if (mode == 2) json_object_set_new(q, "with_pieces", json_true());
            char *body = json_dumps(q, JSON_COMPACT);
            json_t *o = tt_req(e->prouter, "POST", "/tokenize", body, &st);
            json_t *want = json_object_get(c, mode == 1 ? "ids_no_parse_special" : "ids");
            CHECK(st == 200 && tt_ids_equal(json_object_get(o, "tokens"), want, mode == 2),
                  "%s: /tokenize mode %d matches llama.cpp (status %d)", name, mode, st);
            if (mode == 2) {
                char *joined = malloc(json_string_length(text) * 4 + 16);
                tt_pieces_text(json_object_get(o, "tokens"), joined, json_string_length(text) * 4 + 16);
                CHECK(!strcmp(joined, json_string_value(text)), "%s: pieces spell the text", name);
                free(joined);
            }
            json_decref(o);
            free(body);
            json_decref(q);
        }
        json_t *q = json_pack("{s:O, s:s}", "tokens", json_object_get(c, "ids"), "model", "qwen3");
        char *body = json_dumps(q, JSON_COMPACT);
        json_t *o = tt_req(e->prouter, "POST", "/detokenize", body, &st);
        CHECK(st == 200 && !strcmp(jstr(o, "content", NULL), json_string_value(text)),
              "%s: /detokenize gives the text back", name);
        json_decref(o);
        free(body);
        json_decref(q);
        json_decref(c);
        prompts++;
    }
    if (f) fclose(f);
    CHECK(prompts >= 8, "tokenized %d fixture prompts", prompts);
    /* two models served: /tokenize must name one; a bad id is refused */
    json_t *o = tt_req(e->prouter, "POST", "/tokenize", "{\"content\":\"hi\"}", &st);
    CHECK(st == 400 && !strcmp(jstr(o, "error", "param"), "model"), "no model with two served: %d", st);
    json_decref(o);
    o = tt_req(e->prouter, "POST", "/tokenize", "{\"content\":\"hi\",\"model\":\"nope\"}", &st);
    CHECK(st == 404, "unknown model: %d", st);
    json_decref(o);
    o = tt_req(e->prouter, "POST", "/detokenize", "{\"tokens\":[1,999999999],\"model\":\"qwen3\"}", &st);
    CHECK(st == 400, "out-of-range id: %d", st);
    json_decref(o);
    o = tt_req(e->prouter, "GET", "/tokenize", NULL, &st);
    CHECK(st == 405, "GET /tokenize: %d", st);
    json_decref(o);
}

/* ==== No default cut-off ==== */

static void test_until_context(tt_env *e) {
    int st;
    json_t *o = tt_req(e->prouter, "POST", "/v1/chat/completions",
                       "{\"model\":\"qwen3\",\"temperature\":0,\"messages\":[{\"role\":\"user\",\"content\":\"Tell me a long story.\"}]}", &st);
    long long p = jint(o, "usage", "prompt_tokens"), c = jint(o, "usage", "completion_tokens");
    json_t *ch = json_array_get(json_object_get(o, "choices"), 0);
    /* the last token is sampled from the last position's logits and needs no row: context + 1 */
    CHECK(st == 200 && c > 256 && p + c == TT_CTX + 1 && !strcmp(jstr(ch, "finish_reason", NULL), "length"),
          "no max_tokens: %lld prompt + %lld completion tokens, finish %s (context %d)", p, c,
          jstr(ch, "finish_reason", NULL) ? jstr(ch, "finish_reason", NULL) : "?", TT_CTX);
    json_decref(o);
}

/* ==== Tools over raw HTTP ==== */

#define TT_TOOLS "\"tools\":[{\"type\":\"function\",\"function\":{\"name\":\"get_time\",\"description\":\"The time\"," \
    "\"parameters\":{\"type\":\"object\",\"properties\":{},\"additionalProperties\":false}}}," \
    "{\"type\":\"function\",\"function\":{\"name\":\"get_weather\",\"parameters\":{\"type\":\"object\"," \
    "\"properties\":{\"city\":{\"type\":\"string\"}},\"required\":[\"city\"]}}}]"
#define TT_Q "\"messages\":[{\"role\":\"user\",\"content\":\"Weather in Oslo?\"}]"

static json_t *tt_chat(tt_env *e, const char *fields, int *st) {
    char body[4096];
    snprintf(body, sizeof body, "{\"model\":\"qwen3\",\"temperature\":0,%s}", fields);
    return tt_req(e->prouter, "POST", "/v1/chat/completions", body, st);
}

static json_t *tt_msg(json_t *o) { return json_object_get(json_array_get(json_object_get(o, "choices"), 0), "message"); }
static const char *tt_finish(json_t *o) {
    const char *f = jstr(json_array_get(json_object_get(o, "choices"), 0), "finish_reason", NULL);
    return f ? f : "";
}

/* Streams a request; the tool-call deltas' id, name and argument fragments. */
static void tt_stream_call(tt_env *e, const char *fields, char *id, char *name, char *args, size_t cap, char *finish, int *shape_ok) {
    char body[4096], *out = NULL;
    snprintf(body, sizeof body, "{\"model\":\"qwen3\",\"temperature\":0,\"stream\":true,%s}", fields);
    int st = http(e->prouter, "POST", "/v1/chat/completions", body, &out);
    *id = *name = *args = *finish = 0;
    *shape_ok = st == 200;
    int starts = 0;
    for (char *l = out ? strtok(out, "\n") : NULL; l; l = strtok(NULL, "\n")) {
        if (strncmp(l, "data: {", 7)) continue;
        json_t *c = json_loads(l + 6, 0, NULL);
        json_t *ch = json_array_get(json_object_get(c, "choices"), 0), *tc = json_array_get(json_object_get(json_object_get(ch, "delta"), "tool_calls"), 0);
        if (tt_s(ch, "finish_reason", NULL)) snprintf(finish, 32, "%s", tt_s(ch, "finish_reason", NULL));
        if (tc) {
            if (json_integer_value(json_object_get(tc, "index")) != 0) *shape_ok = 0;
            if (tt_s(tc, "id", NULL)) {   /* the first delta of a call */
                starts++;
                snprintf(id, 64, "%s", jstr(tc, "id", NULL));
                snprintf(name, 64, "%s", jstr(tc, "function", "name") ? jstr(tc, "function", "name") : "");
                if (strcmp(jstr(tc, "type", NULL) ? jstr(tc, "type", NULL) : "", "function")) *shape_ok = 0;
            } else if (json_object_get(json_object_get(tc, "function"), "name")) {
                *shape_ok = 0;   /* later deltas carry argument fragments only */
            }
            const char *a = tt_s(tc, "function", "arguments");
            if (a) strncat(args, a, cap - strlen(args) - 1);
        }
        json_decref(c);
    }
    if (starts != 1) *shape_ok = 0;
    free(out);
}

static void test_tools_http(tt_env *e) {
    int st;
    /* a named function whose arguments can only be {}: the whole call is forced */
    json_t *o = tt_chat(e, TT_Q "," TT_TOOLS ",\"tool_choice\":{\"type\":\"function\",\"function\":{\"name\":\"get_time\"}}", &st);
    json_t *tc = json_array_get(json_object_get(tt_msg(o), "tool_calls"), 0);
    CHECK(st == 200 && json_is_null(json_object_get(tt_msg(o), "content")) && !strcmp(jstr(tc, "function", "name"), "get_time") &&
          !strcmp(jstr(tc, "function", "arguments"), "{}") && !strncmp(jstr(tc, "id", NULL), "call_", 5) &&
          !strcmp(jstr(tc, "type", NULL), "function") && !strcmp(tt_finish(o), "tool_calls"), "forced get_time call (%d)", st);
    json_decref(o);
    {   /* streamed, the call forced whole (no token generated) ends as not streamed: "tool_calls", not "length" */
        char id[64], name[64], sargs[256], finish[32];
        int shape;
        tt_stream_call(e, TT_Q "," TT_TOOLS ",\"max_tokens\":8,\"tool_choice\":{\"type\":\"function\",\"function\":"
                       "{\"name\":\"get_time\"}}", id, name, sargs, sizeof sargs, finish, &shape);
        CHECK(shape && !strcmp(name, "get_time") && !strcmp(sargs, "{}") && !strcmp(finish, "tool_calls"),
              "streamed forced get_time call: name %s args '%s' finish %s", name, sargs, finish);
    }
    /* a named function with arguments: the name is forced, the arguments are the model's */
    const char *named = TT_Q "," TT_TOOLS ",\"max_tokens\":5,\"tool_choice\":{\"type\":\"function\",\"function\":{\"name\":\"get_weather\"}}";
    o = tt_chat(e, named, &st);
    tc = json_array_get(json_object_get(tt_msg(o), "tool_calls"), 0);
    const char *args = tt_s(tc, "function", "arguments");
    CHECK(st == 200 && !strcmp(jstr(tc, "function", "name"), "get_weather") && args && json_array_size(json_object_get(tt_msg(o), "tool_calls")) == 1,
          "named get_weather call (%d)", st);
    {   /* the count made before the pick includes the forced call's assistant
         * prefix: the router's log line has counted= what the node evaluated */
        char want[128], *log = NULL;
        snprintf(want, sizeof want, " id=%s ", jstr(o, "id", NULL) ? jstr(o, "id", NULL) : "?");
        double t0 = now_ms();
        const char *at = NULL;
        while (now_ms() - t0 < 3000) {
            free(log);
            log = slurp(TT_DIR "/router.log");
            if (log && (at = strstr(log, want))) break;
            sleep_ms(50);
        }
        const char *c = at ? strstr(at, " counted=") : NULL, *p = at ? strstr(at, " prompt=") : NULL;
        int counted = c ? atoi(c + 9) : -1, prompt = p ? atoi(p + 8) : -2;
        CHECK(counted == prompt && prompt > 0 && (c && !strncmp(strchr(c, '(') ? strchr(c, '(') : "", "(exact)", 7)),
              "a forced call's prompt counted with its assistant prefix: counted %d, the node's prompt %d", counted, prompt);
        free(log);
    }
    char id[64], name[64], sargs[1024], finish[32];
    int shape;
    tt_stream_call(e, named, id, name, sargs, sizeof sargs, finish, &shape);
    CHECK(shape && !strncmp(id, "call_", 5) && !strcmp(name, "get_weather") && args && !strcmp(sargs, args) &&
          !strcmp(finish, tt_finish(o)), "streamed: id %s name %s args '%s' (non-stream '%s') finish %s", id, name, sargs,
          args ? args : "", finish);
    json_decref(o);
    /* tool_choice none: no tools in the prompt, no parsing */
    o = tt_chat(e, TT_Q "," TT_TOOLS ",\"max_tokens\":3,\"tool_choice\":\"none\"", &st);
    long long p_none = jint(o, "usage", "prompt_tokens");
    CHECK(st == 200 && !json_object_get(tt_msg(o), "tool_calls") && json_is_string(json_object_get(tt_msg(o), "content")), "tool_choice none");
    json_decref(o);
    o = tt_chat(e, TT_Q "," TT_TOOLS ",\"max_tokens\":3", &st);
    CHECK(st == 200 && jint(o, "usage", "prompt_tokens") > p_none + 50, "auto renders the tools: %lld vs %lld prompt tokens",
          jint(o, "usage", "prompt_tokens"), p_none);
    json_decref(o);
    /* "required" with two tools: the call is opened; random weights do not write JSON, so the text comes back as content */
    o = tt_chat(e, TT_Q "," TT_TOOLS ",\"max_tokens\":4,\"tool_choice\":\"required\"", &st);
    const char *content = tt_s(tt_msg(o), "content", NULL);
    CHECK(st == 200 && (json_object_get(tt_msg(o), "tool_calls") || (content && !strncmp(content, "<tool_call>", 11))),
          "required: a call or the opened call as content");
    json_decref(o);
    /* a history with a call and its result */
    o = tt_chat(e, "\"max_tokens\":3," TT_TOOLS ",\"messages\":[{\"role\":\"user\",\"content\":\"Weather?\"},"
                "{\"role\":\"assistant\",\"content\":null,\"tool_calls\":[{\"id\":\"c1\",\"type\":\"function\","
                "\"function\":{\"name\":\"get_weather\",\"arguments\":\"{\\\"city\\\":\\\"Oslo\\\"}\"}}]},"
                "{\"role\":\"tool\",\"tool_call_id\":\"c1\",\"content\":\"-5 C\"}]", &st);
    CHECK(st == 200 && jint(o, "usage", "completion_tokens") == 3, "tool history answered (%d)", st);
    json_decref(o);
    /* refused rather than ignored */
    static const struct { const char *path, *fields, *param; } bad[] = {
        {"/v1/completions", "\"prompt\":\"x\"," TT_TOOLS, "tools"},
        {"/v1/chat/completions", TT_Q ",\"tool_choice\":\"required\"", "tool_choice"},
        {"/v1/chat/completions", TT_Q "," TT_TOOLS ",\"tool_choice\":{\"type\":\"function\",\"function\":{\"name\":\"nope\"}}", "tool_choice"},
        {"/v1/chat/completions", TT_Q ",\"tools\":[{\"type\":\"retrieval\"}]", "tools[0]"},
        {"/v1/chat/completions", "\"messages\":[{\"role\":\"user\",\"content\":\"x\",\"name\":\"bob\"}]", "messages[0].name"},
        {"/v1/chat/completions", "\"messages\":[{\"role\":\"tool\",\"content\":\"x\"}]", "messages[0].tool_call_id"},
        {"/v1/chat/completions", TT_Q ",\"logit_bias\":[1,5]", "logit_bias"},
        {"/v1/chat/completions", TT_Q ",\"response_format\":{\"type\":\"xml\"}", "response_format"},
        {"/v1/chat/completions", TT_Q ",\"functions\":[{\"name\":\"f\"}]", "functions"},
        {"/v1/chat/completions", TT_Q ",\"parallel_tool_calls\":\"yes\"", "parallel_tool_calls"},
    };
    for (size_t i = 0; i < sizeof bad / sizeof bad[0]; i++) {
        char body[2048];
        snprintf(body, sizeof body, "{\"model\":\"qwen3\",%s}", bad[i].fields);
        o = tt_req(e->prouter, "POST", bad[i].path, body, &st);
        const char *param = jstr(o, "error", "param");
        CHECK(st == 400 && param && !strcmp(param, bad[i].param), "refused %zu: %d param %s want %s", i, st, param ? param : "null", bad[i].param);
        json_decref(o);
    }
}

/* ==== Python clients ==== */

/* tests/clients/openai_checks.py's "tools" mode: forced tool calls and
 * their round trips through the openai client and langchain-openai,
 * structured output (response_format, the client's parse() with a pydantic
 * model, with_structured_output), and the client's retries: on the 503 of
 * the ghost model (its only node never answered) and on the 429 of a
 * second router that takes one request at a time. */
static void test_py_clients(tt_env *e) {
    if (!py_clients_ready("test_router_tools")) return;
    char b[512], cfg[600];
    snprintf(b, sizeof b, "%s", bin());
    snprintf(cfg, sizeof cfg, "{\"listen\":\"127.0.0.1:0\",\"health_interval_ms\":200,\"limits\":{\"max_concurrent\":1},"
             "\"nodes\":[{\"role\":\"decode\",\"model\":\"qwen3\",\"addr\":\"127.0.0.1:%d\"}]}\n", e->pnode);
    write_text(TT_DIR "/limited.json", cfg);
    char *r[] = {b, "serve", "--role", "router", "--config", TT_DIR "/limited.json", "--port-file", TT_DIR "/limited.port", NULL};
    if (tt_start(&e->limited, &e->plimited, r, "limited")) return;
    double t0 = now_ms();
    while (now_ms() - t0 < 15000 && !tt_listed(e->plimited, "qwen3")) sleep_ms(100);
    char base[64], lim[64];
    snprintf(base, sizeof base, "http://127.0.0.1:%d/v1", e->prouter);
    snprintf(lim, sizeof lim, "http://127.0.0.1:%d/v1", e->plimited);
    char *args[] = {"tools", "--base", base, "--model", "qwen3", "--dead-model", "ghost", "--limited", lim, NULL};
    py_clients_run("test_router_tools", args, 20);
    CHECK(stop_proc(e->limited, 5000) == 0, "the limited router stops cleanly");
    e->limited = 0;
}

/* One object of the grade schema (tests/clients/openai_checks.py GRADE_SCHEMA): verdict enum, score
 * 0..10, late boolean, 1..3 items in 1..5, nothing else. */
static int tt_valid_grade(json_t *o) {
    if (!json_is_object(o) || json_object_size(o) != 4) return 0;
    const char *v = json_string_value(json_object_get(o, "verdict"));
    json_t *sc = json_object_get(o, "score"), *items = json_object_get(o, "items");
    if (!v || (strcmp(v, "pass") && strcmp(v, "fail") && strcmp(v, "partial"))) return 0;
    if (!json_is_integer(sc) || json_integer_value(sc) < 0 || json_integer_value(sc) > 10) return 0;
    if (!json_is_boolean(json_object_get(o, "late"))) return 0;
    if (!json_is_array(items) || json_array_size(items) < 1 || json_array_size(items) > 3) return 0;
    for (size_t i = 0; i < json_array_size(items); i++) {
        json_t *x = json_array_get(items, i);
        if (!json_is_integer(x) || json_integer_value(x) < 1 || json_integer_value(x) > 5) return 0;
    }
    return 1;
}

/* Structured output in the router's own terms (the clients' structured
 * output is in test_py_clients): random weights never write JSON by
 * themselves; the grammar makes every reply parse and validate. */
static void test_structured(tt_env *e) {
    int st;
    json_t *g = tt_req(e->prouter, "POST", "/v1/chat/completions",
                       "{\"model\":\"qwen3\",\"max_tokens\":64,\"temperature\":0,\"messages\":[{\"role\":\"user\","
                       "\"content\":\"Grade this submission.\"}],\"response_format\":{\"type\":\"json_schema\",\"json_schema\":"
                       "{\"name\":\"grade\",\"strict\":true,\"schema\":{\"type\":\"object\",\"properties\":{\"verdict\":"
                       "{\"type\":\"string\",\"enum\":[\"pass\",\"fail\",\"partial\"]},\"score\":{\"type\":\"integer\","
                       "\"minimum\":0,\"maximum\":10},\"late\":{\"type\":\"boolean\"},\"items\":{\"type\":\"array\",\"items\":"
                       "{\"type\":\"integer\",\"minimum\":1,\"maximum\":5},\"minItems\":1,\"maxItems\":3}},\"required\":"
                       "[\"verdict\",\"score\",\"late\",\"items\"],\"additionalProperties\":false}}}}", &st);
    json_t *msg = tt_msg(g);
    json_t *obj = json_loads(jstr(msg, "content", NULL), 0, NULL);
    CHECK(st == 200 && tt_valid_grade(obj), "response_format json_schema validates: %d %s", st, jstr(msg, "content", NULL));
    json_decref(obj);
    json_decref(g);
    /* a schema keyword the grammar cannot enforce is refused by name */
    const char *body = "{\"model\":\"qwen3\",\"messages\":[{\"role\":\"user\",\"content\":\"x\"}],"
                       "\"response_format\":{\"type\":\"json_schema\",\"json_schema\":{\"name\":\"x\","
                       "\"schema\":{\"type\":\"string\",\"format\":\"hostname\"}}}}";
    json_t *r = tt_req(e->prouter, "POST", "/v1/chat/completions", body, &st);
    CHECK(st == 400 && strstr(jstr(r, "error", "message"), "format") &&
          !strcmp(jstr(r, "error", "param"), "response_format.json_schema.schema#/format") &&
          !strcmp(jstr(r, "error", "code"), "unsupported_schema_keyword"), "unsupported schema keyword -> %d %s", st,
          jstr(r, "error", "message"));
    json_decref(r);
}

int main(void) {
    signal(SIGPIPE, SIG_IGN);
    mkdir("build", 0755);
    mkdir(TT_DIR, 0755);
    tt_env e;
    memset(&e, 0, sizeof e);
    snprintf(e.model, sizeof e.model, "%s/models/qwen3-mini-Q8_0.gguf", t_fixtures());
    CHECK(access(bin(), X_OK) == 0, "tandem binary %s (set TANDEM_BIN)", bin());
    if (access(bin(), X_OK) || !t_need(e.model)) return t_done("test_router_tools");
    if (tt_setup(&e) == 0) {
        test_models(&e);
        test_tokenize(&e);
        test_tools_http(&e);
        test_py_clients(&e);
        test_structured(&e);
        test_until_context(&e);
        test_model_down(&e);
    }
    CHECK(stop_proc(e.router, 5000) == 0, "router stops cleanly");
    if (e.spare) stop_proc(e.spare, 5000);
    if (e.limited) stop_proc(e.limited, 5000);
    stop_proc(e.node, 5000);
    return t_done("test_router_tools");
}

/* test_tools.c - tool-call rendering and parsing (src/api/tools.c).
 *
 * Rendering is checked byte for byte against the model's own chat template:
 * the Qwen3 fixture's tokenizer.chat_template rendered by Jinja2
 * (tests/render_chat.py, as transformers does) for conversations with
 * tools, tool calls, tool results and reasoning. Llama 3.1 (no fixture
 * carries its template) is checked against the format's pieces. The
 * streaming parser is fed whole and byte by byte and must give the same
 * content and calls. */
#include "t.h"

#include <jansson.h>
#include <sys/stat.h>

#include "api/tools.h"

#define TT_DIR "build/test_tools.d"

/* ==== Jinja2 oracle (Qwen3 template) ==== */

static char *tt_read_all(FILE *f) {
    size_t n = 0, cap = 4096;
    char *s = malloc(cap);
    size_t k;
    while (s && (k = fread(s + n, 1, cap - n - 1, f)) > 0) {
        n += k;
        if (n + 1 >= cap) { char *t = realloc(s, cap *= 2); if (!t) { free(s); return NULL; } s = t; }
    }
    if (s) s[n] = 0;
    return s;
}

/* Jinja2's rendering of conv (JSON text), or NULL (3: no Jinja2). */
static char *tt_oracle(const char *tpl_path, const char *conv, int *no_jinja) {
    FILE *f = fopen(TT_DIR "/conv.json", "w");
    if (!f) return NULL;
    fputs(conv, f);
    fclose(f);
    char cmd[512];
    snprintf(cmd, sizeof cmd, "python3 tests/render_chat.py %s " TT_DIR "/conv.json", tpl_path);
    FILE *p = popen(cmd, "r");
    if (!p) return NULL;
    char *out = tt_read_all(p);
    int st = pclose(p);
    if (WEXITSTATUS(st) == 3) *no_jinja = 1;
    if (st != 0) { free(out); return NULL; }
    return out;
}

static const char *const tt_convs[] = {
    /* plain chat: the system turn, no tools */
    "{\"messages\":[{\"role\":\"system\",\"content\":\"Be brief.\"},{\"role\":\"user\",\"content\":\"Hi there\"}]}",
    /* tools, no system message */
    "{\"messages\":[{\"role\":\"user\",\"content\":\"Weather in Paris?\"}],"
    "\"tools\":[{\"type\":\"function\",\"function\":{\"name\":\"get_weather\",\"description\":\"Weather for a city \\u00e9t\\u00e9\","
    "\"parameters\":{\"type\":\"object\",\"properties\":{\"city\":{\"type\":\"string\"},\"days\":{\"type\":\"integer\",\"minimum\":1}},"
    "\"required\":[\"city\"]}}},{\"type\":\"function\",\"function\":{\"name\":\"now\",\"parameters\":{}}}]}",
    /* a whole round trip: system + tools, a call without content, two results, an answer, a new question */
    "{\"messages\":[{\"role\":\"system\",\"content\":\"You help.\"},{\"role\":\"user\",\"content\":\"Weather in Paris and Rome?\"},"
    "{\"role\":\"assistant\",\"content\":\"\",\"tool_calls\":["
    "{\"id\":\"a\",\"type\":\"function\",\"function\":{\"name\":\"get_weather\",\"arguments\":\"{\\\"city\\\": \\\"Paris\\\"}\"}},"
    "{\"id\":\"b\",\"type\":\"function\",\"function\":{\"name\":\"get_weather\",\"arguments\":\"{\\\"city\\\":\\\"Rome\\\"}\"}}]},"
    "{\"role\":\"tool\",\"tool_call_id\":\"a\",\"content\":\"sunny\"},{\"role\":\"tool\",\"tool_call_id\":\"b\",\"content\":\"rain\"},"
    "{\"role\":\"assistant\",\"content\":\"Paris is sunny, Rome rainy.\"},{\"role\":\"user\",\"content\":\"Thanks\"}],"
    "\"tools\":[{\"type\":\"function\",\"function\":{\"name\":\"get_weather\",\"parameters\":{\"type\":\"object\","
    "\"properties\":{\"city\":{\"type\":\"string\"}}}}}]}",
    /* content before a call, reasoning in turns before and after the last query, an assistant turn last */
    "{\"messages\":[{\"role\":\"user\",\"content\":\"Q1\"},{\"role\":\"assistant\",\"content\":\"<think>\\nold\\n</think>\\n\\nA1\"},"
    "{\"role\":\"user\",\"content\":\"Q2\"},{\"role\":\"assistant\",\"content\":\"<think>plan</think>Let me look.\",\"tool_calls\":["
    "{\"id\":\"x\",\"type\":\"function\",\"function\":{\"name\":\"f\",\"arguments\":\"{}\"}}]},"
    "{\"role\":\"tool\",\"tool_call_id\":\"x\",\"content\":\"42\"},{\"role\":\"assistant\",\"content\":\"It is 42.\"}],"
    "\"tools\":[{\"type\":\"function\",\"function\":{\"name\":\"f\"}}]}",
    /* a later system turn, a user turn that is a wrapped tool response
     * (parenthesised: one conversation in two literals, not a missing comma) */
    ("{\"messages\":[{\"role\":\"user\",\"content\":\"a\"},{\"role\":\"system\",\"content\":\"late\"},"
     "{\"role\":\"assistant\",\"content\":\"b\"},{\"role\":\"user\",\"content\":\"<tool_response>\\nr\\n</tool_response>\"}]}"),
};

static void test_render_oracle(void) {
    char path[1024], err[256];
    snprintf(path, sizeof path, "%s/models/qwen3-mini-Q8_0.gguf", t_fixtures());
    if (!t_need(path)) return;
    gguf_file *g = NULL;
    CHECK(gguf_open_file(&g, path, err, sizeof err) == 0, "open %s: %s", path, err);
    if (!g) return;
    chat_style st;
    CHECK(tools_style_detect(g, &st, err, sizeof err) == 0 && st.fmt == CHAT_CHATML && st.qwen_think &&
          !st.qwen_default_system && !strcmp(tools_style_name(&st), "chatml"), "qwen3 style: %s", err);
    gguf_str tpl;
    gguf_get_str(g, "tokenizer.chat_template", &tpl);
    FILE *f = fopen(TT_DIR "/qwen3.jinja", "w");
    fwrite(tpl.ptr, 1, tpl.len, f);
    fclose(f);
    for (size_t i = 0; i < sizeof tt_convs / sizeof tt_convs[0]; i++) {
        int no_jinja = 0;
        char *want = tt_oracle(TT_DIR "/qwen3.jinja", tt_convs[i], &no_jinja);
        if (no_jinja) { t_skip_what("jinja2", "the Jinja2 oracle of chat-template rendering: python3 jinja2 not installed"); break; }
        json_t *conv = json_loads(tt_convs[i], 0, NULL);
        char *got = tools_render(&st, json_object_get(conv, "messages"), json_object_get(conv, "tools"), NULL, err, sizeof err);
        CHECK(want && got && !strcmp(want, got), "conversation %zu: tandem\n---\n%s\n---\nJinja2\n---\n%s\n---", i,
              got ? got : err, want ? want : "(failed)");
        free(want);
        free(got);
        json_decref(conv);
    }
    gguf_close(g);
}

/* ==== Llama 3.1 (the format's pieces) ==== */

static void test_render_llama(void) {
    chat_style st = { .fmt = CHAT_LLAMA3, .llama_tools = 1 };
    char err[256];
    json_t *c = json_loads("{\"messages\":[{\"role\":\"system\",\"content\":\" Sys \"},{\"role\":\"user\",\"content\":\" Weather? \"},"
                           "{\"role\":\"assistant\",\"content\":\"\",\"tool_calls\":[{\"id\":\"a\",\"type\":\"function\","
                           "\"function\":{\"name\":\"w\",\"arguments\":\"{\\\"city\\\":\\\"Oslo\\\"}\"}}]},"
                           "{\"role\":\"tool\",\"tool_call_id\":\"a\",\"content\":\"cold \\\"-5\\\"\"}],"
                           "\"tools\":[{\"type\":\"function\",\"function\":{\"name\":\"w\",\"parameters\":{}}}]}", 0, NULL);
    char *got = tools_render(&st, json_object_get(c, "messages"), json_object_get(c, "tools"), NULL, err, sizeof err);
    const char *want =
        "<|start_header_id|>system<|end_header_id|>\n\nEnvironment: ipython\nCutting Knowledge Date: December 2023\n"
        "Today Date: 26 Jul 2024\n\nSys<|eot_id|>"
        "<|start_header_id|>user<|end_header_id|>\n\nGiven the following functions, please respond with a JSON for a "
        "function call with its proper arguments that best answers the given prompt.\n\nRespond in the format "
        "{\"name\": function name, \"parameters\": dictionary of argument name and its value}.Do not use variables.\n\n"
        "{\n    \"type\": \"function\",\n    \"function\": {\n        \"name\": \"w\",\n        \"parameters\": {}\n    }\n}\n\n"
        "Weather?<|eot_id|>"
        "<|start_header_id|>assistant<|end_header_id|>\n\n{\"name\": \"w\", \"parameters\": {\"city\": \"Oslo\"}}<|eot_id|>"
        "<|start_header_id|>ipython<|end_header_id|>\n\n\"cold \\\"-5\\\"\"<|eot_id|>"
        "<|start_header_id|>assistant<|end_header_id|>\n\n";
    CHECK(got && !strcmp(got, want), "llama 3.1 tools:\n%s", got ? got : err);
    free(got);
    /* two calls in one turn: the template refuses */
    json_t *m = json_object_get(json_array_get(json_object_get(c, "messages"), 2), "tool_calls");
    json_array_append(m, json_array_get(m, 0));
    got = tools_render(&st, json_object_get(c, "messages"), json_object_get(c, "tools"), NULL, err, sizeof err);
    CHECK(!got && strstr(err, "one tool call"), "llama 3.1 refuses two calls: %s", err);
    free(got);
    /* plain Llama 3 has no tools */
    chat_style l3 = { .fmt = CHAT_LLAMA3 };
    got = tools_render(&l3, json_object_get(c, "messages"), json_object_get(c, "tools"), NULL, err, sizeof err);
    CHECK(!got && strstr(err, "no tool calls"), "llama 3 refuses tools: %s", err);
    free(got);
    json_decref(c);
    /* without tools Llama 3.1 still writes its system block; Llama 3 does not */
    c = json_loads("[{\"role\":\"user\",\"content\":\"Hi\"}]", 0, NULL);
    got = tools_render(&st, c, NULL, NULL, err, sizeof err);
    CHECK(got && !strcmp(got, "<|start_header_id|>system<|end_header_id|>\n\nCutting Knowledge Date: December 2023\n"
                              "Today Date: 26 Jul 2024\n\n<|eot_id|><|start_header_id|>user<|end_header_id|>\n\nHi<|eot_id|>"
                              "<|start_header_id|>assistant<|end_header_id|>\n\n"), "llama 3.1 no tools: %s", got ? got : err);
    free(got);
    got = tools_render(&l3, c, NULL, "{\"name\":", err, sizeof err);
    CHECK(got && !strcmp(got, "<|start_header_id|>user<|end_header_id|>\n\nHi<|eot_id|>"
                              "<|start_header_id|>assistant<|end_header_id|>\n\n{\"name\":"), "llama 3 + prefix: %s", got ? got : err);
    free(got);
    json_decref(c);
    /* bad shapes */
    c = json_loads("[{\"role\":\"wizard\",\"content\":\"x\"}]", 0, NULL);
    got = tools_render(&st, c, NULL, NULL, err, sizeof err);
    CHECK(!got && strstr(err, "wizard"), "unknown role refused: %s", err);
    json_decref(c);
}

/* ==== Prefixes ==== */

static void test_prefix(void) {
    char *p = tools_prefix(CHAT_CHATML, NULL, 0);
    CHECK(p && !strcmp(p, "<tool_call>\n"), "qwen required: %s", p);
    free(p);
    p = tools_prefix(CHAT_CHATML, "get_weather", 0);
    CHECK(p && !strcmp(p, "<tool_call>\n{\"name\": \"get_weather\", \"arguments\":"), "qwen named: %s", p);
    free(p);
    p = tools_prefix(CHAT_CHATML, "now", 1);
    CHECK(p && !strcmp(p, "<tool_call>\n{\"name\": \"now\", \"arguments\": {}}\n</tool_call>"), "qwen fixed: %s", p);
    free(p);
    p = tools_prefix(CHAT_LLAMA3, "w", 0);
    CHECK(p && !strcmp(p, "{\"name\": \"w\", \"parameters\":"), "llama named: %s", p);
    free(p);
    json_t *s = json_loads("{\"type\":\"object\",\"properties\":{},\"additionalProperties\":false}", 0, NULL);
    CHECK(tools_args_fixed_empty(NULL) && tools_args_fixed_empty(s), "empty schemas fix the arguments");
    json_object_set_new(s, "additionalProperties", json_true());
    CHECK(!tools_args_fixed_empty(s), "additionalProperties true leaves them open");
    json_decref(s);
}

/* ==== Parser ==== */

typedef struct { char content[512]; char name[4][64]; char args[4][256]; int calls; } tt_out;

static void tt_collect(const tool_evs *e, tt_out *o) {
    for (int i = 0; i < e->n; i++) {
        const tool_ev *v = &e->v[i];
        if (v->kind == TOOL_EV_CONTENT) strncat(o->content, v->text, sizeof o->content - strlen(o->content) - 1);
        else if (v->index < 4 && v->kind == TOOL_EV_CALL) { snprintf(o->name[v->index], 64, "%s", v->text); o->calls++; }
        else if (v->index < 4) strncat(o->args[v->index], v->text, 255 - strlen(o->args[v->index]));
    }
}

/* Parses text whole (step 0) or in pieces of step bytes. */
static void tt_parse(enum chat_format fmt, int max_calls, const char *text, size_t step, tt_out *o) {
    memset(o, 0, sizeof *o);
    tool_parser *p = tool_parser_new(fmt, max_calls);
    tool_evs e = {0};
    size_t n = strlen(text);
    for (size_t i = 0; i < n; i += step ? step : n) {
        size_t k = step && n - i > step ? step : n - i;
        CHECK(tool_parser_feed(p, text + i, k, &e) == 0, "feed");
    }
    CHECK(tool_parser_end(p, &e) == 0, "end");
    tt_collect(&e, o);
    tool_evs_clear(&e);
    tool_parser_free(p);
}

typedef struct {
    enum chat_format fmt;
    int max_calls;
    const char *text, *content;
    int calls;
    const char *name0, *args0, *name1, *args1;
} tt_case;

static void test_parser(void) {
    static const tt_case cases[] = {
        { CHAT_CHATML, 0, "Hello there.", "Hello there.", 0, 0, 0, 0, 0 },
        { CHAT_CHATML, 0, "Let me check.\n\n<tool_call>\n{\"name\": \"get_weather\", \"arguments\": {\"city\": \"Paris\", \"n\": [1, {\"a\": \"}\"}]}}\n</tool_call>\n"
                          "<tool_call>\n{\"name\": \"now\", \"arguments\": {}}\n</tool_call>",
          "Let me check.", 2, "get_weather", "{\"city\": \"Paris\", \"n\": [1, {\"a\": \"}\"}]}", "now", "{}" },
        /* arguments before the name: parsed whole at the closing tag */
        { CHAT_CHATML, 0, "<tool_call>\n{\"arguments\": {\"x\": 1}, \"name\": \"f\"}\n</tool_call>", "", 1, "f", "{\"x\":1}", 0, 0 },
        /* not JSON inside the tags: content, tags included */
        { CHAT_CHATML, 0, "a <tool_call>oops</tool_call> b", "a <tool_call>oops</tool_call> b", 0, 0, 0, 0, 0 },
        /* a tag-like text that is not the tag */
        { CHAT_CHATML, 0, "x <tool_ca y", "x <tool_ca y", 0, 0, 0, 0, 0 },
        /* one call kept (parallel_tool_calls false): the rest is dropped */
        { CHAT_CHATML, 1, "<tool_call>{\"name\":\"a\",\"arguments\":{\"k\":\"v\"}}</tool_call><tool_call>{\"name\":\"b\",\"arguments\":{}}</tool_call>tail",
          "", 1, "a", "{\"k\":\"v\"}", 0, 0 },
        /* cut inside the arguments: the call keeps what came */
        { CHAT_CHATML, 0, "<tool_call>\n{\"name\": \"f\", \"arguments\": {\"q\": \"abc", "", 1, "f", "{\"q\": \"abc", 0, 0 },
        /* reasoning stays content */
        { CHAT_CHATML, 0, "<think>\nhm\n</think>\n\nok", "<think>\nhm\n</think>\n\nok", 0, 0, 0, 0, 0 },
        /* Llama 3.1: the whole message is the call, with or without the python tag */
        { CHAT_LLAMA3, 0, "{\"name\": \"w\", \"parameters\": {\"city\": \"Oslo\"}}", "", 1, "w", "{\"city\": \"Oslo\"}", 0, 0 },
        { CHAT_LLAMA3, 0, "<|python_tag|>{\"name\": \"w\", \"arguments\": {}}", "", 1, "w", "{}", 0, 0 },
        { CHAT_LLAMA3, 0, "{\"answer\": 4}", "{\"answer\": 4}", 0, 0, 0, 0, 0 },
        { CHAT_LLAMA3, 0, "It is {\"name\": \"w\"}", "It is {\"name\": \"w\"}", 0, 0, 0, 0, 0 },
    };
    for (size_t i = 0; i < sizeof cases / sizeof cases[0]; i++) {
        const tt_case *c = &cases[i];
        for (size_t step = 0; step <= 3; step++) {
            tt_out o;
            tt_parse(c->fmt, c->max_calls, c->text, step, &o);
            CHECK(!strcmp(o.content, c->content), "case %zu step %zu: content '%s' want '%s'", i, step, o.content, c->content);
            CHECK(o.calls == c->calls, "case %zu step %zu: %d calls want %d", i, step, o.calls, c->calls);
            if (c->calls > 0)
                CHECK(!strcmp(o.name[0], c->name0) && !strcmp(o.args[0], c->args0), "case %zu step %zu: call 0 %s(%s)", i, step, o.name[0], o.args[0]);
            if (c->calls > 1)
                CHECK(!strcmp(o.name[1], c->name1) && !strcmp(o.args[1], c->args1), "case %zu step %zu: call 1 %s(%s)", i, step, o.name[1], o.args[1]);
        }
    }
    /* a forced call: the prefix is fed first and the call starts at once */
    tool_parser *p = tool_parser_new(CHAT_CHATML, 1);
    tool_evs e = {0};
    const char *pre = "<tool_call>\n{\"name\": \"get_weather\", \"arguments\":";
    tool_parser_feed(p, pre, strlen(pre), &e);
    CHECK(e.n == 1 && e.v[0].kind == TOOL_EV_CALL && !strcmp(e.v[0].text, "get_weather"), "prefix starts the call");
    tool_parser_feed(p, " {\"city\"", 8, &e);
    CHECK(e.n == 2 && e.v[1].kind == TOOL_EV_ARGS && !strcmp(e.v[1].text, "{\"city\""), "argument fragment: %s", e.n > 1 ? e.v[1].text : "");
    tool_parser_feed(p, ": \"Oslo\"}}\n", 11, &e);
    CHECK(tool_parser_done(p) == 0 && !strcmp(e.v[1].text, "{\"city\": \"Oslo\"}"), "arguments complete: %s", e.v[1].text);
    tool_parser_feed(p, "</tool_call>", 12, &e);
    CHECK(tool_parser_done(p) && tool_parser_calls(p) == 1, "one call done");
    tool_evs_clear(&e);
    tool_parser_free(p);
}

int main(void) {
    mkdir("build", 0755);
    mkdir(TT_DIR, 0755);
    test_render_oracle();
    test_render_llama();
    test_prefix();
    test_parser();
    return t_done("test_tools");
}

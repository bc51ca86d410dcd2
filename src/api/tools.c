/* tools.c - tool-call rendering and parsing (see tools.h, docs/router.md).
 *
 * The texts below are the prompt formats of the templates themselves (facts
 * of the formats the models were trained on), reproduced so that the
 * rendered prompt equals what the model's tokenizer.chat_template gives:
 * tests/api/test_tools.c renders the fixture's Qwen3 template with Jinja2 and
 * compares byte for byte. tojson is Python's json.dumps with
 * ensure_ascii=False: ", " and ": " separators, or indent=4 (Llama) - what
 * jansson writes without JSON_COMPACT.
 */
#include "api/tools.h"

#include "base/strbuf.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>

/* ==== Buffers ==== */

/* Drops the first n bytes. */
static void tl_consume(strbuf *b, size_t n) {
    if (n >= b->len) { b->len = 0; if (b->p) b->p[0] = 0; return; }
    memmove(b->p, b->p + n, b->len - n);
    b->len -= n;
    b->p[b->len] = 0;
}

static int tl_ws(char c) { return c == ' ' || c == '\t' || c == '\n' || c == '\r'; }

/* Jinja's trim: Python str.strip() of whitespace. */
static void tl_put_trimmed(strbuf *b, const char *s) {
    size_t n = strlen(s), i = 0;
    while (i < n && (tl_ws(s[i]) || s[i] == '\v' || s[i] == '\f')) i++;
    while (n > i && (tl_ws(s[n - 1]) || s[n - 1] == '\v' || s[n - 1] == '\f')) n--;
    strbuf_put(b, s + i, n - i);
}

/* Python's json.dumps(v, ensure_ascii=False[, indent=4]). */
static void tl_put_json(strbuf *b, json_t *v, int indent) {
    char *s = json_dumps(v, JSON_ENCODE_ANY | (indent ? JSON_INDENT(indent) : 0));
    if (!s) { b->oom = 1; return; }
    strbuf_puts(b, s);
    free(s);
}

/* ==== Template style ==== */

#define TL_QWEN25_SYSTEM "You are Qwen, created by Alibaba Cloud. You are a helpful assistant."
#define TL_SMOLLM_SYSTEM "You are a helpful AI assistant named SmolLM, trained by Hugging Face"

static const char *tl_find(gguf_str s, const char *needle) {
    return memmem(s.ptr, s.len, needle, strlen(needle));
}

int tools_style_detect(const gguf_file *f, chat_style *st, char *err, size_t errlen) {
    memset(st, 0, sizeof *st);
    st->fmt = chat_detect(f, err, errlen);
    if (st->fmt == CHAT_NONE) return -1;
    gguf_str tpl;
    if (chat_template_get(f, &tpl) != 0) return -1;
    if (st->fmt == CHAT_CHATML) {
        /* Qwen2.5's templates name a default system prompt; Qwen3's parse
         * reasoning out of assistant turns. */
        st->qwen_default_system = tl_find(tpl, "You are Qwen, created by Alibaba Cloud") != NULL;
        /* SmolLM2's template opens with its own system turn when the
         * conversation has none (the same place as Qwen2.5's) */
        st->default_system = st->qwen_default_system ? TL_QWEN25_SYSTEM
                           : tl_find(tpl, TL_SMOLLM_SYSTEM) ? TL_SMOLLM_SYSTEM : NULL;
        st->qwen_think = tl_find(tpl, "reasoning_content") != NULL;
    } else {
        st->llama_tools = tl_find(tpl, "Environment: ipython") != NULL;
    }
    return 0;
}

const char *tools_style_name(const chat_style *st) {
    if (st->fmt == CHAT_CHATML) return "chatml";
    if (st->fmt == CHAT_LLAMA3) return st->llama_tools ? "llama3.1" : "llama3";
    return "none";
}

enum chat_format tools_format_from_name(const char *name) {
    if (!name) return CHAT_NONE;
    if (!strcmp(name, "chatml")) return CHAT_CHATML;
    if (!strcmp(name, "llama3.1")) return CHAT_LLAMA3;
    return CHAT_NONE;   /* plain Llama 3 templates know no tools */
}

/* ==== Message accessors ==== */

static const char *tl_str(json_t *o, const char *k) {
    const char *s = json_string_value(json_object_get(o, k));
    return s ? s : "";
}

static const char *tl_role(json_t *m) { return tl_str(m, "role"); }

static int tl_check_messages(json_t *messages, char *err, size_t errlen) {
    if (!json_is_array(messages) || json_array_size(messages) == 0) {
        snprintf(err, errlen, "'messages' must be a non-empty array");
        return -1;
    }
    for (size_t i = 0; i < json_array_size(messages); i++) {
        json_t *m = json_array_get(messages, i), *c = json_object_get(m, "content"), *tc = json_object_get(m, "tool_calls");
        const char *r = json_string_value(json_object_get(m, "role"));
        /* only an assistant turn (one with tool calls) may leave its content out */
        int optional = r && !strcmp(r, "assistant");
        if (!json_is_object(m) || !r || (!optional && !json_is_string(c)) || (c && !json_is_string(c) && !json_is_null(c)) ||
            (json_is_string(c) && strlen(json_string_value(c)) != json_string_length(c))) {
            snprintf(err, errlen, "'messages'[%zu] needs a string 'role' and a string 'content' (no NUL characters)", i);
            return -1;
        }
        if (strcmp(r, "system") && strcmp(r, "user") && strcmp(r, "assistant") && strcmp(r, "tool")) {
            snprintf(err, errlen, "'messages'[%zu]: role '%.32s' is not one of system, user, assistant, tool", i, r);
            return -1;
        }
        if (!tc || json_is_null(tc)) continue;
        if (!json_is_array(tc) || strcmp(r, "assistant")) {
            snprintf(err, errlen, "'messages'[%zu]: 'tool_calls' must be an array on an assistant message", i);
            return -1;
        }
        for (size_t k = 0; k < json_array_size(tc); k++) {
            json_t *fn = json_object_get(json_array_get(tc, k), "function");
            if (!json_is_string(json_object_get(fn, "name")) || !json_is_string(json_object_get(fn, "arguments"))) {
                snprintf(err, errlen, "'messages'[%zu].tool_calls[%zu] needs 'function' with string 'name' and 'arguments'", i, k);
                return -1;
            }
        }
    }
    return 0;
}

static size_t tl_n_calls(json_t *m) {
    json_t *tc = json_object_get(m, "tool_calls");
    return json_is_array(tc) ? json_array_size(tc) : 0;
}

/* Arguments as the template writes them: Qwen3 writes a string verbatim;
 * the other templates run tojson on an object, so the OpenAI string is
 * parsed first (as llama.cpp does) and written back with Python's spacing. */
static void tl_put_arguments(strbuf *b, const char *args, int verbatim) {
    json_t *v = verbatim ? NULL : json_loads(args, JSON_DECODE_ANY, NULL);
    if (v) tl_put_json(b, v, 0);
    else strbuf_puts(b, args);
    json_decref(v);
}

/* ==== ChatML (Qwen2.5, Qwen3) ==== */

#define TL_QWEN_TOOLS_HEAD "# Tools\n\nYou may call one or more functions to assist with the user query.\n\n" \
    "You are provided with function signatures within <tools></tools> XML tags:\n<tools>"
#define TL_QWEN_TOOLS_TAIL "\n</tools>\n\nFor each function call, return a json object with function name and " \
    "arguments within <tool_call></tool_call> XML tags:\n<tool_call>\n{\"name\": <function-name>, " \
    "\"arguments\": <args-json-object>}\n</tool_call><|im_end|>\n"

static void tl_chatml_system(strbuf *b, const chat_style *st, json_t *messages, json_t *tools) {
    json_t *m0 = json_array_get(messages, 0);
    int has_sys = !strcmp(tl_role(m0), "system");
    if (tools) {
        strbuf_puts(b, "<|im_start|>system\n");
        if (has_sys || st->default_system) {
            strbuf_puts(b, has_sys ? tl_str(m0, "content") : st->default_system);
            strbuf_puts(b, "\n\n");
        }
        strbuf_puts(b, TL_QWEN_TOOLS_HEAD);
        for (size_t i = 0; i < json_array_size(tools); i++) {
            strbuf_puts(b, "\n");
            tl_put_json(b, json_array_get(tools, i), 0);
        }
        strbuf_puts(b, TL_QWEN_TOOLS_TAIL);
    } else if (has_sys || st->default_system) {
        strbuf_puts(b, "<|im_start|>system\n");
        strbuf_puts(b, has_sys ? tl_str(m0, "content") : st->default_system);
        strbuf_puts(b, "<|im_end|>\n");
    }
}

/* Qwen3: the last user message that is a real query (not tool responses
 * the client wrapped itself); assistant turns after it keep their reasoning. */
static long tl_last_query(json_t *messages) {
    long n = (long)json_array_size(messages);
    for (long i = n - 1; i >= 0; i--) {
        json_t *m = json_array_get(messages, (size_t)i);
        const char *c = tl_str(m, "content");
        size_t len = strlen(c);
        int wrapped = !strncmp(c, "<tool_response>", 15) && len >= 16 && !strcmp(c + len - 16, "</tool_response>");
        if (!strcmp(tl_role(m), "user") && !wrapped) return i;
    }
    return n - 1;
}

/* Qwen3 splits "<think>R</think>C" into reasoning R and content C. */
static void tl_split_think(const char *s, strbuf *reason, strbuf *content) {
    const char *close = strstr(s, "</think>");
    if (!close) { strbuf_puts(content, s); return; }
    const char *last = close, *p;
    while ((p = strstr(last + 8, "</think>"))) last = p;
    const char *c = last + 8;
    while (*c == '\n') c++;
    strbuf_puts(content, c);
    /* reasoning: before the first </think>, after its last <think>, trimmed of newlines */
    const char *r = s, *q;
    while ((q = strstr(r, "<think>")) && q < close) r = q + 7;
    const char *e = close;
    while (e > r && e[-1] == '\n') e--;
    while (r < e && *r == '\n') r++;
    strbuf_put(reason, r, (size_t)(e - r));
}

static void tl_chatml_assistant(strbuf *b, const chat_style *st, json_t *m, int after_query, int last) {
    strbuf reason = {0}, content = {0};
    strbuf_puts(&content, "");
    if (st->qwen_think) tl_split_think(tl_str(m, "content"), &reason, &content);
    else strbuf_puts(&content, tl_str(m, "content"));
    if (st->qwen_think && after_query && (last || reason.len)) {
        strbuf_puts(b, "<|im_start|>assistant\n<think>\n");
        if (reason.len) strbuf_put(b, reason.p, reason.len);
        strbuf_puts(b, "\n</think>\n\n");
        const char *c = content.p;
        while (*c == '\n') c++;
        strbuf_puts(b, c);
    } else {
        strbuf_puts(b, "<|im_start|>assistant\n");
        strbuf_puts(b, content.p);
    }
    json_t *tc = json_object_get(m, "tool_calls");
    for (size_t k = 0; k < tl_n_calls(m); k++) {
        json_t *fn = json_object_get(json_array_get(tc, k), "function");
        if (k > 0 || content.p[0]) strbuf_puts(b, "\n");
        strbuf_puts(b, "<tool_call>\n{\"name\": \"");
        strbuf_puts(b, tl_str(fn, "name"));
        strbuf_puts(b, "\", \"arguments\": ");
        tl_put_arguments(b, tl_str(fn, "arguments"), st->qwen_think);
        strbuf_puts(b, "}\n</tool_call>");
    }
    strbuf_puts(b, "<|im_end|>\n");
    if (reason.oom || content.oom) b->oom = 1;
    strbuf_free(&reason);
    strbuf_free(&content);
}

static void tl_render_chatml(strbuf *b, const chat_style *st, json_t *messages, json_t *tools) {
    tl_chatml_system(b, st, messages, tools);
    size_t n = json_array_size(messages);
    long lq = tl_last_query(messages);
    for (size_t i = 0; i < n; i++) {
        json_t *m = json_array_get(messages, i);
        const char *role = tl_role(m);
        if (!strcmp(role, "user") || (!strcmp(role, "system") && i > 0)) {
            strbuf_puts(b, "<|im_start|>");
            strbuf_puts(b, role);
            strbuf_puts(b, "\n");
            strbuf_puts(b, tl_str(m, "content"));
            strbuf_puts(b, "<|im_end|>\n");
        } else if (!strcmp(role, "assistant")) {
            tl_chatml_assistant(b, st, m, (long)i > lq, i + 1 == n);
        } else if (!strcmp(role, "tool")) {
            /* consecutive tool results share one user turn */
            if (i == 0 || strcmp(tl_role(json_array_get(messages, i - 1)), "tool")) strbuf_puts(b, "<|im_start|>user");
            strbuf_puts(b, "\n<tool_response>\n");
            strbuf_puts(b, tl_str(m, "content"));
            strbuf_puts(b, "\n</tool_response>");
            if (i + 1 == n || strcmp(tl_role(json_array_get(messages, i + 1)), "tool")) strbuf_puts(b, "<|im_end|>\n");
        }
    }
    strbuf_puts(b, "<|im_start|>assistant\n");
}

/* ==== Llama 3 / 3.1 ==== */

#define TL_LLAMA_DATE "26 Jul 2024"   /* the templates' date_string when the caller gives none */
#define TL_LLAMA_TOOLS_USER "Given the following functions, please respond with a JSON for a function call " \
    "with its proper arguments that best answers the given prompt.\n\n" \
    "Respond in the format {\"name\": function name, \"parameters\": dictionary of argument name and its value}." \
    "Do not use variables.\n\n"

static void tl_llama_turn(strbuf *b, const char *role, const char *content) {
    strbuf_puts(b, "<|start_header_id|>");
    strbuf_puts(b, role);
    strbuf_puts(b, "<|end_header_id|>\n\n");
    tl_put_trimmed(b, content);
    strbuf_puts(b, "<|eot_id|>");
}

/* Llama 3.1's preamble: system block, then the tools in the first user
 * message. Returns the index of the first message still to render, -1 on
 * a conversation the template refuses. */
static long tl_llama31_head(strbuf *b, json_t *messages, json_t *tools, char *err, size_t errlen) {
    size_t i = 0, n = json_array_size(messages);
    const char *sys = "";
    if (!strcmp(tl_role(json_array_get(messages, 0)), "system")) sys = tl_str(json_array_get(messages, i++), "content");
    strbuf_puts(b, "<|start_header_id|>system<|end_header_id|>\n\n");
    if (tools) strbuf_puts(b, "Environment: ipython\n");
    strbuf_puts(b, "Cutting Knowledge Date: December 2023\nToday Date: " TL_LLAMA_DATE "\n\n");
    tl_put_trimmed(b, sys);
    strbuf_puts(b, "<|eot_id|>");
    if (!tools) return (long)i;
    if (i >= n) {
        snprintf(err, errlen, "the Llama 3.1 template puts the tools in the first user message: send one");
        return -1;
    }
    strbuf_puts(b, "<|start_header_id|>user<|end_header_id|>\n\n" TL_LLAMA_TOOLS_USER);
    for (size_t k = 0; k < json_array_size(tools); k++) {
        tl_put_json(b, json_array_get(tools, k), 4);
        strbuf_puts(b, "\n\n");
    }
    tl_put_trimmed(b, tl_str(json_array_get(messages, i), "content"));
    strbuf_puts(b, "<|eot_id|>");
    return (long)i + 1;
}

static int tl_render_llama(strbuf *b, const chat_style *st, json_t *messages, json_t *tools,
                           char *err, size_t errlen) {
    size_t n = json_array_size(messages);
    long start = 0;
    if (st->llama_tools && (start = tl_llama31_head(b, messages, tools, err, errlen)) < 0) return -1;
    for (size_t i = (size_t)start; i < n; i++) {
        json_t *m = json_array_get(messages, i);
        const char *role = tl_role(m);
        size_t calls = tl_n_calls(m);
        if (!st->llama_tools && (calls || !strcmp(role, "tool"))) {
            snprintf(err, errlen, "this model's Llama 3 chat template has no tool calls");
            return -1;
        }
        if (calls) {
            if (calls != 1) {
                snprintf(err, errlen, "the Llama 3.1 template allows one tool call per assistant message; message %zu has %zu", i, calls);
                return -1;
            }
            json_t *fn = json_object_get(json_array_get(json_object_get(m, "tool_calls"), 0), "function");
            strbuf_puts(b, "<|start_header_id|>assistant<|end_header_id|>\n\n{\"name\": \"");
            strbuf_puts(b, tl_str(fn, "name"));
            strbuf_puts(b, "\", \"parameters\": ");
            tl_put_arguments(b, tl_str(fn, "arguments"), 0);
            strbuf_puts(b, "}<|eot_id|>");
        } else if (!strcmp(role, "tool")) {
            /* the template runs tojson on the content: a string is quoted */
            json_t *s = json_string(tl_str(m, "content"));
            strbuf_puts(b, "<|start_header_id|>ipython<|end_header_id|>\n\n");
            if (s) tl_put_json(b, s, 0);
            else strbuf_puts(b, tl_str(m, "content"));
            json_decref(s);
            strbuf_puts(b, "<|eot_id|>");
        } else {
            tl_llama_turn(b, role, tl_str(m, "content"));
        }
    }
    strbuf_puts(b, "<|start_header_id|>assistant<|end_header_id|>\n\n");
    return 0;
}

char *tools_render(const chat_style *st, json_t *messages, json_t *tools, const char *prefix,
                   char *err, size_t errlen) {
    if (tl_check_messages(messages, err, errlen)) return NULL;
    if (tools && json_is_array(tools) && json_array_size(tools) == 0) tools = NULL;
    if (tools && !json_is_array(tools)) { snprintf(err, errlen, "'tools' must be an array"); return NULL; }
    if (tools && st->fmt == CHAT_LLAMA3 && !st->llama_tools) {
        snprintf(err, errlen, "this model's Llama 3 chat template has no tool calls");
        return NULL;
    }
    strbuf b = {0};
    if (st->fmt == CHAT_CHATML) {
        tl_render_chatml(&b, st, messages, tools);
    } else if (st->fmt == CHAT_LLAMA3) {
        if (tl_render_llama(&b, st, messages, tools, err, errlen)) { strbuf_free(&b); return NULL; }
    } else {
        snprintf(err, errlen, "the model has no supported chat template");
        return NULL;
    }
    if (prefix) strbuf_puts(&b, prefix);
    char *out = strbuf_take(&b, NULL);
    if (!out) snprintf(err, errlen, "out of memory");
    return out;
}

/* ==== Forcing a call ==== */

int tools_args_fixed_empty(json_t *params) {
    if (!params || json_is_null(params)) return 1;   /* OpenAI: no parameters = an empty parameter list */
    json_t *props = json_object_get(params, "properties");
    return json_is_object(params) && !strcmp(tl_str(params, "type"), "object") &&
           (!props || (json_is_object(props) && json_object_size(props) == 0)) &&
           json_is_false(json_object_get(params, "additionalProperties"));
}

/* Prefixes end right after a "...": so the model's next token starts a
 * value the way its tokenizer split the training text (` {"`, ` "`). */
char *tools_prefix(enum chat_format fmt, const char *name, int args_fixed) {
    strbuf b = {0};
    if (fmt == CHAT_CHATML) strbuf_puts(&b, "<tool_call>\n");
    else if (fmt != CHAT_LLAMA3) return NULL;
    if (!name) {
        if (fmt == CHAT_LLAMA3) strbuf_puts(&b, "{\"name\":");
    } else {
        json_t *s = json_string(name);
        strbuf_puts(&b, "{\"name\": ");
        if (s) tl_put_json(&b, s, 0); else b.oom = 1;
        json_decref(s);
        strbuf_puts(&b, fmt == CHAT_CHATML ? ", \"arguments\":" : ", \"parameters\":");
        if (args_fixed) strbuf_puts(&b, fmt == CHAT_CHATML ? " {}}\n</tool_call>" : " {}}");
    }
    return strbuf_take(&b, NULL);
}

/* ==== Parsing ==== */

enum { TP_TEXT, TP_HEAD, TP_ARGS, TP_TAIL, TP_RAW, TP_PLAIN, TP_DONE };

#define TP_OPEN "<tool_call>"
#define TP_CLOSE "</tool_call>"
#define TP_PYTHON_TAG "<|python_tag|>"
#define TP_MAX_NAME 256   /* a function name longer than this is not a call */

struct tool_parser {
    enum chat_format fmt;
    int max_calls;
    int state;
    strbuf buf;                 /* text not yet decided */
    strbuf ws;                  /* whitespace before an opening tag: dropped if a call follows */
    int n_calls;                /* calls started */
    int complete;               /* calls finished */
    /* argument value scanner */
    int depth, in_str, esc, started, prim;
};

tool_parser *tool_parser_new(enum chat_format fmt, int max_calls) {
    tool_parser *p = calloc(1, sizeof *p);
    if (!p) return NULL;
    p->fmt = fmt;
    p->max_calls = max_calls > 0 ? max_calls : 1 << 20;
    p->state = TP_TEXT;
    return p;
}

void tool_parser_free(tool_parser *p) {
    if (!p) return;
    strbuf_free(&p->buf);
    strbuf_free(&p->ws);
    free(p);
}

int tool_parser_calls(const tool_parser *p) { return p->n_calls; }
int tool_parser_done(const tool_parser *p) { return p->state == TP_DONE; }

void tool_evs_clear(tool_evs *e) {
    for (int i = 0; i < e->n; i++) free(e->v[i].text);
    free(e->v);
    memset(e, 0, sizeof *e);
}

/* Appends an event, merging text into the previous one of the same kind. */
static int tp_emit(tool_evs *e, int kind, int index, const char *s, size_t n) {
    if (kind != TOOL_EV_CALL && n == 0) return 0;
    if (kind != TOOL_EV_CALL && e->n > 0 && e->v[e->n - 1].kind == kind && e->v[e->n - 1].index == index) {
        tool_ev *v = &e->v[e->n - 1];
        size_t old = strlen(v->text);
        char *t = realloc(v->text, old + n + 1);
        if (!t) return -1;
        memcpy(t + old, s, n);
        t[old + n] = 0;
        v->text = t;
        return 0;
    }
    if (e->n == e->cap) {
        int cap = e->cap ? e->cap * 2 : 8;
        tool_ev *v = realloc(e->v, sizeof *v * (size_t)cap);
        if (!v) return -1;
        e->v = v;
        e->cap = cap;
    }
    char *t = strndup(s, n);
    if (!t) return -1;
    e->v[e->n++] = (tool_ev){ .kind = kind, .index = index, .text = t };
    return 0;
}

/* Matches lit against s[*i..n): 1 matched (advances *i), 0 need more, -1 mismatch. */
static int tp_lit(const char *s, size_t n, size_t *i, const char *lit) {
    size_t l = strlen(lit), k = 0;
    for (; k < l && *i + k < n; k++)
        if (s[*i + k] != lit[k]) return -1;
    if (k < l) return 0;
    *i += l;
    return 1;
}

static void tp_skip_ws(const char *s, size_t n, size_t *i) { while (*i < n && tl_ws(s[*i])) (*i)++; }

/* A JSON string starting at s[*i] ('"'): 1 with *i past it, 0 need more, -1 too long. */
static int tp_jstr(const char *s, size_t n, size_t *i, size_t max) {
    size_t k = *i + 1;
    for (int esc = 0; k < n; k++) {
        if (k - *i > max) return -1;
        if (esc) esc = 0;
        else if (s[k] == '\\') esc = 1;
        else if (s[k] == '"') { *i = k + 1; return 1; }
    }
    return 0;
}

/* The head of a call: {"name": "NAME", "arguments": (Llama: "parameters")
 * with any whitespace. 1 matched (*used bytes, *name malloc'd), 0 need
 * more, -1 not a call head. */
static int tp_head(const tool_parser *p, const char *s, size_t n, size_t *used, char **name) {
    size_t i = 0, ns;
    int r;
#define TP_STEP(x) do { if ((r = (x)) != 1) return r; } while (0)
#define TP_WS() do { tp_skip_ws(s, n, &i); if (i >= n) return 0; } while (0)
    TP_WS();
    TP_STEP(tp_lit(s, n, &i, "{"));
    TP_WS();
    TP_STEP(tp_lit(s, n, &i, "\"name\""));
    TP_WS();
    TP_STEP(tp_lit(s, n, &i, ":"));
    TP_WS();
    if (s[i] != '"') return -1;
    ns = i;
    TP_STEP(tp_jstr(s, n, &i, TP_MAX_NAME));
    size_t ne = i;
    TP_WS();
    TP_STEP(tp_lit(s, n, &i, ","));
    TP_WS();
    if (s[i] != '"') return -1;
    size_t ks = i;
    TP_STEP(tp_jstr(s, n, &i, 16));
    size_t kl = i - ks;
    int ok = (kl == 11 && !memcmp(s + ks, "\"arguments\"", 11)) ||
             (p->fmt == CHAT_LLAMA3 && kl == 12 && !memcmp(s + ks, "\"parameters\"", 12));
    if (!ok) return -1;
    TP_WS();
    TP_STEP(tp_lit(s, n, &i, ":"));
#undef TP_STEP
#undef TP_WS
    json_t *v = json_loadb(s + ns, ne - ns, JSON_DECODE_ANY, NULL);
    if (!json_is_string(v) || json_string_length(v) == 0) { json_decref(v); return -1; }
    *name = strdup(json_string_value(v));
    json_decref(v);
    if (!*name) return -1;
    *used = i;
    return 1;
}

static void tp_args_reset(tool_parser *p) { p->depth = p->in_str = p->esc = p->started = p->prim = 0; }

/* Scans argument bytes; emits the value's bytes. Returns bytes consumed;
 * sets *end when the value is complete. */
static size_t tp_scan_args(tool_parser *p, const char *s, size_t n, tool_evs *out, int *end, int *oom) {
    size_t i = 0, from = 0;
    *end = 0;
    for (; i < n && !*end; i++) {
        char c = s[i];
        if (!p->started) {
            if (tl_ws(c)) { from = i + 1; continue; }
            p->started = 1;
            if (c == '{' || c == '[') p->depth = 1;
            else if (c == '"') p->in_str = 1;
            else p->prim = 1;
            continue;
        }
        if (p->in_str) {
            if (p->esc) p->esc = 0;
            else if (c == '\\') p->esc = 1;
            else if (c == '"') { p->in_str = 0; if (p->depth == 0) *end = 1; }
        } else if (p->prim) {
            if (c == ',' || c == '}' || c == ']' || tl_ws(c)) { *end = 1; i--; }
        } else if (c == '"') {
            p->in_str = 1;
        } else if (c == '{' || c == '[') {
            p->depth++;
        } else if ((c == '}' || c == ']') && --p->depth == 0) {
            *end = 1;
        }
    }
    if (tp_emit(out, TOOL_EV_ARGS, p->n_calls - 1, s + from, i - from)) *oom = 1;
    return i;
}

/* A whole call body parsed at once (the fallback when the head is not in
 * the usual order): 0 emitted as a call, -1 not a call. */
static int tp_whole_call(tool_parser *p, const char *s, size_t n, tool_evs *out) {
    json_t *o = json_loadb(s, n, 0, NULL);
    json_t *name = json_object_get(o, "name"), *args = json_object_get(o, "arguments");
    if (!args && p->fmt == CHAT_LLAMA3) args = json_object_get(o, "parameters");
    if (!json_is_string(name) || json_string_length(name) == 0 || !args) { json_decref(o); return -1; }
    char *a = json_is_string(args) ? strdup(json_string_value(args)) : json_dumps(args, JSON_COMPACT | JSON_ENCODE_ANY);
    int rc = !a || tp_emit(out, TOOL_EV_CALL, p->n_calls, json_string_value(name), json_string_length(name)) ||
             tp_emit(out, TOOL_EV_ARGS, p->n_calls, a, strlen(a)) ? -2 : 0;
    free(a);
    json_decref(o);
    if (rc == 0) { p->n_calls++; p->complete++; }
    return rc == -2 ? -2 : rc;
}

/* Longest suffix of s that is a proper prefix of lit. */
static size_t tp_partial(const char *s, size_t n, const char *lit) {
    size_t l = strlen(lit);
    for (size_t k = l - 1; k > 0; k--)
        if (n >= k && !memcmp(s + n - k, lit, k)) return k;
    return 0;
}

static void tp_after_call(tool_parser *p) { p->state = p->complete >= p->max_calls ? TP_DONE : TP_TEXT; }

/* One step of the state machine on the buffer; 1 progressed, 0 needs more input, -1 oom. */
static int tp_step(tool_parser *p, tool_evs *out) {
    strbuf *b = &p->buf;
    switch (p->state) {
    case TP_TEXT: {
        if (p->fmt == CHAT_LLAMA3) {
            /* Llama: a call is the whole message, a JSON object (after an optional python tag) */
            size_t i = 0;
            tp_skip_ws(b->p, b->len, &i);
            if (i == b->len) return 0;
            int t = tp_lit(b->p, b->len, &i, TP_PYTHON_TAG);
            if (t == 0) return 0;
            if (t == 1) { tl_consume(b, i); return 1; }
            p->state = b->p[i] == '{' && p->n_calls == 0 ? TP_HEAD : TP_PLAIN;
            return 1;
        }
        char *at = b->len ? memmem(b->p, b->len, TP_OPEN, strlen(TP_OPEN)) : NULL;
        size_t upto = at ? (size_t)(at - b->p) : b->len - tp_partial(b->p, b->len, TP_OPEN);
        /* whitespace right before a call is dropped: hold it until it is followed by text */
        size_t e = upto;
        while (e > 0 && tl_ws(b->p[e - 1])) e--;
        if (tp_emit(out, TOOL_EV_CONTENT, 0, b->p, e)) return -1;
        if (!at) { tl_consume(b, e); return 0; }
        strbuf_reset(&p->ws);
        strbuf_put(&p->ws, b->p + e, upto - e);
        if (p->ws.oom) return -1;
        tl_consume(b, upto + strlen(TP_OPEN));
        p->state = TP_HEAD;
        return 1;
    }
    case TP_HEAD: {
        size_t used = 0;
        char *name = NULL;
        int r = tp_head(p, b->p ? b->p : "", b->len, &used, &name);
        if (r == 0) return 0;
        if (r < 0) { p->state = TP_RAW; return 1; }
        int bad = tp_emit(out, TOOL_EV_CALL, p->n_calls, name, strlen(name));
        free(name);
        if (bad) return -1;
        p->n_calls++;
        tl_consume(b, used);
        tp_args_reset(p);
        p->state = TP_ARGS;
        return 1;
    }
    case TP_ARGS: {
        int end = 0, oom = 0;
        size_t used = tp_scan_args(p, b->p ? b->p : "", b->len, out, &end, &oom);
        if (oom) return -1;
        tl_consume(b, used);
        if (!end) return 0;
        p->complete++;
        p->state = TP_TAIL;
        return 1;
    }
    case TP_TAIL: {
        if (p->fmt == CHAT_LLAMA3) { p->state = TP_DONE; return 1; }   /* one call per message */
        char *at = b->len ? memmem(b->p, b->len, TP_CLOSE, strlen(TP_CLOSE)) : NULL;
        if (!at) return 0;
        tl_consume(b, (size_t)(at - b->p) + strlen(TP_CLOSE));
        tp_after_call(p);
        return 1;
    }
    case TP_RAW: {
        if (p->fmt == CHAT_LLAMA3) return 0;   /* decided at the end */
        char *at = b->len ? memmem(b->p, b->len, TP_CLOSE, strlen(TP_CLOSE)) : NULL;
        if (!at) return 0;
        size_t body = (size_t)(at - b->p);
        int r = tp_whole_call(p, b->p, body, out);
        if (r == -2) return -1;
        if (r < 0 && (tp_emit(out, TOOL_EV_CONTENT, 0, p->ws.p, p->ws.len) ||
                      tp_emit(out, TOOL_EV_CONTENT, 0, TP_OPEN, strlen(TP_OPEN)) ||
                      tp_emit(out, TOOL_EV_CONTENT, 0, b->p, body + strlen(TP_CLOSE))))
            return -1;
        tl_consume(b, body + strlen(TP_CLOSE));
        tp_after_call(p);
        return 1;
    }
    case TP_PLAIN:
        if (tp_emit(out, TOOL_EV_CONTENT, 0, b->p, b->len)) return -1;
        tl_consume(b, b->len);
        return 0;
    default:   /* TP_DONE */
        tl_consume(b, b->len);
        return 0;
    }
}

int tool_parser_feed(tool_parser *p, const char *s, size_t n, tool_evs *out) {
    strbuf_put(&p->buf, s, n);
    if (p->buf.oom) return -1;
    int r;
    while ((r = tp_step(p, out)) == 1) {}
    return r < 0 ? -1 : 0;
}

int tool_parser_end(tool_parser *p, tool_evs *out) {
    strbuf *b = &p->buf;
    if (tool_parser_feed(p, "", 0, out)) return -1;
    int rc = 0;
    switch (p->state) {
    case TP_TEXT:
        /* trailing whitespace: content unless the message ended in calls */
        if (p->n_calls == 0 || p->fmt == CHAT_LLAMA3) rc = tp_emit(out, TOOL_EV_CONTENT, 0, b->p, b->len);
        break;
    case TP_HEAD:
    case TP_RAW: {
        int r = tp_whole_call(p, b->p ? b->p : "", b->len, out);
        if (r == -2) rc = -1;
        else if (r < 0)
            rc = (p->fmt == CHAT_CHATML && (tp_emit(out, TOOL_EV_CONTENT, 0, p->ws.p, p->ws.len) ||
                                            tp_emit(out, TOOL_EV_CONTENT, 0, TP_OPEN, strlen(TP_OPEN)))) ||
                 tp_emit(out, TOOL_EV_CONTENT, 0, b->p, b->len);
        break;
    }
    default:
        break;   /* an unfinished call keeps what was streamed; finish_reason says why */
    }
    tl_consume(b, b->len);
    p->state = TP_DONE;
    return rc ? -1 : 0;
}

/* ==== A prompt as token ids ====
 * Moved here from engine/generate.c: rendering a one-turn chat may need the
 * template renderer of this file (a template with its own system turn). */
int32_t *tools_tokenize_prompt(model *m, const char *text, int chat, int *n_out, char *err, size_t errlen) {
    const tokenizer *tok = model_get_tokenizer(m);
    char *owned = NULL;
    if (chat) {
        enum chat_format fmt = chat_detect(model_get_gguf(m), err, errlen);
        if (fmt == CHAT_NONE) return NULL;
        chat_msg msg = { "user", text };
        chat_style st;
        if (!tools_style_detect(model_get_gguf(m), &st, err, errlen) && st.default_system) {
            /* a template that opens with its own system turn (SmolLM2,
             * Qwen2.5): the renderer that knows it, as for "messages" */
            json_t *msgs = json_pack("[{s:s, s:s}]", "role", "user", "content", text);
            owned = msgs ? tools_render(&st, msgs, NULL, NULL, err, errlen) : NULL;
            json_decref(msgs);
        } else {
            owned = chat_render(fmt, &msg, 1, 1);
        }
        if (!owned) { snprintf(err, errlen, "chat template rendering failed"); return NULL; }
        text = owned;
    }
    size_t len = strlen(text);
    int64_t need = tokenizer_encode(tok, text, len, 1, 1, NULL, 0);
    int32_t *ids = need > 0 ? malloc(sizeof(int32_t) * (size_t)need) : NULL;
    if (!ids || tokenizer_encode(tok, text, len, 1, 1, ids, need) != need) {
        snprintf(err, errlen, need == 0 ? "the prompt is empty" : "tokenization failed");
        free(ids); free(owned);
        return NULL;
    }
    free(owned);
    *n_out = (int)need;
    return ids;
}

/* responses_api.c - the OpenAI Responses API (POST /v1/responses) as pure
 * functions over bytes (responses_api.h; docs/router.md, "/v1/responses"):
 * a Responses body checked field by field and rewritten as a chat
 * completions body, and the chat answer (JSON, or the SSE chunks) rewritten
 * as a Response object or the Responses event stream. The router's
 * router_responses.c does the I/O around them; fuzz/fuzz_responses.c
 * fuzzes both directions.
 *
 * A Responses body: an unknown field is a 400 naming it, a field whose
 * meaning cannot be honoured a 400 naming it too; `instructions` becomes
 * the system message, `input` the messages (function_call items an
 * assistant turn's tool_calls, function_call_output items tool messages),
 * `text.format` the response_format, function tools the chat tools,
 * `max_output_tokens` max_tokens. Nothing is stored: `store` is answered
 * false and `previous_response_id` refused.
 */
#include "api/responses_api.h"

#include <jansson.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "api/http_api.h"

/* Output items one response may hold (a message and its function calls):
 * beyond it, further calls are dropped from the stream's bookkeeping. */
#define RS_MAX_ITEMS 64

struct api_responses {
    json_t *echo;                /* the request's fields a Response object repeats */
    char id[64];                 /* "resp_..." */
    long long created;
    char model[256];
    long long cached;            /* prompt tokens the decode node already held */
    /* the stream */
    int seq;                     /* sequence_number of the next event */
    json_t *output;              /* output items so far */
    int msg_item;                /* index in output of the open message item, -1 none */
    strbuf text;                 /* its text */
    int fc_item;                 /* index in output of the open function call, -1 none */
    strbuf args;                 /* its arguments */
    json_t *usage;               /* the chat usage chunk's usage */
    char finish[16];             /* the chat finish_reason */
    char fail_msg[400];          /* the stream's error event, "" none */
    strbuf out;                  /* events for the client */
};

/* ==== Errors ==== */

/* The chat parser's param names, as the Responses body spells them. */
void api_responses_fix_error(api_error *e) {
    static const struct { const char *chat, *resp; } map[] = {
        {"messages", "input"}, {"max_tokens", "max_output_tokens"}, {"max_completion_tokens", "max_output_tokens"},
        {"response_format", "text.format"},
    };
    char p[sizeof e->param], m[sizeof e->message], from[40], to[40];
    for (size_t i = 0; i < sizeof map / sizeof map[0]; i++) {
        size_t n = strlen(map[i].chat);
        if (strncmp(e->param, map[i].chat, n) || (e->param[n] && e->param[n] != '.' && e->param[n] != '[')) continue;
        snprintf(p, sizeof p, "%s", e->param + n);
        snprintf(e->param, sizeof e->param, "%s%s", map[i].resp, p);
        /* and the message's quoted name: "'max_tokens' must be ..." */
        snprintf(from, sizeof from, "'%s", map[i].chat);
        snprintf(to, sizeof to, "'%s", map[i].resp);
        char *at = strstr(e->message, from);
        if (at) {
            snprintf(m, sizeof m, "%.*s%s%s", (int)(at - e->message), e->message, to, at + strlen(from));
            memcpy(e->message, m, sizeof m);
        }
        return;
    }
    char *f = strstr(e->param, "].function.");   /* tools[i].function.x -> tools[i].x */
    if (!strncmp(e->param, "tools[", 6) && f) memmove(f + 1, f + 10, strlen(f + 10) + 1);
}

/* ==== The request: Responses body -> chat completions body ==== */

/* Fields accepted with no effect on the answer (hints and labels), and
 * fields whose null (or listed harmless value) is accepted but any other
 * value refused, since the router cannot do what they ask. */
static const char *const rs_hints[] = {"user", "safety_identifier", "prompt_cache_key", "metadata", "service_tier",
                                       "store", "stream_options", NULL};
static const char *const rs_unsupported[] = {"previous_response_id", "conversation", "prompt", "reasoning",
    "max_tool_calls", "top_logprobs", "include", "background", "truncation", "context_management",
    "prompt_cache_retention", "moderation", NULL};

static int rs_in(const char *const *list, const char *k) {
    for (; *list; list++)
        if (!strcmp(*list, k)) return 1;
    return 0;
}

/* 1 if every key of o is in allowed (NULL-terminated); else 0 with e naming
 * the first other one as where.key. */
static int rs_keys(json_t *o, const char *const *allowed, const char *where, api_error *e) {
    const char *k;
    json_t *v;
    json_object_foreach(o, k, v) {
        if (rs_in(allowed, k)) continue;
        char p[64];
        snprintf(p, sizeof p, "%s.%.40s", where, k);
        api_error_bad(e, p, "unknown_parameter", "Unknown parameter: '%s.%.100s'.", where, k);
        return 0;
    }
    return 1;
}

/* A harmless value of a field in rs_unsupported (what the client sends by
 * default), or 0. */
static int rs_harmless(const char *k, json_t *v) {
    if (json_is_null(v)) return 1;
    if (!strcmp(k, "background")) return json_is_false(v);
    if (!strcmp(k, "truncation")) return json_is_string(v) && !strcmp(json_string_value(v), "disabled");
    if (!strcmp(k, "include")) return json_is_array(v) && json_array_size(v) == 0;
    if (!strcmp(k, "reasoning")) return json_is_object(v) && json_object_size(v) == 0;
    return 0;
}

/* The text of a message's content: a string, or parts of type input_text /
 * output_text (concatenated). param names it in errors. */
static int rs_content(json_t *c, const char *param, strbuf *out, api_error *e) {
    if (json_is_string(c)) { strbuf_put(out, json_string_value(c), json_string_length(c)); return 0; }
    if (!json_is_array(c)) return api_error_bad(e, param, "invalid_type", "'%s' must be a string or an array of content parts.", param);
    static const char *const keys[] = {"type", "text", "annotations", "logprobs", NULL};
    for (size_t i = 0; i < json_array_size(c); i++) {
        json_t *p = json_array_get(c, i), *ty = json_object_get(p, "type"), *tx = json_object_get(p, "text");
        char pp[64];
        snprintf(pp, sizeof pp, "%s[%zu]", param, i);
        const char *t = json_string_value(ty);
        if (!json_is_object(p) || !t) return api_error_bad(e, pp, "invalid_type", "'%s' must be an object with a 'type'.", pp);
        if (strcmp(t, "input_text") && strcmp(t, "output_text"))
            return api_error_bad(e, pp, "unsupported_value", "Content part type '%.40s' is not supported (only input_text and output_text).", t);
        if (!rs_keys(p, keys, pp, e)) return -1;
        if (!json_is_string(tx)) return api_error_bad(e, pp, "invalid_type", "'%s.text' must be a string.", pp);
        strbuf_put(out, json_string_value(tx), json_string_length(tx));
    }
    return 0;
}

static int rs_text_of(json_t *c, const char *param, json_t **out, api_error *e) {
    strbuf b = {0};
    if (rs_content(c, param, &b, e)) { strbuf_free(&b); return -1; }
    *out = json_stringn(b.p ? b.p : "", b.len);
    strbuf_free(&b);
    if (!*out) return api_error_bad(e, param, "invalid_value", "'%s' is not valid UTF-8.", param);
    return 0;
}

/* The last message of msgs if it is an assistant turn (function calls join
 * it), else a new assistant message appended. */
static json_t *rs_assistant(json_t *msgs) {
    json_t *last = json_array_get(msgs, json_array_size(msgs) - 1);
    const char *role = json_string_value(json_object_get(last, "role"));
    if (last && role && !strcmp(role, "assistant")) return last;
    json_t *m = json_pack("{s:s, s:n}", "role", "assistant", "content");
    json_array_append_new(msgs, m);
    return m;
}

/* One input item i into msgs. */
static int rs_item(json_t *it, size_t i, json_t *msgs, api_error *e) {
    char p[48];
    snprintf(p, sizeof p, "input[%zu]", i);
    if (!json_is_object(it)) return api_error_bad(e, p, "invalid_type", "'%s' must be an object.", p);
    const char *ty = json_string_value(json_object_get(it, "type"));
    if (json_object_get(it, "type") && !ty) return api_error_bad(e, p, "invalid_type", "'%s.type' must be a string.", p);
    if (!ty || !strcmp(ty, "message")) {
        static const char *const keys[] = {"type", "role", "content", "id", "status", "phase", NULL};
        if (!rs_keys(it, keys, p, e)) return -1;
        const char *role = json_string_value(json_object_get(it, "role"));
        if (!role || (strcmp(role, "user") && strcmp(role, "assistant") && strcmp(role, "system") && strcmp(role, "developer"))) {
            char pr[64];
            snprintf(pr, sizeof pr, "%s.role", p);
            return api_error_bad(e, pr, "invalid_value", "'%s' must be one of user, assistant, system, developer.", pr);
        }
        char pc[64];
        snprintf(pc, sizeof pc, "%s.content", p);
        json_t *text;
        if (rs_text_of(json_object_get(it, "content"), pc, &text, e)) return -1;
        json_array_append_new(msgs, json_pack("{s:s, s:o}", "role", role, "content", text));
        return 0;
    }
    if (!strcmp(ty, "function_call")) {
        static const char *const keys[] = {"type", "id", "call_id", "name", "arguments", "status", NULL};
        if (!rs_keys(it, keys, p, e)) return -1;
        json_t *cid = json_object_get(it, "call_id"), *name = json_object_get(it, "name"), *args = json_object_get(it, "arguments");
        if (!json_is_string(cid) || !json_is_string(name) || !json_is_string(args))
            return api_error_bad(e, p, "invalid_type", "'%s' (a function_call) needs string 'call_id', 'name' and 'arguments'.", p);
        json_t *a = rs_assistant(msgs), *calls = json_object_get(a, "tool_calls");
        if (!calls) json_object_set_new(a, "tool_calls", calls = json_array());
        json_array_append_new(calls, json_pack("{s:O, s:s, s:{s:O, s:O}}", "id", cid, "type", "function", "function",
                                               "name", name, "arguments", args));
        return 0;
    }
    if (!strcmp(ty, "function_call_output")) {
        static const char *const keys[] = {"type", "id", "call_id", "output", "status", NULL};
        if (!rs_keys(it, keys, p, e)) return -1;
        json_t *cid = json_object_get(it, "call_id"), *text;
        char po[64];
        snprintf(po, sizeof po, "%s.call_id", p);
        if (!json_is_string(cid)) return api_error_bad(e, po, "invalid_type", "'%s' must be a string.", po);
        snprintf(po, sizeof po, "%s.output", p);
        if (rs_text_of(json_object_get(it, "output"), po, &text, e)) return -1;
        json_array_append_new(msgs, json_pack("{s:s, s:O, s:o}", "role", "tool", "tool_call_id", cid, "content", text));
        return 0;
    }
    char pt[64];
    snprintf(pt, sizeof pt, "%s.type", p);
    return api_error_bad(e, pt, "unsupported_value",
                  "Input item type '%.40s' is not supported (message, function_call, function_call_output).", ty);
}

static int rs_input(json_t *in, json_t *instructions, json_t *msgs, api_error *e) {
    if (json_is_string(instructions)) json_array_append_new(msgs, json_pack("{s:s, s:O}", "role", "system", "content", instructions));
    else if (instructions && !json_is_null(instructions))
        return api_error_bad(e, "instructions", "invalid_type", "'instructions' must be a string.");
    if (!in) return api_error_bad(e, "input", "missing_required_parameter", "Missing required parameter: 'input'.");
    if (json_is_string(in)) {
        json_array_append_new(msgs, json_pack("{s:s, s:O}", "role", "user", "content", in));
        return 0;
    }
    if (!json_is_array(in) || json_array_size(in) == 0)
        return api_error_bad(e, "input", "invalid_type", "'input' must be a string or a non-empty array of input items.");
    for (size_t i = 0; i < json_array_size(in); i++)
        if (rs_item(json_array_get(in, i), i, msgs, e)) return -1;
    return 0;
}

/* text: {"format": {...}} -> response_format (set on chat); the echoed text. */
static int rs_text(json_t *text, json_t *chat, json_t *echo, api_error *e) {
    if (!text || json_is_null(text)) return 0;
    static const char *const keys[] = {"format", "verbosity", NULL};
    if (!json_is_object(text)) return api_error_bad(e, "text", "invalid_type", "'text' must be an object.");
    if (!rs_keys(text, keys, "text", e)) return -1;
    json_t *verb = json_object_get(text, "verbosity");
    if (verb && !json_is_null(verb))
        return api_error_bad(e, "text.verbosity", "unsupported_parameter", "'text.verbosity' is not supported by this server.");
    json_t *f = json_object_get(text, "format");
    if (!f || json_is_null(f)) return 0;
    const char *t = json_string_value(json_object_get(f, "type"));
    if (!json_is_object(f) || !t) return api_error_bad(e, "text.format", "invalid_type", "'text.format' must be an object with a 'type'.");
    if (!strcmp(t, "text") || !strcmp(t, "json_object")) {
        static const char *const fk[] = {"type", NULL};
        if (!rs_keys(f, fk, "text.format", e)) return -1;
        if (t[0] == 'j') json_object_set_new(chat, "response_format", json_pack("{s:s}", "type", "json_object"));
    } else if (!strcmp(t, "json_schema")) {
        static const char *const fk[] = {"type", "name", "schema", "strict", "description", NULL};
        if (!rs_keys(f, fk, "text.format", e)) return -1;
        json_t *name = json_object_get(f, "name"), *schema = json_object_get(f, "schema"), *strict = json_object_get(f, "strict");
        if (!json_is_string(name)) return api_error_bad(e, "text.format.name", "missing_required_parameter", "'text.format.name' must be a string.");
        if (!json_is_object(schema)) return api_error_bad(e, "text.format.schema", "missing_required_parameter", "'text.format.schema' must be an object.");
        if (strict && !json_is_null(strict) && !json_is_boolean(strict))
            return api_error_bad(e, "text.format.strict", "invalid_type", "'text.format.strict' must be a boolean.");
        json_t *js = json_pack("{s:O, s:O}", "name", name, "schema", schema);
        if (json_is_boolean(strict)) json_object_set(js, "strict", strict);
        json_object_set_new(chat, "response_format", json_pack("{s:s, s:o}", "type", "json_schema", "json_schema", js));
    } else {
        return api_error_bad(e, "text.format.type", "invalid_value", "'text.format.type' must be text, json_object or json_schema.");
    }
    json_object_set_new(echo, "text", json_pack("{s:O}", "format", f));
    return 0;
}

static int rs_tools(json_t *tools, json_t *chat, json_t *echo, api_error *e) {
    if (!tools || json_is_null(tools)) return 0;
    if (!json_is_array(tools)) return api_error_bad(e, "tools", "invalid_type", "'tools' must be an array.");
    json_t *out = json_array();
    json_object_set_new(chat, "tools", out);
    static const char *const keys[] = {"type", "name", "description", "parameters", "strict", NULL};
    for (size_t i = 0; i < json_array_size(tools); i++) {
        json_t *t = json_array_get(tools, i);
        char p[32];
        snprintf(p, sizeof p, "tools[%zu]", i);
        const char *ty = json_string_value(json_object_get(t, "type"));
        if (!json_is_object(t) || !ty) return api_error_bad(e, p, "invalid_type", "'%s' must be an object with a 'type'.", p);
        if (strcmp(ty, "function")) {
            char pt[48];
            snprintf(pt, sizeof pt, "%s.type", p);
            return api_error_bad(e, pt, "unsupported_value", "Tool type '%.40s' is not supported (only function tools).", ty);
        }
        if (!rs_keys(t, keys, p, e)) return -1;
        json_t *fn = json_deep_copy(t);
        json_object_del(fn, "type");
        json_array_append_new(out, json_pack("{s:s, s:o}", "type", "function", "function", fn));
    }
    json_object_set(echo, "tools", tools);
    return 0;
}

static int rs_tool_choice(json_t *tc, json_t *chat, json_t *echo, api_error *e) {
    if (!tc || json_is_null(tc)) return 0;
    json_object_set(echo, "tool_choice", tc);
    if (json_is_string(tc)) { json_object_set(chat, "tool_choice", tc); return 0; }
    const char *ty = json_string_value(json_object_get(tc, "type"));
    json_t *name = json_object_get(tc, "name");
    static const char *const keys[] = {"type", "name", NULL};
    if (!json_is_object(tc) || !ty || strcmp(ty, "function"))
        return api_error_bad(e, "tool_choice", "unsupported_value",
                      "'tool_choice' must be none, auto, required or {\"type\": \"function\", \"name\": ...}.");
    if (!rs_keys(tc, keys, "tool_choice", e)) return -1;
    if (!json_is_string(name)) return api_error_bad(e, "tool_choice.name", "invalid_type", "'tool_choice.name' must be a string.");
    json_object_set_new(chat, "tool_choice", json_pack("{s:s, s:{s:O}}", "type", "function", "function", "name", name));
    return 0;
}

/* What a Response object repeats of the request, with OpenAI's defaults. */
static json_t *rs_echo_new(void) {
    return json_pack("{s:n, s:n, s:{}, s:b, s:n, s:f, s:f, s:{s:{s:s}}, s:s, s:[], s:s, s:b, s:{s:n, s:n}, s:s, s:b, s:n}",
                     "instructions", "max_output_tokens", "metadata", "parallel_tool_calls", 1, "previous_response_id",
                     "temperature", 1.0, "top_p", 1.0, "text", "format", "type", "text", "tool_choice", "auto", "tools",
                     "truncation", "disabled", "store", 0, "reasoning", "effort", "summary", "service_tier", "default",
                     "background", 0, "user");
}

/* The whole body: fields one by one into chat (and echo). */
static int rs_translate(json_t *root, json_t *chat, json_t *echo, api_error *e) {
    const char *k;
    json_t *v;
    json_object_foreach(root, k, v) {
        if (!strcmp(k, "model") || !strcmp(k, "temperature") || !strcmp(k, "top_p") || !strcmp(k, "parallel_tool_calls")) {
            if (json_is_null(v) && strcmp(k, "model")) continue;   /* null: the default */
            json_object_set(chat, k, v);
            if (strcmp(k, "model")) json_object_set(echo, k, v);
        } else if (!strcmp(k, "max_output_tokens")) {
            if (!json_is_null(v)) { json_object_set(chat, "max_tokens", v); json_object_set(echo, k, v); }
        } else if (!strcmp(k, "stream")) {
            if (!json_is_null(v)) json_object_set(chat, k, v);
            if (json_is_true(v)) json_object_set_new(chat, "stream_options", json_pack("{s:b}", "include_usage", 1));
        } else if (!strcmp(k, "instructions")) {
            json_object_set(echo, k, v);
        } else if (!strcmp(k, "input") || !strcmp(k, "text") || !strcmp(k, "tools") || !strcmp(k, "tool_choice")) {
            continue;   /* below, in order */
        } else if (rs_in(rs_hints, k)) {
            if (!strcmp(k, "metadata") && !json_is_null(v) && !json_is_object(v))
                return api_error_bad(e, k, "invalid_type", "'metadata' must be an object.");
            if (!strcmp(k, "user") && json_is_string(v)) json_object_set(echo, k, v);
            if (!strcmp(k, "metadata") && json_is_object(v)) json_object_set(echo, k, v);
        } else if (rs_in(rs_unsupported, k)) {
            if (!rs_harmless(k, v))
                return api_error_bad(e, k, "unsupported_parameter", "'%s' is not supported by this server%s.", k,
                              !strcmp(k, "previous_response_id") || !strcmp(k, "conversation")
                              ? " (it stores no responses: send the whole conversation in 'input')" : "");
        } else {
            return api_error_bad(e, k, "unknown_parameter", "Unknown parameter: '%.100s'.", k);
        }
    }
    json_t *msgs = json_array();
    json_object_set_new(chat, "messages", msgs);
    if (rs_input(json_object_get(root, "input"), json_object_get(root, "instructions"), msgs, e) ||
        rs_text(json_object_get(root, "text"), chat, echo, e) || rs_tools(json_object_get(root, "tools"), chat, echo, e) ||
        rs_tool_choice(json_object_get(root, "tool_choice"), chat, echo, e))
        return -1;
    return 0;
}

int api_responses_parse(const char *body, size_t len, char **chat_body, api_responses **out, api_error *e) {
    *chat_body = NULL;
    *out = NULL;
    json_error_t je;
    json_t *root = json_loadb(body, len, JSON_REJECT_DUPLICATES, &je);
    if (!root || !json_is_object(root)) {
        json_decref(root);
        return api_error_bad(e, NULL, "invalid_json", "The request body is not a JSON object (%.200s).", root ? "not an object" : je.text);
    }
    json_t *chat = json_object(), *echo = rs_echo_new();
    int rc = chat && echo ? rs_translate(root, chat, echo, e) : api_error_bad(e, NULL, NULL, "out of memory");
    char *s = rc ? NULL : json_dumps(chat, JSON_COMPACT);
    api_responses *rs = s ? calloc(1, sizeof *rs) : NULL;
    json_decref(root);
    json_decref(chat);
    if (!rs) {
        free(s);
        json_decref(echo);
        if (!rc) api_error_set(e, 500, "server_error", NULL, NULL, "out of memory");
        return -1;
    }
    rs->echo = echo;
    rs->msg_item = rs->fc_item = -1;
    *chat_body = s;
    *out = rs;
    return 0;
}

void api_responses_free(api_responses *rs) {
    if (!rs) return;
    json_decref(rs->echo);
    json_decref(rs->output);
    json_decref(rs->usage);
    strbuf_free(&rs->text);
    strbuf_free(&rs->args);
    strbuf_free(&rs->out);
    free(rs);
}

/* ==== The answer: chat shapes -> Response ==== */

/* Responses usage from a chat usage object (NULL: none), with the tokens
 * the decode node already held counted as cached. */
static json_t *rs_usage(const api_responses *rs, json_t *u) {
    json_int_t in = json_integer_value(json_object_get(u, "prompt_tokens"));
    json_int_t out = json_integer_value(json_object_get(u, "completion_tokens"));
    json_int_t cached = rs->cached > 0 ? rs->cached : 0;
    if (cached > in) cached = in;
    return json_pack("{s:I, s:{s:I}, s:I, s:{s:i}, s:I}", "input_tokens", in, "input_tokens_details", "cached_tokens", cached,
                     "output_tokens", out, "output_tokens_details", "reasoning_tokens", 0, "total_tokens", in + out);
}

/* The Response object: status "in_progress", "completed", "incomplete" or
 * "failed"; output and usage borrowed (NULL: [] and null). */
static json_t *rs_response(api_responses *rs, const char *status, json_t *output, json_t *usage) {
    json_t *o = json_deep_copy(rs->echo);
    json_t *head = json_pack("{s:s, s:s, s:I, s:s, s:s, s:n, s:n}", "id", rs->id, "object", "response", "created_at",
                             (json_int_t)rs->created, "status", status, "model", rs->model, "error", "incomplete_details");
    json_object_update(o, head);
    json_decref(head);
    json_object_set_new(o, "output", output ? json_incref(output) : json_array());
    json_object_set_new(o, "usage", usage ? json_incref(usage) : json_null());
    if (!strcmp(status, "incomplete"))
        json_object_set_new(o, "incomplete_details", json_pack("{s:s}", "reason", "max_output_tokens"));
    if (!strcmp(status, "failed"))
        json_object_set_new(o, "error", json_pack("{s:s, s:s}", "code", "server_error", "message", rs->fail_msg));
    if (strcmp(status, "in_progress") && strcmp(status, "failed"))
        json_object_set_new(o, "completed_at", json_integer((json_int_t)time(NULL)));
    return o;
}

static void rs_item_id(const api_responses *rs, const char *kind, int index, char *out, size_t n) {
    snprintf(out, n, "%s_%s_%d", kind, rs->id + 5, index);
}

static json_t *rs_message_item(const char *id, const char *status, const char *text, size_t len) {
    return json_pack("{s:s, s:s, s:s, s:s, s:[{s:s, s:s%, s:[], s:[]}]}", "id", id, "type", "message", "status", status,
                     "role", "assistant", "content", "type", "output_text", "text", text, len, "annotations", "logprobs");
}

static json_t *rs_call_item(const char *id, const char *status, json_t *call_id, json_t *name, const char *args) {
    return json_pack("{s:s, s:s, s:s, s:O, s:O, s:s}", "id", id, "type", "function_call", "status", status, "call_id",
                     call_id, "name", name, "arguments", args);
}

/* The non-stream reply from choice 0's chat completion (chat: its JSON). */
char *api_responses_reply(api_responses *rs, const char *chat) {
    json_t *c = json_loads(chat, 0, NULL);
    json_t *ch = json_array_get(json_object_get(c, "choices"), 0), *msg = json_object_get(ch, "message");
    const char *finish = json_string_value(json_object_get(ch, "finish_reason"));
    int cut = finish && !strcmp(finish, "length");
    const char *st = cut ? "incomplete" : "completed";
    json_t *out = json_array(), *content = json_object_get(msg, "content"), *calls = json_object_get(msg, "tool_calls");
    char id[96];
    if (json_string_length(content) > 0 || !json_array_size(calls)) {
        rs_item_id(rs, "msg", 0, id, sizeof id);
        json_array_append_new(out, rs_message_item(id, st, json_string_value(content) ? json_string_value(content) : "",
                                                   json_string_length(content)));
    }
    for (size_t i = 0; i < json_array_size(calls); i++) {
        json_t *tc = json_array_get(calls, i), *fn = json_object_get(tc, "function");
        rs_item_id(rs, "fc", (int)json_array_size(out), id, sizeof id);
        const char *args = json_string_value(json_object_get(fn, "arguments"));
        json_array_append_new(out, rs_call_item(id, st, json_object_get(tc, "id"), json_object_get(fn, "name"), args ? args : ""));
    }
    json_t *usage = rs_usage(rs, json_object_get(c, "usage"));
    json_t *resp = c ? rs_response(rs, st, out, usage) : NULL;
    char *s = resp ? json_dumps(resp, JSON_COMPACT) : NULL;
    json_decref(resp);
    json_decref(usage);
    json_decref(out);
    json_decref(c);
    return s;
}

/* ==== The event stream ==== */

/* One event (taken): "event: TYPE\ndata: {...,"sequence_number":n}\n\n". */
static void rs_emit(api_responses *rs, const char *type, json_t *ev) {
    json_object_set_new(ev, "type", json_string(type));
    json_object_set_new(ev, "sequence_number", json_integer(rs->seq++));
    char *s = json_dumps(ev, JSON_COMPACT);
    json_decref(ev);
    if (!s) { rs->out.oom = 1; return; }
    strbuf_printf(&rs->out, "event: %s\ndata: %s\n\n", type, s);
    free(s);
}

static void rs_open_message(api_responses *rs) {
    char id[96];
    int idx = (int)json_array_size(rs->output);
    rs_item_id(rs, "msg", idx, id, sizeof id);
    json_t *item = json_pack("{s:s, s:s, s:s, s:s, s:[]}", "id", id, "type", "message", "status", "in_progress",
                             "role", "assistant", "content");
    json_array_append_new(rs->output, item);
    rs->msg_item = idx;
    strbuf_reset(&rs->text);
    rs_emit(rs, "response.output_item.added", json_pack("{s:i, s:O}", "output_index", idx, "item", item));
    rs_emit(rs, "response.content_part.added", json_pack("{s:s, s:i, s:i, s:{s:s, s:s, s:[], s:[]}}", "item_id", id,
                                                         "output_index", idx, "content_index", 0, "part", "type",
                                                         "output_text", "text", "", "annotations", "logprobs"));
}

static void rs_close_message(api_responses *rs, const char *status) {
    if (rs->msg_item < 0) return;
    int idx = rs->msg_item;
    rs->msg_item = -1;
    char id[96];
    rs_item_id(rs, "msg", idx, id, sizeof id);
    const char *t = rs->text.p ? rs->text.p : "";
    rs_emit(rs, "response.output_text.done", json_pack("{s:s, s:i, s:i, s:s%, s:[]}", "item_id", id, "output_index", idx,
                                                       "content_index", 0, "text", t, rs->text.len, "logprobs"));
    rs_emit(rs, "response.content_part.done", json_pack("{s:s, s:i, s:i, s:{s:s, s:s%, s:[], s:[]}}", "item_id", id,
                                                        "output_index", idx, "content_index", 0, "part", "type",
                                                        "output_text", "text", t, rs->text.len, "annotations", "logprobs"));
    json_t *item = rs_message_item(id, status, t, rs->text.len);
    json_array_set(rs->output, (size_t)idx, item);
    rs_emit(rs, "response.output_item.done", json_pack("{s:i, s:o}", "output_index", idx, "item", item));
}

static void rs_close_call(api_responses *rs, const char *status) {
    if (rs->fc_item < 0) return;
    int idx = rs->fc_item;
    rs->fc_item = -1;
    json_t *item = json_array_get(rs->output, (size_t)idx);
    const char *id = json_string_value(json_object_get(item, "id"));
    const char *a = rs->args.p ? rs->args.p : "";
    rs_emit(rs, "response.function_call_arguments.done", json_pack("{s:s, s:i, s:s, s:O}", "item_id", id, "output_index",
                                                                   idx, "arguments", a, "name", json_object_get(item, "name")));
    json_t *done = rs_call_item(id, status, json_object_get(item, "call_id"), json_object_get(item, "name"), a);
    json_array_set_new(rs->output, (size_t)idx, done);
    rs_emit(rs, "response.output_item.done", json_pack("{s:i, s:O}", "output_index", idx, "item", done));
}

static void rs_text_delta(api_responses *rs, json_t *d) {
    if (rs->fc_item >= 0) rs_close_call(rs, "completed");
    if (rs->msg_item < 0) rs_open_message(rs);
    char id[96];
    rs_item_id(rs, "msg", rs->msg_item, id, sizeof id);
    strbuf_put(&rs->text, json_string_value(d), json_string_length(d));
    rs_emit(rs, "response.output_text.delta", json_pack("{s:s, s:i, s:i, s:O, s:[]}", "item_id", id, "output_index",
                                                        rs->msg_item, "content_index", 0, "delta", d, "logprobs"));
}

/* A streamed tool-call delta: a new call has its id and name. */
static void rs_call_delta(api_responses *rs, json_t *tc) {
    json_t *cid = json_object_get(tc, "id"), *fn = json_object_get(tc, "function");
    json_t *args = json_object_get(fn, "arguments");
    if (json_is_string(cid)) {
        rs_close_message(rs, "completed");
        rs_close_call(rs, "completed");
        if (json_array_size(rs->output) >= RS_MAX_ITEMS) return;
        char id[96];
        int idx = (int)json_array_size(rs->output);
        rs_item_id(rs, "fc", idx, id, sizeof id);
        json_t *name = json_object_get(fn, "name");
        name = json_is_string(name) ? json_incref(name) : json_string("");
        json_t *item = rs_call_item(id, "in_progress", cid, name, "");
        json_decref(name);
        json_array_append_new(rs->output, item);
        rs->fc_item = idx;
        strbuf_reset(&rs->args);
        rs_emit(rs, "response.output_item.added", json_pack("{s:i, s:O}", "output_index", idx, "item", item));
    }
    if (rs->fc_item < 0 || !json_string_length(args)) return;
    strbuf_put(&rs->args, json_string_value(args), json_string_length(args));
    const char *id = json_string_value(json_object_get(json_array_get(rs->output, (size_t)rs->fc_item), "id"));
    rs_emit(rs, "response.function_call_arguments.delta", json_pack("{s:s, s:i, s:O}", "item_id", id, "output_index",
                                                                    rs->fc_item, "delta", args));
}

/* One chat SSE event's JSON. */
static void rs_chunk(api_responses *rs, json_t *ev) {
    json_t *err = json_object_get(ev, "error");
    if (err) {
        const char *m = json_string_value(json_object_get(err, "message"));
        snprintf(rs->fail_msg, sizeof rs->fail_msg, "%s", m ? m : "the stream failed");
        return;
    }
    json_t *u = json_object_get(ev, "usage");
    if (json_is_object(u)) { json_decref(rs->usage); rs->usage = json_incref(u); }
    json_t *ch = json_array_get(json_object_get(ev, "choices"), 0), *d = json_object_get(ch, "delta");
    json_t *content = json_object_get(d, "content"), *calls = json_object_get(d, "tool_calls");
    if (json_string_length(content) > 0) rs_text_delta(rs, content);
    for (size_t i = 0; i < json_array_size(calls); i++) rs_call_delta(rs, json_array_get(calls, i));
    const char *f = json_string_value(json_object_get(ch, "finish_reason"));
    if (f) snprintf(rs->finish, sizeof rs->finish, "%s", f);
}

/* The chat stream's bytes (whole events: "data: ...\n\n" each). */
void api_responses_feed(api_responses *rs, const char *s, size_t n) {
    if (!rs->output) rs->output = json_array();
    const char *end = s + n;
    while (s < end) {
        const char *sep = memmem(s, (size_t)(end - s), "\n\n", 2);
        const char *stop = sep ? sep : end;
        if (stop - s > 6 && !strncmp(s, "data: ", 6) && strncmp(s + 6, "[DONE]", 6)) {
            json_t *ev = json_loadb(s + 6, (size_t)(stop - s - 6), 0, NULL);
            if (json_is_object(ev)) rs_chunk(rs, ev);
            json_decref(ev);
        }
        s = sep ? sep + 2 : end;
    }
}

/* The chat stream ended: the open items close and the last event says how. */
void api_responses_finish(api_responses *rs, int ok) {
    if (!ok && !rs->fail_msg[0]) return;   /* the client left: nobody to tell */
    int cut = !strcmp(rs->finish, "length");
    const char *item_st = cut ? "incomplete" : "completed";
    if (rs->fail_msg[0]) {
        item_st = "incomplete";
        rs_emit(rs, "error", json_pack("{s:s, s:s, s:n}", "code", "server_error", "message", rs->fail_msg, "param"));
    }
    rs_close_message(rs, item_st);
    rs_close_call(rs, item_st);
    const char *st = rs->fail_msg[0] ? "failed" : cut ? "incomplete" : "completed";
    json_t *usage = rs->usage ? rs_usage(rs, rs->usage) : NULL;
    char type[40];
    snprintf(type, sizeof type, "response.%s", st);
    rs_emit(rs, type, json_pack("{s:o}", "response", rs_response(rs, st, rs->output, usage)));
    json_decref(usage);
}

/* ==== Identity and the stream's start ==== */

void api_responses_start(api_responses *rs, const char *id, long long created, const char *model) {
    snprintf(rs->id, sizeof rs->id, "%s", id);
    rs->created = created;
    snprintf(rs->model, sizeof rs->model, "%s", model ? model : "");
}

void api_responses_set_cached(api_responses *rs, long long cached) { rs->cached = cached; }

void api_responses_begin_stream(api_responses *rs) {
    json_decref(rs->output);
    rs->output = json_array();
    json_t *r0 = rs_response(rs, "in_progress", NULL, NULL);
    rs_emit(rs, "response.created", json_pack("{s:O}", "response", r0));
    rs_emit(rs, "response.in_progress", json_pack("{s:o}", "response", r0));
}

strbuf *api_responses_out(api_responses *rs) { return &rs->out; }

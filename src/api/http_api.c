/* http_api.c - OpenAI request parsing/validation (see http_api.h): limits
 * and errors, field readers, prompts and messages, tools, the request and
 * its prompt children. Pure functions over jansson; no I/O.
 * http_api_upstream.c speaks the decode node's protocol (the body sent to
 * it, its NDJSON lines); http_api_render.c renders responses and SSE chunks.
 */
#include "api/http_api.h"
#include "engine/grammar.h"
#include "api/tools.h"
#include "api/extensions.h"

#include <jansson.h>
#include <math.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

/* ==== Limits and errors ==== */

void api_limits_default(api_limits *l) {
    l->max_tokens_limit = 4096;       /* generous for the small models tandem serves */
    l->default_max_tokens = 0;        /* until the end of the context, as OpenAI's chat API does */
    l->max_prompt_bytes = 256 * 1024; /* ~64k tokens of English: beyond any context we serve */
    l->max_prompt_tokens = 65536;
    l->max_messages = 256;
    l->max_stop = 4;                  /* OpenAI's documented maximum */
    l->lenient = 0;                   /* unknown fields are refused by name */
}

void api_error_set(api_error *e, int status, const char *type, const char *code,
                   const char *param, const char *fmt, ...) {
    e->status = status;
    e->type = type;
    e->code = code;
    snprintf(e->param, sizeof e->param, "%s", param ? param : "");
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(e->message, sizeof e->message, fmt, ap);
    va_end(ap);
}

int api_error_bad(api_error *e, const char *param, const char *code, const char *fmt, ...) {
    e->status = 400;
    e->type = "invalid_request_error";
    e->code = code;
    snprintf(e->param, sizeof e->param, "%s", param ? param : "");
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(e->message, sizeof e->message, fmt, ap);
    va_end(ap);
    return -1;
}

static const char *api_json_type_name(const json_t *v) {
    switch (json_typeof(v)) {
    case JSON_OBJECT: return "object";
    case JSON_ARRAY: return "array";
    case JSON_STRING: return "string";
    case JSON_INTEGER: return "integer";
    case JSON_REAL: return "number";
    case JSON_TRUE: case JSON_FALSE: return "boolean";
    default: return "null";
    }
}

static int api_wrong_type(api_error *e, const char *param, const char *want, const json_t *v) {
    return api_error_bad(e, param, "invalid_type", "Invalid type for '%s': expected %s, but got %s.",
                   param, want, api_json_type_name(v));
}

char *api_error_json(const api_error *e) {
    json_t *o = json_pack("{s:{s:s, s:s, s:o, s:o}}", "error",
                          "message", e->message,
                          "type", e->type ? e->type : "server_error",
                          "param", e->param[0] ? json_string(e->param) : json_null(),
                          "code", e->code ? json_string(e->code) : json_null());
    if (!o) return strdup("{\"error\":{\"message\":\"internal error\",\"type\":\"server_error\",\"param\":null,\"code\":null}}");
    char *s = json_dumps(o, JSON_COMPACT);
    json_decref(o);
    return s;
}

/* ==== Field readers ==== */

/* A number field in [lo, hi]; absent or null keeps *out. */
static int api_get_number(json_t *root, const char *key, double lo, double hi, double *out, api_error *e) {
    json_t *v = json_object_get(root, key);
    if (!v || json_is_null(v)) return 0;
    if (!json_is_number(v)) return api_wrong_type(e, key, "a number", v);
    double x = json_number_value(v);
    if (!isfinite(x) || x < lo || x > hi)
        return api_error_bad(e, key, "invalid_value", "'%s' must be between %g and %g; got %g.", key, lo, hi, x);
    *out = x;
    return 0;
}

static int api_get_bool(json_t *root, const char *key, int *out, api_error *e) {
    json_t *v = json_object_get(root, key);
    if (!v || json_is_null(v)) return 0;
    if (!json_is_boolean(v)) return api_wrong_type(e, key, "a boolean", v);
    *out = json_is_true(v);
    return 0;
}

/* max_tokens (or max_completion_tokens for chat): integer in [1, limit]. */
static int api_get_max_tokens(json_t *root, const api_limits *lim, api_request *r, api_error *e) {
    static const char *const keys[2] = {"max_tokens", "max_completion_tokens"};
    r->max_tokens = lim->default_max_tokens;
    for (int i = 0; i < 2; i++) {
        json_t *v = json_object_get(root, keys[i]);
        if (!v || json_is_null(v)) continue;
        if (!json_is_integer(v)) return api_wrong_type(e, keys[i], "an integer", v);
        json_int_t x = json_integer_value(v);
        if (x < 1)
            return api_error_bad(e, keys[i], "invalid_value", "'%s' must be at least 1; got %lld.", keys[i], (long long)x);
        if (x > lim->max_tokens_limit)
            return api_error_bad(e, keys[i], "invalid_value",
                           "'%s' is too large: %lld. This server allows at most %d completion tokens.",
                           keys[i], (long long)x, lim->max_tokens_limit);
        r->max_tokens = (int)x;
        r->max_tokens_given = 1;
    }
    return 0;
}

static int api_get_stop(json_t *root, const api_limits *lim, api_request *r, api_error *e) {
    json_t *v = json_object_get(root, "stop");
    if (!v || json_is_null(v)) return 0;
    if (json_is_string(v)) {
        if (json_string_length(v) == 0) return 0;
        r->stop = calloc(1, sizeof *r->stop);
        if (!r->stop || !(r->stop[0] = strdup(json_string_value(v))))
            return api_error_bad(e, "stop", NULL, "out of memory");
        r->n_stop = 1;
        return 0;
    }
    if (!json_is_array(v)) return api_wrong_type(e, "stop", "a string or an array of strings", v);
    size_t n = json_array_size(v);
    if ((int)n > lim->max_stop || n > 64)
        return api_error_bad(e, "stop", "invalid_value", "'stop' may hold at most %d sequences; got %zu.", lim->max_stop, n);
    r->stop = calloc(n ? n : 1, sizeof *r->stop);
    if (!r->stop) return api_error_bad(e, "stop", NULL, "out of memory");
    for (size_t i = 0; i < n; i++) {
        json_t *s = json_array_get(v, i);
        if (!json_is_string(s)) return api_wrong_type(e, "stop", "an array of strings", s);
        if (json_string_length(s) == 0) continue;
        if (!(r->stop[r->n_stop] = strdup(json_string_value(s)))) return api_error_bad(e, "stop", NULL, "out of memory");
        r->n_stop++;
    }
    return 0;
}

/* ==== Prompt and messages ==== */

static int api_get_token_array(json_t *arr, const api_limits *lim, api_request *r, api_error *e) {
    size_t n = json_array_size(arr);
    if (n == 0) return api_error_bad(e, "prompt", "invalid_value", "'prompt' must not be empty.");
    if ((long long)n > lim->max_prompt_tokens)
        return api_error_bad(e, "prompt", "context_length_exceeded",
                       "The prompt has %zu tokens; this server accepts at most %d.", n, lim->max_prompt_tokens);
    r->tokens = malloc(n * sizeof *r->tokens);
    if (!r->tokens) return api_error_bad(e, "prompt", NULL, "out of memory");
    for (size_t i = 0; i < n; i++) {
        json_t *t = json_array_get(arr, i);
        if (!json_is_integer(t)) return api_wrong_type(e, "prompt", "an array of token ids (integers)", t);
        json_int_t x = json_integer_value(t);
        if (x < 0 || x > INT32_MAX)
            return api_error_bad(e, "prompt", "invalid_value", "Token id %lld at position %zu is out of range.", (long long)x, i);
        r->tokens[i] = (int32_t)x;
    }
    r->n_tokens = (int)n;
    return 0;
}

/* One prompt: "text" or [ids]. */
static int api_get_one_prompt(json_t *v, const api_limits *lim, api_request *r, api_error *e) {
    if (json_is_string(v)) {
        size_t n = json_string_length(v);
        if (n > lim->max_prompt_bytes)
            return api_error_bad(e, "prompt", "context_length_exceeded",
                           "The prompt is %zu bytes; this server accepts at most %zu bytes "
                           "(reduce the length of the prompt).", n, lim->max_prompt_bytes);
        if (n == 0) return api_error_bad(e, "prompt", "invalid_value", "'prompt' must not be empty.");
        r->prompt = strdup(json_string_value(v));
        if (!r->prompt) return api_error_bad(e, "prompt", NULL, "out of memory");
        r->prompt_bytes = n;
        return 0;
    }
    if (json_is_array(v)) return api_get_token_array(v, lim, r, e);
    return api_wrong_type(e, "prompt", "a string or an array of token ids", v);
}

/* Several prompts (["a", "b"] or [[ids], [ids]]): each is checked as a
 * prompt of its own here; the router runs one child request per prompt
 * (api_parse_prompt_children) and merges their choices. */
static int api_check_prompts(json_t *v, const api_limits *lim, api_request *r, api_error *e) {
    size_t n = json_array_size(v);
    if (n > API_MAX_PROMPTS)
        return api_error_bad(e, "prompt", "invalid_value", "'prompt' may hold at most %d prompts; got %zu.", API_MAX_PROMPTS, n);
    for (size_t i = 0; i < n; i++) {
        json_t *p = json_array_get(v, i);
        if (!json_is_string(p) && !json_is_array(p))
            return api_wrong_type(e, "prompt", "an array of strings or of token-id arrays", p);
        if (json_is_array(p)) r->prompts_have_ids = 1;
        api_request one = {0};
        int rc = api_get_one_prompt(p, lim, &one, e);
        api_request_free(&one);
        if (rc) {
            snprintf(e->param, sizeof e->param, "prompt[%zu]", i);
            return -1;
        }
    }
    r->n_prompts = (int)n;
    return 0;
}

/* prompt: "text" | ["text"] | [ids] | [[ids]] | several of those. */
static int api_get_prompt(json_t *root, const api_limits *lim, api_request *r, api_error *e) {
    json_t *v = json_object_get(root, "prompt");
    if (!v || json_is_null(v)) return api_error_bad(e, "prompt", "missing_required_parameter",
                                              "Missing required parameter: 'prompt'.");
    r->n_prompts = 1;
    if (json_is_array(v) && json_array_size(v) > 0 &&
        (json_is_string(json_array_get(v, 0)) || json_is_array(json_array_get(v, 0)))) {
        if (json_array_size(v) > 1) return api_check_prompts(v, lim, r, e);
        v = json_array_get(v, 0);
    }
    return api_get_one_prompt(v, lim, r, e);
}

/* content: "text" | [{"type":"text","text":"..."}...] | null (assistant turns). */
static int api_get_content(json_t *c, size_t idx, char **out, api_error *e) {
    char param[48];
    snprintf(param, sizeof param, "messages[%zu].content", idx);
    if (!c || json_is_null(c)) { *out = strdup(""); return *out ? 0 : api_error_bad(e, param, NULL, "out of memory"); }
    if (json_is_string(c)) { *out = strdup(json_string_value(c)); return *out ? 0 : api_error_bad(e, param, NULL, "out of memory"); }
    if (!json_is_array(c)) return api_wrong_type(e, param, "a string or an array of content parts", c);
    size_t total = 0;
    for (size_t i = 0; i < json_array_size(c); i++) {
        json_t *p = json_array_get(c, i);
        json_t *ty = json_object_get(p, "type"), *tx = json_object_get(p, "text");
        if (!json_is_object(p) || !json_is_string(ty))
            return api_error_bad(e, param, "invalid_type", "Each content part of %s must be an object with a 'type'.", param);
        if (strcmp(json_string_value(ty), "text") != 0)
            return api_error_bad(e, param, "invalid_value", "Content part type '%s' is not supported (only 'text').",
                           json_string_value(ty));
        if (!json_is_string(tx)) return api_wrong_type(e, param, "a text part with a string 'text'", tx ? tx : json_null());
        total += json_string_length(tx);
    }
    char *s = malloc(total + 1);
    if (!s) return api_error_bad(e, param, NULL, "out of memory");
    size_t off = 0;
    for (size_t i = 0; i < json_array_size(c); i++) {
        json_t *tx = json_object_get(json_array_get(c, i), "text");
        size_t n = json_string_length(tx);
        memcpy(s + off, json_string_value(tx), n);
        off += n;
    }
    s[off] = 0;
    *out = s;
    return 0;
}

/* An assistant turn's tool_calls, normalized to [{"id", "type", "function":
 * {"name", "arguments"}}] JSON text. */
static int api_get_tool_calls(json_t *tc, size_t idx, api_msg *am, size_t *bytes, api_error *e) {
    char param[64];
    snprintf(param, sizeof param, "messages[%zu].tool_calls", idx);
    if (!tc || json_is_null(tc)) return 0;
    if (!json_is_array(tc)) return api_wrong_type(e, param, "an array", tc);
    if (json_array_size(tc) == 0) return 0;
    if (strcmp(am->role, "assistant"))
        return api_error_bad(e, param, "invalid_value", "Only assistant messages carry 'tool_calls'.");
    json_t *out = json_array();
    for (size_t k = 0; out && k < json_array_size(tc); k++) {
        json_t *c = json_array_get(tc, k), *fn = json_object_get(c, "function"), *id = json_object_get(c, "id");
        json_t *ty = json_object_get(c, "type"), *name = json_object_get(fn, "name"), *args = json_object_get(fn, "arguments");
        if (!json_is_object(c) || !json_is_string(id) || !json_is_object(fn) || !json_is_string(name) ||
            !json_is_string(args) || (ty && !json_is_null(ty) && strcmp(json_string_value(ty) ? json_string_value(ty) : "", "function"))) {
            json_decref(out);
            return api_error_bad(e, param, "invalid_value",
                           "Each tool call in %s needs a string 'id', type 'function' and 'function' with string 'name' and 'arguments'.", param);
        }
        *bytes += json_string_length(name) + json_string_length(args);
        json_array_append_new(out, json_pack("{s:O, s:s, s:{s:O, s:O}}", "id", id, "type", "function",
                                             "function", "name", name, "arguments", args));
    }
    am->tool_calls = out ? json_dumps(out, JSON_COMPACT) : NULL;
    json_decref(out);
    return am->tool_calls ? 0 : api_error_bad(e, param, NULL, "out of memory");
}

/* The fields of one message beyond role and content. */
static int api_get_message_extras(json_t *m, size_t i, api_msg *am, size_t *bytes, api_error *e) {
    char param[64];
    json_t *name = json_object_get(m, "name");
    snprintf(param, sizeof param, "messages[%zu].name", i);
    /* The templates render no participant names: refuse rather than drop one
     * (a tool result's function name is not rendered by OpenAI either). */
    if (name && !json_is_null(name) && strcmp(am->role, "tool"))
        return api_error_bad(e, param, "unsupported_parameter", "Message 'name' is not supported by this server.");
    if (api_get_tool_calls(json_object_get(m, "tool_calls"), i, am, bytes, e)) return -1;
    json_t *id = json_object_get(m, "tool_call_id");
    snprintf(param, sizeof param, "messages[%zu].tool_call_id", i);
    if (!strcmp(am->role, "tool")) {
        if (!json_is_string(id)) return api_error_bad(e, param, "missing_required_parameter",
                                                "Tool messages need a string 'tool_call_id'.");
        if (!(am->tool_call_id = strdup(json_string_value(id)))) return api_error_bad(e, param, NULL, "out of memory");
    }
    return 0;
}

static int api_get_messages(json_t *root, const api_limits *lim, api_request *r, api_error *e) {
    static const char *const roles[] = {"system", "developer", "user", "assistant", "tool"};
    json_t *v = json_object_get(root, "messages");
    if (!v || json_is_null(v)) return api_error_bad(e, "messages", "missing_required_parameter",
                                              "Missing required parameter: 'messages'.");
    if (!json_is_array(v)) return api_wrong_type(e, "messages", "an array", v);
    size_t n = json_array_size(v);
    if (n == 0) return api_error_bad(e, "messages", "empty_array", "'messages' must contain at least one message.");
    if ((int)n > lim->max_messages)
        return api_error_bad(e, "messages", "invalid_value", "Too many messages: %zu (at most %d).", n, lim->max_messages);
    r->messages = calloc(n, sizeof *r->messages);
    if (!r->messages) return api_error_bad(e, "messages", NULL, "out of memory");
    for (size_t i = 0; i < n; i++) {
        json_t *m = json_array_get(v, i);
        char param[48];
        snprintf(param, sizeof param, "messages[%zu]", i);
        if (!json_is_object(m)) return api_wrong_type(e, param, "an object", m);
        json_t *role = json_object_get(m, "role");
        snprintf(param, sizeof param, "messages[%zu].role", i);
        if (!json_is_string(role)) return api_wrong_type(e, param, "a string", role ? role : json_null());
        const char *rs = json_string_value(role);
        int ok = 0;
        for (size_t k = 0; k < sizeof roles / sizeof roles[0]; k++) ok |= !strcmp(rs, roles[k]);
        if (!ok) return api_error_bad(e, param, "invalid_value",
                                "Invalid value for %s: '%.40s'. Supported: system, developer, user, assistant, tool.", param, rs);
        api_msg *am = &r->messages[r->n_messages];
        /* "developer" is OpenAI's newer name for the system role. */
        am->role = strdup(strcmp(rs, "developer") ? rs : "system");
        r->n_messages++;
        if (!am->role) return api_error_bad(e, param, NULL, "out of memory");
        if (api_get_content(json_object_get(m, "content"), i, &am->content, e)) return -1;
        r->prompt_bytes += strlen(am->content);
        if (api_get_message_extras(m, i, am, &r->prompt_bytes, e)) return -1;
        if (r->prompt_bytes > lim->max_prompt_bytes)
            return api_error_bad(e, "messages", "context_length_exceeded",
                           "The messages total more than %zu bytes; reduce the length of the messages.",
                           lim->max_prompt_bytes);
    }
    return 0;
}

/* ==== Tools ==== */

/* OpenAI's rule for function names. */
static int api_valid_function_name(const char *s, size_t n) {
    if (n == 0 || n > 64) return 0;
    for (size_t i = 0; i < n; i++) {
        char c = s[i];
        if (!((c >= 'a' && c <= 'z') || (c >= 'A' && c <= 'Z') || (c >= '0' && c <= '9') || c == '_' || c == '-')) return 0;
    }
    return 1;
}

static int api_check_tool(json_t *t, size_t i, api_error *e) {
    char param[48];
    snprintf(param, sizeof param, "tools[%zu]", i);
    json_t *ty = json_object_get(t, "type"), *fn = json_object_get(t, "function");
    if (!json_is_object(t)) return api_wrong_type(e, param, "an object", t);
    if (!json_is_string(ty) || strcmp(json_string_value(ty), "function"))
        return api_error_bad(e, param, "invalid_value", "Only tools of type 'function' are supported (%s).", param);
    json_t *name = json_object_get(fn, "name"), *desc = json_object_get(fn, "description");
    json_t *params = json_object_get(fn, "parameters"), *strict = json_object_get(fn, "strict");
    if (!json_is_object(fn) || !json_is_string(name) ||
        !api_valid_function_name(json_string_value(name), json_string_length(name)))
        return api_error_bad(e, param, "invalid_value",
                       "%s.function needs a 'name' of 1 to 64 characters a-z, A-Z, 0-9, '_' or '-'.", param);
    if (desc && !json_is_null(desc) && !json_is_string(desc)) return api_wrong_type(e, param, "a string 'description'", desc);
    if (params && !json_is_null(params) && !json_is_object(params))
        return api_wrong_type(e, param, "an object 'parameters' (a JSON Schema)", params);
    if (strict && !json_is_null(strict) && !json_is_boolean(strict)) return api_wrong_type(e, param, "a boolean 'strict'", strict);
    return 0;
}

static json_t *api_find_tool(json_t *tools, const char *name) {
    for (size_t i = 0; i < json_array_size(tools); i++) {
        json_t *fn = json_object_get(json_array_get(tools, i), "function");
        if (!strcmp(json_string_value(json_object_get(fn, "name")), name)) return fn;
    }
    return NULL;
}

/* A forced function's arguments, constrained so that they always parse: its
 * "parameters" schema compiled as a grammar (the decode node compiles it
 * again), or any JSON object when the schema uses what the grammar does not
 * support; with "strict": true that is a 400 naming the keyword instead. */
static int api_get_args_format(json_t *fn, api_request *r, api_error *e) {
    json_t *params = json_object_get(fn, "parameters"), *fmt;
    grammar *g = NULL;
    char gerr[300] = "no parameters schema";
    if (json_is_object(params) && grammar_compile_schema(&g, params, gerr, sizeof gerr) == 0) {
        fmt = json_pack("{s:s, s:{s:s, s:O}}", "type", "json_schema", "json_schema", "name", "arguments", "schema", params);
    } else {
        if (json_is_true(json_object_get(fn, "strict")))
            return api_error_bad(e, "tools", "invalid_value", "Function '%.64s' is strict but its parameters cannot be enforced: %s.",
                           r->tool_name, gerr);
        fmt = json_pack("{s:s}", "type", "json_object");
    }
    grammar_free(g);
    r->tool_args_format = fmt ? json_dumps(fmt, JSON_COMPACT) : NULL;
    json_decref(fmt);
    return r->tool_args_format ? 0 : api_error_bad(e, "tools", NULL, "out of memory");
}

/* tool_choice: "none" | "auto" | "required" | {"type":"function","function":{"name"}}. */
static int api_get_tool_choice(json_t *root, json_t *tools, api_request *r, api_error *e) {
    json_t *v = json_object_get(root, "tool_choice");
    r->tool_choice = tools ? API_TOOLS_AUTO : API_TOOLS_NONE;
    if (!v || json_is_null(v)) return 0;
    const char *name = NULL;
    if (json_is_string(v)) {
        const char *s = json_string_value(v);
        if (!strcmp(s, "none")) { r->tool_choice = API_TOOLS_NONE; return 0; }
        if (!strcmp(s, "auto")) return 0;
        if (strcmp(s, "required"))
            return api_error_bad(e, "tool_choice", "invalid_value", "'tool_choice' must be \"none\", \"auto\", \"required\" or a function.");
        r->tool_choice = API_TOOLS_REQUIRED;
    } else if (json_is_object(v)) {
        json_t *fn = json_object_get(v, "function");
        name = json_string_value(json_object_get(fn, "name"));
        if (!json_is_string(json_object_get(v, "type")) || strcmp(json_string_value(json_object_get(v, "type")), "function") || !name)
            return api_error_bad(e, "tool_choice", "invalid_value",
                           "A named 'tool_choice' is {\"type\": \"function\", \"function\": {\"name\": ...}}.");
        r->tool_choice = API_TOOLS_NAMED;
    } else {
        return api_wrong_type(e, "tool_choice", "a string or an object", v);
    }
    if (!tools) return api_error_bad(e, "tool_choice", "invalid_value", "'tool_choice' needs 'tools'.");
    /* "required" with a single tool is that tool, named */
    if (!name && json_array_size(tools) == 1)
        name = json_string_value(json_object_get(json_object_get(json_array_get(tools, 0), "function"), "name"));
    if (!name) return 0;
    json_t *fn = api_find_tool(tools, name);
    if (!fn) return api_error_bad(e, "tool_choice", "invalid_value", "'tool_choice' names '%.64s', which is not in 'tools'.", name);
    r->tool_name = strdup(name);
    r->tool_args_fixed = tools_args_fixed_empty(json_object_get(fn, "parameters"));
    if (!r->tool_name) return api_error_bad(e, "tool_choice", NULL, "out of memory");
    return r->tool_args_fixed ? 0 : api_get_args_format(fn, r, e);
}

static int api_get_tools(json_t *root, const api_limits *lim, api_request *r, api_error *e) {
    json_t *v = json_object_get(root, "tools");
    r->parallel_tool_calls = 1;
    if (api_get_bool(root, "parallel_tool_calls", &r->parallel_tool_calls, e)) return -1;
    if (v && !json_is_null(v) && !json_is_array(v)) return api_wrong_type(e, "tools", "an array", v);
    if (v && json_array_size(v) == 0) v = NULL;
    if (v && json_array_size(v) > 128) return api_error_bad(e, "tools", "invalid_value", "At most 128 tools are supported.");
    for (size_t i = 0; v && i < json_array_size(v); i++) {
        if (api_check_tool(json_array_get(v, i), i, e)) return -1;
        const char *nm = json_string_value(json_object_get(json_object_get(json_array_get(v, i), "function"), "name"));
        for (size_t k = 0; k < i; k++)
            if (!strcmp(nm, json_string_value(json_object_get(json_object_get(json_array_get(v, k), "function"), "name"))))
                return api_error_bad(e, "tools", "invalid_value", "Two tools are named '%s'.", nm);
    }
    if (api_get_tool_choice(root, v, r, e)) return -1;
    if (!v) return 0;
    if (!(r->tools = json_dumps(v, JSON_COMPACT))) return api_error_bad(e, "tools", NULL, "out of memory");
    r->n_tools = (int)json_array_size(v);
    r->prompt_bytes += strlen(r->tools);
    if (r->prompt_bytes > lim->max_prompt_bytes)
        return api_error_bad(e, "tools", "context_length_exceeded",
                       "The messages and tools total more than %zu bytes.", lim->max_prompt_bytes);
    return 0;
}

int api_tools_active(const api_request *r) { return r->tools && r->tool_choice != API_TOOLS_NONE; }

/* ==== Request ==== */

/* "n": choices generated from one prompt (computed once, shared by all). */
static int api_get_n(json_t *root, api_request *r, api_error *e) {
    json_t *n = json_object_get(root, "n");
    r->n = 1;
    if (!n || json_is_null(n)) return 0;
    if (!json_is_integer(n)) return api_wrong_type(e, "n", "an integer", n);
    json_int_t v = json_integer_value(n);
    if (v < 1 || v > API_MAX_N)
        return api_error_bad(e, "n", "invalid_value", "'n' must be between 1 and %d (got %lld).", API_MAX_N, (long long)v);
    r->n = (int)v;
    return 0;
}

/* Fields we cannot honour are refused rather than silently ignored. */
static int api_check_unsupported(json_t *root, enum api_kind kind, api_error *e) {
    /* the deprecated forms of tools; completions take no tools at all */
    static const char *const refused[] = {"functions", "function_call", "tools", "tool_choice", "parallel_tool_calls"};
    size_t n_refused = kind == API_CHAT ? 2 : 5;
    for (size_t i = 0; i < n_refused; i++) {
        json_t *v = json_object_get(root, refused[i]);
        if (v && !json_is_null(v) && !(json_is_array(v) && json_array_size(v) == 0))
            return api_error_bad(e, refused[i], "unsupported_parameter", "'%s' is not supported by this server.", refused[i]);
    }
    /* Fields that change the output and that this server does not apply yet. */
    static const char *const unapplied[] = {"prediction", "modalities", "audio", "suffix"};
    for (size_t i = 0; i < sizeof unapplied / sizeof unapplied[0]; i++) {
        json_t *v = json_object_get(root, unapplied[i]);
        if (v && !json_is_null(v))
            return api_error_bad(e, unapplied[i], "unsupported_parameter", "'%s' is not supported by this server.", unapplied[i]);
    }
    json_t *bo = json_object_get(root, "best_of");
    if (kind == API_COMPLETION && bo && !json_is_null(bo) && !(json_is_integer(bo) && json_integer_value(bo) == 1))
        return api_error_bad(e, "best_of", "unsupported_parameter", "Only best_of=1 is supported.");
    return 0;
}

/* Fields the decode node applies itself: their shape is checked here, their
 * values travel to the node (which refuses a bad schema or token id with a
 * 400 the router passes on). */
static int api_get_sampling(json_t *root, api_request *r, api_error *e) {
    static const struct { const char *name; double lo, hi; } nums[] = {
        {"presence_penalty", -2, 2}, {"frequency_penalty", -2, 2}, {"repetition_penalty", 0.01, 100},
        {"min_p", 0, 1},
    };
    json_t *o = json_object();
    double d;
    for (size_t i = 0; i < sizeof nums / sizeof nums[0]; i++) {
        json_t *v = json_object_get(root, nums[i].name);
        if (!v || json_is_null(v)) continue;
        if (api_get_number(root, nums[i].name, nums[i].lo, nums[i].hi, &d, e)) { json_decref(o); return -1; }
        json_object_set_new(o, nums[i].name, json_real(d));
    }
    json_t *tk = json_object_get(root, "top_k");
    if (tk && !json_is_null(tk)) {
        if (!json_is_integer(tk) || json_integer_value(tk) < 0 || json_integer_value(tk) > 1000000) {
            json_decref(o);
            return api_error_bad(e, "top_k", "invalid_value", "'top_k' must be an integer in [0, 1000000].");
        }
        json_object_set(o, "top_k", tk);
    }
    json_t *lb = json_object_get(root, "logit_bias");
    if (lb && !json_is_null(lb)) {
        if (!json_is_object(lb)) { json_decref(o); return api_wrong_type(e, "logit_bias", "an object", lb); }
        json_object_set(o, "logit_bias", lb);
    }
    json_t *rf = json_object_get(root, "response_format");
    if (rf && !json_is_null(rf)) {
        const char *t = json_string_value(json_object_get(rf, "type"));
        if (!json_is_object(rf) || !t || (strcmp(t, "text") && strcmp(t, "json_object") && strcmp(t, "json_schema"))) {
            json_decref(o);
            return api_error_bad(e, "response_format", "invalid_value",
                           "'response_format' must be {\"type\": \"text\" | \"json_object\" | \"json_schema\", ...}.");
        }
        if (!strcmp(t, "json_schema") && !json_is_object(json_object_get(json_object_get(rf, "json_schema"), "schema"))) {
            json_decref(o);
            return api_error_bad(e, "response_format", "invalid_value",
                           "'response_format.json_schema.schema' must be a JSON schema object.");
        }
        json_object_set(o, "response_format", rf);
    }
    if (api_ext_sampling(root, o, e)) { json_decref(o); return -1; }   /* grammar, guided_*, min_tokens, ... */
    if (json_object_size(o)) r->sampling = json_dumps(o, JSON_COMPACT);
    json_decref(o);
    if (json_object_size(json_object_get(root, "logit_bias")) && !r->sampling) return api_error_bad(e, NULL, NULL, "out of memory");
    return 0;
}

/* Chat: "logprobs": bool with "top_logprobs": 0..20; completions: "logprobs":
 * 0..5 (OpenAI's limits). */
static int api_get_logprobs(json_t *root, enum api_kind kind, api_request *r, api_error *e) {
    json_t *lp = json_object_get(root, "logprobs"), *top = json_object_get(root, "top_logprobs");
    if (kind == API_CHAT) {
        if (lp && !json_is_null(lp) && !json_is_boolean(lp)) return api_wrong_type(e, "logprobs", "a boolean", lp);
        int on = json_is_true(lp);
        if (top && !json_is_null(top)) {
            if (!json_is_integer(top) || json_integer_value(top) < 0 || json_integer_value(top) > 20)
                return api_error_bad(e, "top_logprobs", "invalid_value", "'top_logprobs' must be an integer in [0, 20].");
            if (!on) return api_error_bad(e, "top_logprobs", "invalid_value", "'top_logprobs' needs 'logprobs': true.");
        }
        r->logprobs = on ? 1 + (int)(json_is_integer(top) ? json_integer_value(top) : 0) : 0;
        return 0;
    }
    if (top && !json_is_null(top)) return api_error_bad(e, "top_logprobs", "unsupported_parameter", "'top_logprobs' is a chat field; completions take 'logprobs': N.");
    if (!lp || json_is_null(lp)) return 0;
    if (!json_is_integer(lp) || json_integer_value(lp) < 0 || json_integer_value(lp) > 5)
        return api_error_bad(e, "logprobs", "invalid_value", "'logprobs' must be an integer in [0, 5].");
    r->logprobs = 1 + (int)json_integer_value(lp);
    return 0;
}

static int api_parse_fields(json_t *root, enum api_kind kind, const api_limits *lim, api_request *r, api_error *e) {
    json_t *model = json_object_get(root, "model");
    if (!model || json_is_null(model))
        return api_error_bad(e, "model", "missing_required_parameter", "Missing required parameter: 'model'.");
    if (!json_is_string(model)) return api_wrong_type(e, "model", "a string", model);
    if (json_string_length(model) == 0 || json_string_length(model) > 256)
        return api_error_bad(e, "model", "invalid_value", "'model' must be a non-empty string of at most 256 bytes.");
    if (!(r->model = strdup(json_string_value(model)))) return api_error_bad(e, "model", NULL, "out of memory");
    if (api_ext_check_fields(root, kind, lim->lenient, e)) return -1;
    if (kind == API_CHAT ? api_get_messages(root, lim, r, e) : api_get_prompt(root, lim, r, e)) return -1;
    if (api_check_unsupported(root, kind, e)) return -1;
    if (kind == API_CHAT && api_get_tools(root, lim, r, e)) return -1;
    if (api_get_max_tokens(root, lim, r, e)) return -1;
    if (api_get_number(root, "temperature", 0, 2, &r->temperature, e)) return -1;
    if (api_get_number(root, "top_p", 0, 1, &r->top_p, e)) return -1;
    if (api_get_sampling(root, r, e)) return -1;
    if (api_get_logprobs(root, kind, r, e)) return -1;
    json_t *seed = json_object_get(root, "seed");
    if (seed && !json_is_null(seed)) {
        if (!json_is_integer(seed)) return api_wrong_type(e, "seed", "an integer", seed);
        r->has_seed = 1;
        r->seed = (int64_t)json_integer_value(seed);
    }
    if (api_get_stop(root, lim, r, e)) return -1;
    if (api_get_n(root, r, e)) return -1;
    if (r->n_prompts > 1 && r->n_prompts * r->n > API_MAX_CHOICES)
        return api_error_bad(e, "n", "invalid_value", "%d prompts with 'n' %d make %d choices; this server returns at most %d "
                       "per request.", r->n_prompts, r->n, r->n_prompts * r->n, API_MAX_CHOICES);
    if (api_get_bool(root, "stream", &r->stream, e)) return -1;
    if (kind == API_COMPLETION && api_get_bool(root, "echo", &r->echo, e)) return -1;
    if (api_get_bool(root, "ignore_eos", &r->ignore_eos, e)) return -1;
    if (r->echo && (r->n_prompts > 1 ? r->prompts_have_ids : !r->prompt))
        return api_error_bad(e, "echo", "invalid_value", "'echo' needs a text prompt.");
    json_t *so = json_object_get(root, "stream_options");
    if (so && !json_is_null(so)) {
        if (!json_is_object(so)) return api_wrong_type(e, "stream_options", "an object", so);
        if (!r->stream)
            return api_error_bad(e, "stream_options", "invalid_value", "'stream_options' is only allowed when 'stream' is true.");
        if (api_get_bool(so, "include_usage", &r->include_usage, e)) return -1;
    }
    return 0;
}

int api_parse_request(enum api_kind kind, const char *body, size_t len, const api_limits *lim,
                      api_request *r, api_error *e) {
    memset(r, 0, sizeof *r);
    r->kind = kind;
    r->temperature = 1.0;
    r->top_p = 1.0;
    json_error_t je;
    json_t *root = json_loadb(body, len, JSON_REJECT_DUPLICATES, &je);
    if (!root)
        return api_error_bad(e, NULL, "invalid_json",
                       "We could not parse the JSON body of your request: %s (line %d, column %d).",
                       je.text, je.line, je.column);
    int rc = 0;
    if (!json_is_object(root)) rc = api_error_bad(e, NULL, "invalid_json", "The request body must be a JSON object.");
    else rc = api_parse_fields(root, kind, lim, r, e);
    json_decref(root);
    if (rc) api_request_free(r);
    return rc;
}

int api_parse_prompt_children(enum api_kind kind, const char *body, size_t len, const api_limits *lim, int n,
                              api_request *out, api_error *e) {
    json_t *root = json_loadb(body, len, JSON_REJECT_DUPLICATES, NULL);
    json_t *prompts = json_incref(json_object_get(root, "prompt"));   /* kept while "prompt" is replaced */
    int k = 0;
    for (; k < n; k++) {
        json_t *one = json_array_get(prompts, (size_t)k);
        char *text = one && json_object_set(root, "prompt", one) == 0 ? json_dumps(root, JSON_COMPACT) : NULL;
        if (!text) {
            api_error_set(e, 500, "server_error", NULL, NULL, "prompt %d of the request could not be taken apart", k);
            break;
        }
        int rc = api_parse_request(kind, text, strlen(text), lim, &out[k], e);
        free(text);
        if (rc) {
            if (!strcmp(e->param, "prompt")) snprintf(e->param, sizeof e->param, "prompt[%d]", k);
            break;
        }
    }
    json_decref(prompts);
    json_decref(root);
    if (k == n) return 0;
    while (k > 0) api_request_free(&out[--k]);
    return -1;
}

void api_request_free(api_request *r) {
    free(r->model);
    free(r->sampling);
    free(r->prompt);
    free(r->tokens);
    for (int i = 0; i < r->n_messages; i++) {
        free(r->messages[i].role);
        free(r->messages[i].content);
        free(r->messages[i].tool_calls);
        free(r->messages[i].tool_call_id);
    }
    free(r->tools);
    free(r->tool_name);
    free(r->tool_args_format);
    free(r->assistant_prefix);
    free(r->messages);
    for (int i = 0; i < r->n_stop; i++) free(r->stop[i]);
    free(r->stop);
    memset(r, 0, sizeof *r);
}

/* http_api_render.c - OpenAI responses rendered (see http_api.h): a
 * completion or chat completion object, SSE chunks and the usage chunk,
 * logprobs, merged n > 1 choices, errors as events, /v1/models, and tool
 * calls as deltas and as the final message. Every object carries
 * system_fingerprint. Pure functions over jansson.
 */
#include "api/http_api_internal.h"
#include "api/tools.h"
#include "base/version.h"

#include <jansson.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

/* ==== Dumping ==== */

char *api_dump(json_t *o) {
    if (!o) return NULL;
    char *s = json_dumps(o, JSON_COMPACT);
    json_decref(o);
    return s;
}

/* "system_fingerprint": the server build that answered (OpenAI's field,
 * which changes when the backend configuration does). */
#define API_FINGERPRINT "fp_tandem_" TANDEM_VERSION

/* o with "system_fingerprint" added (a response or chunk object), dumped. */
static char *api_dump_fp(json_t *o) {
    if (o) json_object_set_new(o, "system_fingerprint", json_string(API_FINGERPRINT));
    return api_dump(o);
}

/* ==== OpenAI responses ==== */

static json_t *api_usage(int p, int c, int cached) {
    return json_pack("{s:i, s:i, s:i, s:{s:i}}", "prompt_tokens", p, "completion_tokens", c, "total_tokens", p + c,
                     "prompt_tokens_details", "cached_tokens", cached);
}

static json_t *api_str_or_null(const char *s) { return s ? json_string(s) : json_null(); }

/* jansson refuses invalid UTF-8; a token text that is not valid is sent
 * with the bad bytes replaced, never dropped silently as a null. */
static json_t *api_text(const char *s) {
    if (!s) s = "";
    json_t *v = json_string(s);
    if (v) return v;
    size_t n = strlen(s);
    char *c = malloc(n + 1);
    if (!c) return json_string("");
    for (size_t i = 0; i < n; i++) c[i] = (unsigned char)s[i] < 128 ? s[i] : '?';
    c[n] = 0;
    v = json_string(c);
    free(c);
    return v ? v : json_string("");
}

/* The choice's "logprobs": the meta's JSON, or null. */
static json_t *api_lp(const api_resp_meta *m) {
    json_t *o = m->logprobs ? json_loads(m->logprobs, 0, NULL) : NULL;
    return o ? o : json_null();
}

/* UTF-8 bytes of a string as a JSON array of integers (OpenAI's "bytes"). */
static json_t *api_bytes(const char *s) {
    json_t *a = json_array();
    for (const unsigned char *p = (const unsigned char *)(s ? s : ""); *p; p++) json_array_append_new(a, json_integer(*p));
    return a;
}

char *api_render_logprobs(enum api_kind kind, char *const *entries, int n, size_t text_offset0) {
    json_t *content = json_array(), *tokens = json_array(), *tlp = json_array(), *tops = json_array(), *offs = json_array();
    size_t off = text_offset0;
    for (int i = 0; i < n; i++) {
        json_t *e = entries[i] ? json_loads(entries[i], 0, NULL) : NULL;
        const char *tok = json_string_value(json_object_get(e, "token_text"));
        double lp = json_number_value(json_object_get(e, "logprob"));
        json_t *top = json_object_get(e, "top_logprobs"), *ctop = json_array(), *mtop = json_object();
        for (size_t k = 0; k < json_array_size(top); k++) {
            json_t *t = json_array_get(top, k);
            const char *tt = json_string_value(json_object_get(t, "text"));
            json_t *tv = json_object_get(t, "logprob");
            json_array_append_new(ctop, json_pack("{s:s, s:O, s:o}", "token", tt ? tt : "", "logprob", tv, "bytes", api_bytes(tt)));
            json_object_set(mtop, tt ? tt : "", tv);
        }
        json_array_append_new(content, json_pack("{s:s, s:f, s:o, s:o}", "token", tok ? tok : "", "logprob", lp,
                                                 "bytes", api_bytes(tok), "top_logprobs", ctop));
        json_array_append_new(tokens, json_string(tok ? tok : ""));
        json_array_append_new(tlp, json_real(lp));
        json_array_append_new(tops, mtop);
        json_array_append_new(offs, json_integer((json_int_t)off));
        off += tok ? strlen(tok) : 0;
        json_decref(e);
    }
    json_t *o;
    if (kind == API_CHAT) {
        o = json_pack("{s:o}", "content", content);
        json_decref(tokens); json_decref(tlp); json_decref(tops); json_decref(offs);
    } else {
        o = json_pack("{s:o, s:o, s:o, s:o}", "tokens", tokens, "token_logprobs", tlp, "top_logprobs", tops,
                      "text_offset", offs);
        json_decref(content);
    }
    return api_dump(o);
}

char *api_render_response(enum api_kind kind, const api_resp_meta *m, const char *text,
                          const char *finish_reason, int prompt_tokens, int completion_tokens) {
    json_t *choice;
    if (kind == API_CHAT)
        choice = json_pack("{s:i, s:{s:s, s:o}, s:o, s:o}", "index", m->index, "message", "role", "assistant",
                           "content", api_text(text), "logprobs", api_lp(m), "finish_reason", api_str_or_null(finish_reason));
    else
        choice = json_pack("{s:o, s:i, s:o, s:o}", "text", api_text(text), "index", m->index, "logprobs", api_lp(m),
                           "finish_reason", api_str_or_null(finish_reason));
    if (!choice) return NULL;
    return api_dump_fp(json_pack("{s:s, s:s, s:I, s:s, s:[o], s:o}", "id", m->id,
                              "object", kind == API_CHAT ? "chat.completion" : "text_completion",
                              "created", (json_int_t)m->created, "model", m->model, "choices", choice,
                              "usage", api_usage(prompt_tokens, completion_tokens, m->cached_tokens)));
}

char *api_merge_responses(char *const *bodies, int n, int prompt_tokens, int completion_tokens) {
    json_t *out = n > 0 && bodies[0] ? json_loads(bodies[0], 0, NULL) : NULL;
    json_t *choices = json_object_get(out, "choices");
    if (!json_is_array(choices)) { json_decref(out); return NULL; }
    for (int i = 1; i < n; i++) {
        json_t *o = bodies[i] ? json_loads(bodies[i], 0, NULL) : NULL;
        json_t *c = json_array_get(json_object_get(o, "choices"), 0);
        if (!c || json_array_append(choices, c)) { json_decref(o); json_decref(out); return NULL; }
        json_decref(o);
    }
    int cached = 0;
    for (int i = 0; i < n; i++) {
        json_t *o = bodies[i] ? json_loads(bodies[i], 0, NULL) : NULL;
        json_t *c = json_object_get(json_object_get(json_object_get(o, "usage"), "prompt_tokens_details"), "cached_tokens");
        if (json_is_integer(c) && json_integer_value(c) > 0 && json_integer_value(c) <= INT32_MAX - cached)
            cached += (int)json_integer_value(c);
        json_decref(o);
    }
    json_object_set_new(out, "usage", api_usage(prompt_tokens, completion_tokens, cached));
    return api_dump(out);
}

/* "data: <json>\n\n" from a malloc'd JSON text, which it frees. */
static char *api_sse_text(char *j) {
    if (!j) return NULL;
    size_t n = strlen(j);
    char *s = malloc(n + 9);
    if (s) { memcpy(s, "data: ", 6); memcpy(s + 6, j, n); memcpy(s + 6 + n, "\n\n", 3); }
    free(j);
    return s;
}

static char *api_sse(json_t *o) { return api_sse_text(api_dump_fp(o)); }

char *api_render_chunk(enum api_kind kind, const api_resp_meta *m, const char *text,
                       const char *finish_reason, int first) {
    json_t *choice;
    if (kind == API_CHAT) {
        json_t *delta = json_object();
        if (first) json_object_set_new(delta, "role", json_string("assistant"));
        if (text || first) json_object_set_new(delta, "content", api_text(text));
        choice = json_pack("{s:i, s:o, s:o, s:o}", "index", m->index, "delta", delta, "logprobs", api_lp(m),
                           "finish_reason", api_str_or_null(finish_reason));
    } else {
        choice = json_pack("{s:o, s:i, s:o, s:o}", "text", api_text(text), "index", m->index, "logprobs", api_lp(m),
                           "finish_reason", api_str_or_null(finish_reason));
    }
    if (!choice) return NULL;
    return api_sse(json_pack("{s:s, s:s, s:I, s:s, s:[o]}", "id", m->id,
                             "object", kind == API_CHAT ? "chat.completion.chunk" : "text_completion",
                             "created", (json_int_t)m->created, "model", m->model, "choices", choice));
}

char *api_render_usage_chunk(enum api_kind kind, const api_resp_meta *m, int prompt_tokens,
                             int completion_tokens) {
    return api_sse(json_pack("{s:s, s:s, s:I, s:s, s:[], s:o}", "id", m->id,
                             "object", kind == API_CHAT ? "chat.completion.chunk" : "text_completion",
                             "created", (json_int_t)m->created, "model", m->model, "choices",
                             "usage", api_usage(prompt_tokens, completion_tokens, m->cached_tokens)));
}

char *api_render_error_event(const api_error *e) { return api_sse_text(api_error_json(e)); }

char *api_render_models(const char *const *ids, int n, long long created) {
    json_t *arr = json_array();
    for (int i = 0; i < n; i++)
        json_array_append_new(arr, json_pack("{s:s, s:s, s:I, s:s}", "id", ids[i], "object", "model",
                                             "created", (json_int_t)created, "owned_by", "tandem"));
    return api_dump(json_pack("{s:s, s:o}", "object", "list", "data", arr));
}

char *api_render_model(const char *id, long long created) {
    return api_dump(json_pack("{s:s, s:s, s:I, s:s}", "id", id, "object", "model", "created", (json_int_t)created,
                              "owned_by", "tandem"));
}

/* ==== Tool calls in responses ==== */

static json_t *api_call_id(const api_resp_meta *m, int index) {
    const char *dash = strchr(m->id, '-');
    char id[96];
    /* choices past the first have calls of their own: ids stay unique */
    if (m->index > 0) snprintf(id, sizeof id, "call_%s_%d_%d", dash ? dash + 1 : m->id, m->index, index);
    else snprintf(id, sizeof id, "call_%s_%d", dash ? dash + 1 : m->id, index);
    return json_string(id);
}

static char *api_tool_chunk(const api_resp_meta *m, json_t *delta) {
    json_t *choice = json_pack("{s:i, s:o, s:n, s:n}", "index", m->index, "delta", delta, "logprobs", "finish_reason");
    if (!choice) return NULL;
    return api_sse(json_pack("{s:s, s:s, s:I, s:s, s:[o]}", "id", m->id, "object", "chat.completion.chunk",
                             "created", (json_int_t)m->created, "model", m->model, "choices", choice));
}

char *api_concat(char *a, char *b) {
    if (!a || !b) { free(a); free(b); return NULL; }
    size_t na = strlen(a), nb = strlen(b);
    char *s = realloc(a, na + nb + 1);
    if (!s) { free(a); free(b); return NULL; }
    memcpy(s + na, b, nb + 1);
    free(b);
    return s;
}

char *api_render_tool_chunks(const api_resp_meta *m, const struct tool_evs *evs) {
    char *out = strdup("");
    for (int i = 0; out && i < evs->n; i++) {
        const tool_ev *v = &evs->v[i];
        json_t *delta;
        if (v->kind == TOOL_EV_CONTENT) {
            delta = json_pack("{s:o}", "content", api_text(v->text));
        } else if (v->kind == TOOL_EV_CALL) {
            delta = json_pack("{s:[{s:i, s:o, s:s, s:{s:o, s:s}}]}", "tool_calls", "index", v->index,
                              "id", api_call_id(m, v->index), "type", "function", "function",
                              "name", api_text(v->text), "arguments", "");
        } else {
            delta = json_pack("{s:[{s:i, s:{s:o}}]}", "tool_calls", "index", v->index, "function",
                              "arguments", api_text(v->text));
        }
        out = api_concat(out, delta ? api_tool_chunk(m, delta) : NULL);
    }
    return out;
}

/* Concatenated content and each call's name and arguments. */
static json_t *api_tool_message(const api_resp_meta *m, const struct tool_evs *evs) {
    size_t clen = 0;
    int calls = 0;
    for (int i = 0; i < evs->n; i++) {
        if (evs->v[i].kind == TOOL_EV_CONTENT) clen += strlen(evs->v[i].text);
        if (evs->v[i].kind == TOOL_EV_CALL) calls++;
    }
    char *content = calloc(1, clen + 1);
    json_t *arr = json_array(), *msg = json_object();
    if (!content || !arr || !msg) { free(content); json_decref(arr); json_decref(msg); return NULL; }
    json_t *cur = NULL;
    for (int i = 0; i < evs->n; i++) {
        const tool_ev *v = &evs->v[i];
        if (v->kind == TOOL_EV_CONTENT) strcat(content, v->text);
        if (v->kind == TOOL_EV_CALL) {
            cur = json_pack("{s:o, s:s, s:{s:o, s:s}}", "id", api_call_id(m, v->index), "type", "function",
                            "function", "name", api_text(v->text), "arguments", "");
            json_array_append_new(arr, cur);
        }
        if (v->kind == TOOL_EV_ARGS && cur) {
            json_t *fn = json_object_get(cur, "function");
            const char *old = json_string_value(json_object_get(fn, "arguments"));
            size_t n = strlen(old) + strlen(v->text);
            char *a = malloc(n + 1);
            if (a) { strcpy(a, old); strcat(a, v->text); json_object_set_new(fn, "arguments", api_text(a)); }
            free(a);
        }
    }
    json_object_set_new(msg, "role", json_string("assistant"));
    json_object_set_new(msg, "content", calls && !content[0] ? json_null() : api_text(content));
    if (calls) json_object_set_new(msg, "tool_calls", arr);
    else json_decref(arr);
    free(content);
    return msg;
}

char *api_render_tool_response(const api_resp_meta *m, const struct tool_evs *evs, const char *finish_reason,
                               int prompt_tokens, int completion_tokens) {
    json_t *msg = api_tool_message(m, evs);
    if (!msg) return NULL;
    json_t *choice = json_pack("{s:i, s:o, s:n, s:o}", "index", m->index, "message", msg, "logprobs",
                               "finish_reason", api_str_or_null(finish_reason));
    if (!choice) return NULL;
    return api_dump_fp(json_pack("{s:s, s:s, s:I, s:s, s:[o], s:o}", "id", m->id, "object", "chat.completion",
                              "created", (json_int_t)m->created, "model", m->model, "choices", choice,
                              "usage", api_usage(prompt_tokens, completion_tokens, m->cached_tokens)));
}

/* http_api_upstream.c - the router's side of the decode node's protocol
 * (see http_api.h): a parsed OpenAI request as the body POSTed to a decode
 * node's /v1/generate (prompt or messages, sampling, constraints, the
 * prefill plan), and the NDJSON lines it answers (text, tokens, logprobs,
 * the prefill report, errors) read back. Pure functions over jansson.
 */
#include "api/http_api_internal.h"

#include <jansson.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

/* ==== Decode node protocol ==== */

static json_t *api_upstream_prompt(const api_request *r, json_t *o) {
    if (r->kind == API_CHAT) {
        json_object_set_new(o, "chat", json_true());
        /* One user message: the plain "prompt" + "chat" form every decode node takes. */
        if (r->n_messages == 1 && !strcmp(r->messages[0].role, "user") && !api_tools_active(r) && !r->assistant_prefix)
            return json_object_set_new(o, "prompt", json_string(r->messages[0].content)) ? NULL : o;
        json_t *arr = json_array();
        for (int i = 0; i < r->n_messages; i++) {
            const api_msg *m = &r->messages[i];
            json_t *jm = json_pack("{s:s, s:s}", "role", m->role, "content", m->content);
            if (m->tool_calls) json_object_set_new(jm, "tool_calls", json_loads(m->tool_calls, 0, NULL));
            if (m->tool_call_id) json_object_set_new(jm, "tool_call_id", json_string(m->tool_call_id));
            json_array_append_new(arr, jm);
        }
        if (api_tools_active(r)) json_object_set_new(o, "tools", json_loads(r->tools, 0, NULL));
        if (r->assistant_prefix) json_object_set_new(o, "assistant_prefix", json_string(r->assistant_prefix));
        return json_object_set_new(o, "messages", arr) ? NULL : o;
    }
    if (r->prompt) return json_object_set_new(o, "prompt", json_string(r->prompt)) ? NULL : o;
    json_t *arr = json_array();
    for (int i = 0; i < r->n_tokens; i++) json_array_append_new(arr, json_integer(r->tokens[i]));
    return json_object_set_new(o, "tokens", arr) ? NULL : o;
}

char *api_upstream_body(const api_request *r, const char *prefill_mode, const char *prefill_node) {
    json_t *o = json_object();
    if (!o || !api_upstream_prompt(r, o)) { json_decref(o); return NULL; }
    /* a whole forced call in the prefix leaves nothing to generate */
    int max = r->prefix_complete ? 0 : r->max_tokens > 0 ? r->max_tokens : API_MAX_TOKENS_UNTIL_CONTEXT;
    json_object_set_new(o, "max_tokens", json_integer(max));
    /* asked for by the client: the node refuses a prompt plus it beyond the
     * context (context_length_exceeded) instead of stopping at the end */
    if (r->max_tokens_given && !r->prefix_complete) json_object_set_new(o, "max_tokens_strict", json_true());
    json_object_set_new(o, "temperature", json_real(r->temperature));
    json_object_set_new(o, "top_p", json_real(r->top_p));
    /* OpenAI sampling has no top-k or min-p: switch them off on the node. */
    json_object_set_new(o, "top_k", json_integer(0));
    json_object_set_new(o, "min_p", json_real(0.0));
    if (r->sampling) {
        json_t *x = json_loads(r->sampling, 0, NULL);
        if (x) json_object_update(o, x);
        json_decref(x);
    }
    /* a forced call's arguments follow its function's schema (they replace
     * any response_format: the output is the call) */
    if (r->call_suffix && r->tool_args_format)
        json_object_set_new(o, "response_format", json_loads(r->tool_args_format, 0, NULL));
    if (r->logprobs) json_object_set_new(o, "logprobs", json_integer(r->logprobs - 1));
    /* Decode nodes take seeds in [0, 2^63): fold negative OpenAI seeds in. */
    if (r->has_seed) json_object_set_new(o, "seed", json_integer(r->seed < 0 ? (r->seed & INT64_MAX) : r->seed));
    if (r->n_stop || r->call_stop) {
        json_t *arr = json_array();
        for (int i = 0; i < r->n_stop; i++) json_array_append_new(arr, json_string(r->stop[i]));
        if (r->call_stop) json_array_append_new(arr, json_string(r->call_stop));
        json_object_set_new(o, "stop", arr);
    }
    if (r->ignore_eos) json_object_set_new(o, "ignore_eos", json_true());
    if (r->n > 1) json_object_set_new(o, "n", json_integer(r->n));
    json_object_set_new(o, "prefill", json_string(prefill_mode ? prefill_mode : "auto"));
    if (prefill_node && *prefill_node) json_object_set_new(o, "prefill_node", json_string(prefill_node));
    /* The router always streams from the node: it learns the first token's
     * arrival (retry boundary, TTFT) even when the client wants one reply. */
    json_object_set_new(o, "stream", json_true());
    return api_dump(o);
}

static void api_copy_str(json_t *v, char *out, size_t outlen) {
    if (json_is_string(v)) snprintf(out, outlen, "%s", json_string_value(v));
}

static double api_num(json_t *v) { return json_is_number(v) ? json_number_value(v) : 0; }
static int api_int(json_t *v) {
    if (!json_is_integer(v)) return 0;
    json_int_t x = json_integer_value(v);
    return x < 0 ? 0 : x > INT32_MAX ? INT32_MAX : (int)x;
}

static void api_read_prefill(json_t *p, api_upstream_line *u) {
    if (!json_is_object(p)) return;
    api_copy_str(json_object_get(p, "mode"), u->prefill_mode, sizeof u->prefill_mode);
    api_copy_str(json_object_get(p, "node"), u->prefill_node, sizeof u->prefill_node);
    u->positions_received = api_int(json_object_get(p, "positions_received"));
    u->computed_remote = api_int(json_object_get(p, "computed_remote"));
    u->computed_local = api_int(json_object_get(p, "computed_local"));
    u->start_pos = api_int(json_object_get(p, "start_pos"));
    u->kv_bytes = api_num(json_object_get(p, "kv_bytes"));
    u->wire_bytes = api_num(json_object_get(p, "wire_bytes"));
    u->prefill_ms = api_num(json_object_get(p, "prefill_ms"));
    u->ttft_ms = api_num(json_object_get(p, "ttft_ms"));
    json_t *t = json_object_get(p, "transfer_tail_ms");
    u->transfer_ms = json_is_number(t) ? json_number_value(t) : -1;
    u->remote_prefill_ms = api_num(json_object_get(p, "remote_prefill_ms"));
    u->handoff_ms = api_num(json_object_get(p, "handoff_ms"));
    json_t *qm = json_object_get(p, "queue_ms");
    u->queue_ms = json_is_number(qm) ? json_number_value(qm) : -1;
    api_copy_str(json_object_get(p, "fallback_reason"), u->fallback_reason, sizeof u->fallback_reason);
}

static void api_read_error(json_t *v, char *out, size_t outlen) {
    if (json_is_string(v)) snprintf(out, outlen, "%s", json_string_value(v));
    else if (json_is_object(v) && json_is_string(json_object_get(v, "message")))
        snprintf(out, outlen, "%s", json_string_value(json_object_get(v, "message")));
    else if (v && !json_is_null(v) && !json_is_false(v)) snprintf(out, outlen, "unspecified error");
}

int api_parse_upstream_line(const char *line, size_t len, api_upstream_line *u) {
    memset(u, 0, sizeof *u);
    u->queue_ms = -1;
    json_t *o = json_loadb(line, len, 0, NULL);
    if (!json_is_object(o)) { json_decref(o); return -1; }
    json_t *tok = json_object_get(o, "token"), *text = json_object_get(o, "text");
    if (json_is_string(text) && !(u->text = strdup(json_string_value(text)))) { json_decref(o); return -1; }
    if (json_is_integer(tok)) { u->is_token = 1; u->token = api_int(tok); }
    u->index = api_int(json_object_get(o, "index"));
    if (json_is_number(json_object_get(o, "logprob"))) {
        json_t *lp = json_pack("{s:O, s:O*, s:O*}", "logprob", json_object_get(o, "logprob"), "token_text",
                               json_object_get(o, "token_text"), "top_logprobs", json_object_get(o, "top_logprobs"));
        u->logprob = lp ? json_dumps(lp, JSON_COMPACT) : NULL;
        json_decref(lp);
    }
    if (json_is_true(json_object_get(o, "done")) || json_is_string(json_object_get(o, "finish_reason"))) {
        u->is_done = 1;
        u->is_token = 0;
        api_copy_str(json_object_get(o, "finish_reason"), u->finish_reason, sizeof u->finish_reason);
        json_t *us = json_object_get(o, "usage");
        u->prompt_tokens = api_int(json_object_get(us, "prompt_tokens"));
        u->completion_tokens = api_int(json_object_get(us, "completion_tokens"));
        api_read_prefill(json_object_get(o, "prefill"), u);
        json_t *sp = json_object_get(o, "speculative");
        api_copy_str(json_object_get(sp, "source"), u->spec_source, sizeof u->spec_source);
        u->spec_drafted = api_int(json_object_get(sp, "drafted"));
        u->spec_accepted = api_int(json_object_get(sp, "accepted"));
        if (!u->fallback_reason[0])
            api_copy_str(json_object_get(o, "fallback_reason"), u->fallback_reason, sizeof u->fallback_reason);
    }
    api_read_error(json_object_get(o, "error"), u->error, sizeof u->error);
    int ok = u->is_token || u->is_done || u->error[0];
    json_decref(o);
    if (!ok) { api_upstream_line_free(u); return -1; }
    return 0;
}

void api_upstream_line_free(api_upstream_line *u) {
    free(u->text);
    u->text = NULL;
    free(u->logprob);
    u->logprob = NULL;
}

void api_upstream_error_message(const char *body, size_t len, char *out, size_t outlen) {
    if (outlen == 0) return;
    out[0] = 0;
    json_t *o = json_loadb(body, len, 0, NULL);
    if (o) api_read_error(json_object_get(o, "error"), out, outlen);
    json_decref(o);
    if (!out[0]) {
        size_t n = len < outlen - 1 ? len : outlen - 1;
        for (size_t i = 0; i < n; i++) out[i] = (body[i] >= 32 && body[i] < 127) ? body[i] : ' ';
        out[n] = 0;
    }
}

/* node_decode_request.c - the decode node's POST /v1/generate body: parsed,
 * bounded (prompt bytes, stop strings, choices, sampling ranges) and
 * tokenized into a dn_req (node_decode_internal.h). */

#include "node/node_decode.h"

#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include <jansson.h>

#include "api/extensions.h"
#include "api/tools.h"

#include "node/node_decode_internal.h"

/* ==== Requests ==== */

void dn_req_free(dn_req *r) {
    free(r->prompt);
    free(r->bias);
    for (int i = 0; i < r->n_stop; i++) free(r->stop[i]);
    grammar_free(r->grammar);
    memset(r, 0, sizeof *r);
}

static int dn_get_bool(json_t *o, const char *k, int *out, char *err, size_t errlen) {
    json_t *v = json_object_get(o, k);
    if (!v) return 0;
    if (!json_is_boolean(v)) { snprintf(err, errlen, "'%s' must be a boolean", k); return -1; }
    *out = json_is_true(v);
    return 0;
}

static int dn_get_int(json_t *o, const char *k, long long lo, long long hi, long long *out, char *err, size_t errlen) {
    json_t *v = json_object_get(o, k);
    if (!v) return 0;
    if (!json_is_integer(v) || json_integer_value(v) < lo || json_integer_value(v) > hi) {
        snprintf(err, errlen, "'%s' must be an integer in [%lld, %lld]", k, lo, hi);
        return -1;
    }
    *out = json_integer_value(v);
    return 0;
}

static int dn_get_num(json_t *o, const char *k, double lo, double hi, float *out, char *err, size_t errlen) {
    json_t *v = json_object_get(o, k);
    if (!v) return 0;
    double d = json_is_number(v) ? json_number_value(v) : NAN;
    if (!(d >= lo && d <= hi)) { snprintf(err, errlen, "'%s' must be a number in [%g, %g]", k, lo, hi); return -1; }
    *out = (float)d;
    return 0;
}

static int dn_parse_stop(json_t *o, dn_req *r, char *err, size_t errlen) {
    json_t *v = json_object_get(o, "stop");
    if (!v || json_is_null(v)) return 0;
    json_t *one = json_is_string(v) ? v : NULL;
    size_t cnt = one ? 1 : json_is_array(v) ? json_array_size(v) : 0;
    if (!one && !json_is_array(v)) { snprintf(err, errlen, "'stop' must be a string or an array of strings"); return -1; }
    if (cnt > DN_MAX_STOP) { snprintf(err, errlen, "'stop' has more than %d strings", DN_MAX_STOP); return -1; }
    for (size_t i = 0; i < cnt; i++) {
        json_t *s = one ? one : json_array_get(v, i);
        size_t len = json_is_string(s) ? json_string_length(s) : 0;
        if (!json_is_string(s) || len == 0 || len > DN_MAX_STOP_LEN || strlen(json_string_value(s)) != len) {
            snprintf(err, errlen, "'stop' entries must be non-empty strings of at most %d bytes, without NUL", DN_MAX_STOP_LEN);
            return -1;
        }
        if (!(r->stop[r->n_stop] = strndup(json_string_value(s), len))) { snprintf(err, errlen, "out of memory"); return -1; }
        r->n_stop++;
    }
    return 0;
}

/* A token covers at most max_token_bytes bytes of text (normalisation
 * only adds bytes), so text longer than n_ctx of them cannot fit: refused
 * before it is tokenized whole. */
static int dn_prompt_bytes_fit(dnode *n, size_t bytes, char *err, size_t errlen) {
    size_t per = tokenizer_max_token_bytes(n->tok), cap = (size_t)n->n_ctx * (per ? per : 1);
    if (bytes <= cap) return 1;
    snprintf(err, errlen, "the prompt has %zu bytes: more than the context of %d tokens can hold (at most %zu bytes)",
             bytes, n->n_ctx, cap);
    return 0;
}

/* "messages" (OpenAI shape: tool_calls, tool roles), with "tools" and an
 * "assistant_prefix" (a forced tool call), rendered the way the model's
 * chat template does (tools.c), then tokenized like a prompt. */
static int dn_parse_messages(dnode *n, json_t *o, json_t *a, dn_req *r, char *err, size_t errlen) {
    json_t *tools = json_object_get(o, "tools"), *pre = json_object_get(o, "assistant_prefix");
    if (json_array_size(a) > DN_MAX_MESSAGES) {
        snprintf(err, errlen, "'messages' holds more than %d messages", DN_MAX_MESSAGES);
        return -1;
    }
    if (pre && (!json_is_string(pre) || strlen(json_string_value(pre)) != json_string_length(pre))) {
        snprintf(err, errlen, "'assistant_prefix' must be a string without NUL characters");
        return -1;
    }
    chat_style st;
    if (tools_style_detect(model_get_gguf(n->m), &st, err, errlen)) return -1;
    char *text = tools_render(&st, a, json_is_null(tools) ? NULL : tools, json_string_value(pre), err, errlen);
    if (!text) return -1;
    size_t len = strlen(text);
    const tokenizer *tok = n->tok;
    int fits = dn_prompt_bytes_fit(n, len, err, errlen);
    int64_t need = fits ? tokenizer_encode(tok, text, len, 1, 1, NULL, 0) : 0;
    int rc = -1;
    if (!fits) {
        /* err says why */
    } else if (need <= 0 || need > n->n_ctx) {
        snprintf(err, errlen, need <= 0 ? "the messages render to an empty prompt"
                 : "the prompt has %lld tokens but the context holds %d", (long long)need, n->n_ctx);
    } else if (!(r->prompt = malloc(sizeof(int32_t) * (size_t)need)) ||
               tokenizer_encode(tok, text, len, 1, 1, r->prompt, need) != need) {
        snprintf(err, errlen, "tokenization failed");
    } else {
        r->n_prompt = (int)need;
        rc = 0;
    }
    free(text);
    return rc;
}

int dn_parse_prompt(dnode *n, json_t *o, dn_req *r, char *err, size_t errlen) {
    json_t *p = json_object_get(o, "prompt"), *t = json_object_get(o, "tokens"), *ms = json_object_get(o, "messages");
    int chat = 0;
    if (dn_get_bool(o, "chat", &chat, err, errlen)) return -1;
    if (!!p + !!t + !!ms != 1) { snprintf(err, errlen, "give exactly one of 'prompt', 'tokens' and 'messages'"); return -1; }
    if (ms) {
        if (dn_parse_messages(n, o, ms, r, err, errlen)) return -1;
    } else if (p) {
        if (!json_is_string(p)) { snprintf(err, errlen, "'prompt' must be a string"); return -1; }
        const char *text = json_string_value(p);
        if (strlen(text) != json_string_length(p)) { snprintf(err, errlen, "'prompt' contains a NUL character"); return -1; }
        if (!*text) { snprintf(err, errlen, "'prompt' is empty"); return -1; }
        if (!dn_prompt_bytes_fit(n, json_string_length(p), err, errlen)) return -1;
        if (!(r->prompt = tools_tokenize_prompt(n->m, text, chat, &r->n_prompt, err, errlen))) return -1;
    } else {
        size_t cnt = json_is_array(t) ? json_array_size(t) : 0;
        if (!json_is_array(t)) { snprintf(err, errlen, "'tokens' must be an array of token ids"); return -1; }
        if (cnt == 0) { snprintf(err, errlen, "'tokens' is empty"); return -1; }
        if (cnt > (size_t)n->n_ctx) {
            snprintf(err, errlen, "the prompt has %zu tokens but the context holds %d", cnt, n->n_ctx);
            return -1;
        }
        if (!(r->prompt = malloc(sizeof(int32_t) * cnt))) { snprintf(err, errlen, "out of memory"); return -1; }
        for (size_t i = 0; i < cnt; i++) {
            json_t *e = json_array_get(t, i);
            if (!json_is_integer(e) || json_integer_value(e) < 0 || json_integer_value(e) >= n->n_vocab) {
                snprintf(err, errlen, "'tokens'[%zu] must be a token id in [0, %d)", i, n->n_vocab);
                return -1;
            }
            r->prompt[i] = (int32_t)json_integer_value(e);
        }
        r->n_prompt = (int)cnt;
    }
    if (r->n_prompt > n->n_ctx) {
        snprintf(err, errlen, "the prompt has %d tokens but the context holds %d", r->n_prompt, n->n_ctx);
        return -1;
    }
    return 0;
}

static int dn_parse_prefill(dnode *n, json_t *o, dn_req *r, char *err, size_t errlen) {
    json_t *v = json_object_get(o, "prefill"), *nd = json_object_get(o, "prefill_node");
    r->mode = DN_PF_AUTO;
    if (v) {
        const char *s = json_is_string(v) ? json_string_value(v) : "";
        if (!strcmp(s, "auto")) r->mode = DN_PF_AUTO;
        else if (!strcmp(s, "remote")) r->mode = DN_PF_REMOTE;
        else if (!strcmp(s, "local")) r->mode = DN_PF_LOCAL;
        else { snprintf(err, errlen, "'prefill' must be \"auto\", \"remote\" or \"local\""); return -1; }
    }
    if (nd && !json_is_null(nd)) {
        size_t len = json_is_string(nd) ? json_string_length(nd) : 0;
        if (!json_is_string(nd) || len == 0 || len >= sizeof r->node || !strchr(json_string_value(nd), ':')) {
            snprintf(err, errlen, "'prefill_node' must be a \"host:port\" string");
            return -1;
        }
        /* Naming the peer the node connects to is the router's privilege:
         * only a node that authenticates its requests accepts it. */
        if (!n->auth) {
            snprintf(err, errlen, "'prefill_node' is accepted only from an authenticated router: this node has no "
                     "shared secret (configure its prefill nodes with --prefill-node)");
            return -1;
        }
        snprintf(r->node, sizeof r->node, "%s", json_string_value(nd));
    }
    int have_node = r->node[0] || n->o->n_prefill_nodes > 0;
    if (n->o->local_only && (r->mode == DN_PF_REMOTE || r->node[0])) {
        snprintf(err, errlen, "this node runs with --role local and uses no prefill node");
        return -1;
    }
    if (r->mode == DN_PF_REMOTE && !have_node) {
        snprintf(err, errlen, "'prefill' is \"remote\" but no prefill node is configured or given");
        return -1;
    }
    return 0;
}

static int dn_parse_sampling(json_t *o, dn_req *r, char *err, size_t errlen) {
    long long v;
    r->sp = sampler_defaults();
    v = 128;
    if (dn_get_int(o, "max_tokens", 0, DN_MAX_TOKENS_LIMIT, &v, err, errlen)) return -1;
    r->max_tokens = (int)v;
    if (dn_get_num(o, "temperature", 0, 1e6, &r->sp.temp, err, errlen)) return -1;
    v = r->sp.top_k;
    if (dn_get_int(o, "top_k", -1, 1000000000, &v, err, errlen)) return -1;
    r->sp.top_k = (int)v;
    if (dn_get_num(o, "top_p", 0, 1, &r->sp.top_p, err, errlen)) return -1;
    if (dn_get_num(o, "min_p", 0, 1, &r->sp.min_p, err, errlen)) return -1;
    v = 0;
    if (dn_get_int(o, "seed", 0, INT64_MAX, &v, err, errlen)) return -1;
    /* No seed: a fresh one per request, so that unseeded calls differ. */
    r->sp.seed = json_object_get(o, "seed") ? (uint64_t)v : sampler_fresh_seed();
    if (json_object_get(o, "logprobs")) {
        v = 0;
        if (dn_get_int(o, "logprobs", 0, SCHED_MAX_TOP_LOGPROBS, &v, err, errlen)) return -1;
        r->logprobs = 1 + (int)v;
    }
    if (dn_get_bool(o, "ignore_eos", &r->ignore_eos, err, errlen)) return -1;
    if (dn_get_bool(o, "stream", &r->stream, err, errlen)) return -1;
    return 0;
}

/* "presence_penalty", "frequency_penalty" (-2..2, OpenAI), "repetition_penalty"
 * (llama-server's name, > 0; 1 = off) with "repeat_last_n". */
static int dn_parse_penalties(json_t *o, dn_req *r, char *err, size_t errlen) {
    if (dn_get_num(o, "presence_penalty", -2, 2, &r->sp.presence_penalty, err, errlen) ||
        dn_get_num(o, "frequency_penalty", -2, 2, &r->sp.frequency_penalty, err, errlen) ||
        dn_get_num(o, "repetition_penalty", 0.01, 100, &r->sp.repeat_penalty, err, errlen))
        return -1;
    long long v = 0;
    if (dn_get_int(o, "repeat_last_n", 1, 1 << 20, &v, err, errlen)) return -1;
    r->sp.repeat_last_n = (int)v;
    return 0;
}

/* "logit_bias": {"token id": bias (-100..100)} as OpenAI sends it; -100
 * bans the token outright. */
static int dn_parse_logit_bias(dnode *n, json_t *o, dn_req *r, char *err, size_t errlen) {
    json_t *lb = json_object_get(o, "logit_bias");
    if (!lb || json_is_null(lb)) return 0;
    if (!json_is_object(lb) || json_object_size(lb) > 1024) {
        snprintf(err, errlen, "'logit_bias' must be an object of at most 1024 \"token id\": bias entries");
        return -1;
    }
    if (!(r->bias = calloc(json_object_size(lb) + 1, sizeof *r->bias))) { snprintf(err, errlen, "out of memory"); return -1; }
    const char *key;
    json_t *val;
    json_object_foreach(lb, key, val) {
        char *end;
        long id = strtol(key, &end, 10);
        double b = json_is_number(val) ? json_number_value(val) : NAN;
        if (end == key || *end || id < 0 || id >= n->n_vocab || !(b >= -100 && b <= 100)) {
            snprintf(err, errlen, "'logit_bias' entries must map a token id in [0, %d) to a number in [-100, 100]",
                     n->n_vocab);
            return -1;
        }
        r->bias[r->sp.n_bias++] = (sampler_bias){ (int32_t)id, b <= -100 ? -INFINITY : (float)b };
    }
    r->sp.bias = r->bias;
    return 0;
}

/* The constraint ("response_format", "grammar", "regex" or "choice"),
 * compiled to a grammar that masks every token that cannot continue a valid
 * output (extensions.c, grammar.h), and "min_tokens" / "stop_token_ids". */
static int dn_parse_response_format(dnode *n, json_t *o, dn_req *r, char *err, size_t errlen) {
    if (api_constraint_compile(o, &r->grammar, err, errlen)) return -1;
    return api_gen_limits(o, n->n_vocab, &r->min_tokens, r->stop_ids, &r->n_stop_ids, err, errlen);
}

/* "n" (1..DN_MAX_CHOICES, at most the node's slots so that every choice can
 * run at once, and its queue): n > 1 only streamed, each line tagged with
 * its "index". */
static int dn_parse_choices(dnode *n, json_t *o, dn_req *r, char *err, size_t errlen) {
    long long v = 1;
    if (dn_get_int(o, "n", 1, DN_MAX_CHOICES, &v, err, errlen)) return -1;
    r->n_choices = (int)v;
    if (v > n->n_slots) {
        snprintf(err, errlen, "'n' is %lld but this node decodes at most %d sequences at once (--parallel %d)",
                 v, n->n_slots, n->n_slots);
        return -1;
    }
    /* every choice passes through the queue (the siblings wait there for
     * choice 0's prompt): a queue shorter than n could never take them */
    if (v > n->queue_max) {
        snprintf(err, errlen, "'n' is %lld but this node queues at most %d requests (--queue %d)", v, n->queue_max,
                 n->queue_max);
        return -1;
    }
    if (v > 1 && !r->stream) {
        snprintf(err, errlen, "'n' > 1 needs \"stream\": true");
        return -1;
    }
    return 0;
}

/* 0, or -1 with a message for a 400 response. */
int dn_parse_request(dnode *n, const char *body, size_t len, dn_req *r, char *err, size_t errlen) {
    memset(r, 0, sizeof *r);
    json_error_t je;
    json_t *o = json_loadb(body ? body : "", len, JSON_REJECT_DUPLICATES, &je);
    if (!o) { snprintf(err, errlen, "invalid JSON: %s (line %d, column %d)", je.text, je.line, je.column); return -1; }
    int rc = -1;
    if (!json_is_object(o)) { snprintf(err, errlen, "the request body must be a JSON object"); goto out; }
    if (dn_parse_sampling(o, r, err, errlen) || dn_parse_penalties(o, r, err, errlen) ||
        dn_parse_logit_bias(n, o, r, err, errlen) || dn_parse_response_format(n, o, r, err, errlen) ||
        dn_parse_stop(o, r, err, errlen) || dn_parse_choices(n, o, r, err, errlen) ||
        dn_parse_prefill(n, o, r, err, errlen) || dn_parse_prompt(n, o, r, err, errlen))
        goto out;
    /* "max_tokens_strict" (the router's, for a client's explicit max_tokens):
     * a completion asked to be longer than the context leaves is refused, as
     * OpenAI and vLLM do; otherwise the output stops at the context's end */
    if (json_is_true(json_object_get(o, "max_tokens_strict")) && r->n_prompt + r->max_tokens > n->n_ctx) {
        snprintf(err, errlen, "the prompt has %d tokens and max_tokens is %d: together more than the context of %d "
                 "tokens (reduce the prompt or max_tokens)", r->n_prompt, r->max_tokens, n->n_ctx);
        goto out;
    }
    rc = 0;
out:
    json_decref(o);
    if (rc) dn_req_free(r);
    return rc;
}

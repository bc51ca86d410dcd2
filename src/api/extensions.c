/* extensions.c - the ecosystem's request fields, unknown-field refusal, and
 * constraints from a decode node's body (see extensions.h). */
#include "api/extensions.h"

#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

/* ==== Known fields ==== */

/* Fields of both endpoints. "user", "metadata" and "service_tier" change
 * nothing in the output (checked for shape below); "store" true is refused
 * (nothing is stored). The extensions are llama-server's and vLLM's. */
static const char *const ext_common[] = {
    "model", "max_tokens", "max_completion_tokens", "temperature", "top_p", "n", "stream", "stream_options", "stop",
    "presence_penalty", "frequency_penalty", "logit_bias", "logprobs", "top_logprobs", "seed", "user",
    "response_format", "tools", "tool_choice", "parallel_tool_calls", "functions", "function_call", "prediction",
    "modalities", "audio", "suffix", "store", "metadata", "service_tier",
    /* extensions */
    "top_k", "min_p", "repetition_penalty", "ignore_eos", "grammar", "json_schema", "guided_json", "guided_choice",
    "guided_regex", "guided_grammar", "min_tokens", "stop_token_ids", NULL
};
static const char *const ext_chat[] = { "messages", NULL };
static const char *const ext_completion[] = { "prompt", "echo", "best_of", NULL };

static int ext_in(const char *const *l, const char *k) {
    for (; *l; l++)
        if (!strcmp(*l, k)) return 1;
    return 0;
}

int api_ext_check_fields(json_t *root, enum api_kind kind, int lenient, api_error *e) {
    const char *k;
    json_t *v;
    json_object_foreach(root, k, v) {
        if (lenient || ext_in(ext_common, k) || ext_in(kind == API_CHAT ? ext_chat : ext_completion, k)) continue;
        char name[64];
        snprintf(name, sizeof name, "%.60s", k);
        return api_error_bad(e, name, "unknown_parameter",
                       "Unrecognized request argument supplied: '%s'. This server refuses fields it does not apply "
                       "(docs/router.md lists them; an operator may start the router with --lenient-params to ignore "
                       "them).", name);
    }
    json_t *st = json_object_get(root, "store");
    if (st && !json_is_null(st) && !json_is_boolean(st)) return api_error_bad(e, "store", "invalid_type", "'store' must be a boolean.");
    if (json_is_true(st))
        return api_error_bad(e, "store", "unsupported_parameter", "'store': true is not supported: this server stores no completions.");
    json_t *u = json_object_get(root, "user"), *md = json_object_get(root, "metadata"), *tier = json_object_get(root, "service_tier");
    if (u && !json_is_null(u) && !json_is_string(u)) return api_error_bad(e, "user", "invalid_type", "'user' must be a string.");
    if (md && !json_is_null(md) && !json_is_object(md)) return api_error_bad(e, "metadata", "invalid_type", "'metadata' must be an object.");
    if (tier && !json_is_null(tier) &&
        (!json_is_string(tier) || (strcmp(json_string_value(tier), "auto") && strcmp(json_string_value(tier), "default"))))
        return api_error_bad(e, "service_tier", "unsupported_parameter", "'service_tier' may only be \"auto\" or \"default\" here.");
    return 0;
}

/* ==== Constraints (router side) ==== */

/* A schema compiled once to check it; a refused keyword named in param
 * ("<field>#<pointer>/<keyword>") and code. */
static int ext_check_schema(json_t *schema, const char *field, api_error *e) {
    grammar *g = NULL;
    char err[400] = "", kw[48], at[256];
    int rc = grammar_compile_schema_at(&g, schema, err, sizeof err, kw, sizeof kw, at, sizeof at);
    grammar_free(g);
    if (!rc) return 0;
    char param[sizeof e->param];
    if (kw[0]) snprintf(param, sizeof param, "%.40s%.100s/%.47s", field, at, kw);
    else snprintf(param, sizeof param, "%s", field);
    api_error_set(e, 400, "invalid_request_error", kw[0] ? "unsupported_schema_keyword" : "invalid_json_schema", param,
                  "%s: %s", field, err);
    return -1;
}

/* The text of a GBNF grammar or regular expression field, compiled once. */
static int ext_text(json_t *v, const char *field, int gbnf, const char *node_key, json_t *o, api_error *e) {
    if (!json_is_string(v)) return api_error_bad(e, field, "invalid_type", "'%s' must be a string.", field);
    grammar *g = NULL;
    char err[400] = "";
    int rc = gbnf ? grammar_compile_gbnf(&g, json_string_value(v), json_string_length(v), err, sizeof err)
                  : grammar_compile_regex(&g, json_string_value(v), json_string_length(v), err, sizeof err);
    grammar_free(g);
    if (rc) {
        api_error_set(e, 400, "invalid_request_error", gbnf ? "invalid_grammar" : "invalid_regex", field, "%s: %s", field, err);
        return -1;
    }
    json_object_set(o, node_key, v);
    return 0;
}

static int ext_choice(json_t *v, json_t *o, api_error *e) {
    size_t n = json_array_size(v);
    if (!json_is_array(v) || n == 0 || n > 4096)
        return api_error_bad(e, "guided_choice", "invalid_value", "'guided_choice' must be an array of 1 to 4096 strings.");
    const char **c = calloc(n, sizeof *c);
    if (!c) return api_error_bad(e, "guided_choice", NULL, "out of memory");
    int rc = 0;
    for (size_t i = 0; i < n && !rc; i++) {
        json_t *s = json_array_get(v, i);
        if (!json_is_string(s) || json_string_length(s) == 0 || strlen(json_string_value(s)) != json_string_length(s))
            rc = api_error_bad(e, "guided_choice", "invalid_value", "'guided_choice' entries must be non-empty strings without NUL.");
        else c[i] = json_string_value(s);
    }
    grammar *g = NULL;
    char err[400] = "";
    if (!rc && grammar_compile_choice(&g, c, (int)n, err, sizeof err)) {
        api_error_set(e, 400, "invalid_request_error", "invalid_value", "guided_choice", "guided_choice: %s", err);
        rc = -1;
    }
    grammar_free(g);
    free(c);
    if (!rc) json_object_set(o, "choice", v);
    return rc;
}

/* guided_json (a schema, or its JSON text as vLLM also takes) and
 * llama-server's top-level json_schema: a response_format json_schema. */
static int ext_schema_field(json_t *v, const char *field, json_t *o, api_error *e) {
    json_t *schema = json_is_string(v) ? json_loads(json_string_value(v), 0, NULL) : json_incref(v);
    if (!json_is_object(schema)) {
        json_decref(schema);
        return api_error_bad(e, field, "invalid_value", "'%s' must be a JSON Schema object.", field);
    }
    int rc = ext_check_schema(schema, field, e);
    if (!rc) json_object_set_new(o, "response_format", json_pack("{s:s, s:{s:s, s:o}}", "type", "json_schema",
                                                                 "json_schema", "name", field, "schema", schema));
    else json_decref(schema);
    return rc;
}

int api_ext_sampling(json_t *root, json_t *o, api_error *e) {
    static const char *const kinds[] = { "grammar", "guided_grammar", "guided_regex", "guided_choice", "guided_json",
                                         "json_schema", NULL };
    const char *have = NULL;
    json_t *rf = json_object_get(o, "response_format");
    const char *rft = json_string_value(json_object_get(rf, "type"));
    if (rft && strcmp(rft, "text")) have = "response_format";
    if (rft && !strcmp(rft, "json_schema") &&
        ext_check_schema(json_object_get(json_object_get(rf, "json_schema"), "schema"), "response_format.json_schema.schema", e))
        return -1;
    for (int i = 0; kinds[i]; i++) {
        json_t *v = json_object_get(root, kinds[i]);
        if (!v || json_is_null(v)) continue;
        if (have)
            return api_error_bad(e, kinds[i], "invalid_value", "'%s' cannot be combined with '%s': give one constraint.", kinds[i], have);
        have = kinds[i];
        int rc = i < 2 ? ext_text(v, kinds[i], 1, "grammar", o, e)
               : i == 2 ? ext_text(v, kinds[i], 0, "regex", o, e)
               : i == 3 ? ext_choice(v, o, e)
               : ext_schema_field(v, kinds[i], o, e);
        if (rc) return -1;
    }
    json_t *mt = json_object_get(root, "min_tokens");
    if (mt && !json_is_null(mt)) {
        if (!json_is_integer(mt) || json_integer_value(mt) < 0 || json_integer_value(mt) > (1 << 24))
            return api_error_bad(e, "min_tokens", "invalid_value", "'min_tokens' must be an integer in [0, 16777216].");
        /* a constraint decides where its output ends: masking the end
         * there could leave no token at all */
        if (json_integer_value(mt) > 0 && have)
            return api_error_bad(e, "min_tokens", "invalid_value", "'min_tokens' cannot be combined with '%s'.", have);
        if (json_integer_value(mt) > 0) json_object_set(o, "min_tokens", mt);
    }
    json_t *ids = json_object_get(root, "stop_token_ids");
    if (ids && !json_is_null(ids)) {
        if (!json_is_array(ids) || json_array_size(ids) > API_MAX_STOP_IDS)
            return api_error_bad(e, "stop_token_ids", "invalid_value", "'stop_token_ids' must be an array of at most 64 token ids.");
        for (size_t i = 0; i < json_array_size(ids); i++) {
            json_t *x = json_array_get(ids, i);
            if (!json_is_integer(x) || json_integer_value(x) < 0 || json_integer_value(x) > INT32_MAX)
                return api_error_bad(e, "stop_token_ids", "invalid_value", "'stop_token_ids' entries must be token ids (integers >= 0).");
        }
        if (json_array_size(ids)) json_object_set(o, "stop_token_ids", ids);
    }
    return 0;
}

/* ==== Constraints (node side) ==== */

static int ext_response_format(json_t *rf, grammar **out, char *err, size_t errlen) {
    const char *type = json_string_value(json_object_get(rf, "type"));
    if (!json_is_object(rf) || !type) {
        snprintf(err, errlen, "'response_format' must be an object with a 'type'");
        return -1;
    }
    if (!strcmp(type, "text")) return 0;
    if (!strcmp(type, "json_object")) return grammar_compile_json_object(out, err, errlen);
    if (strcmp(type, "json_schema")) {
        snprintf(err, errlen, "'response_format.type' must be \"text\", \"json_object\" or \"json_schema\"");
        return -1;
    }
    json_t *schema = json_object_get(json_object_get(rf, "json_schema"), "schema");
    if (!json_is_object(schema)) {
        snprintf(err, errlen, "'response_format.json_schema.schema' must be a JSON schema object");
        return -1;
    }
    char gerr[400];
    if (grammar_compile_schema(out, schema, gerr, sizeof gerr)) {
        snprintf(err, errlen, "response_format.json_schema: %s", gerr);
        return -1;
    }
    return 0;
}

int api_constraint_compile(json_t *o, grammar **out, char *err, size_t errlen) {
    static const char *const keys[] = { "response_format", "grammar", "regex", "choice", NULL };
    *out = NULL;
    int n = 0, which = -1;
    for (int i = 0; keys[i]; i++) {
        json_t *v = json_object_get(o, keys[i]);
        if (v && !json_is_null(v)) { n++; which = i; }
    }
    if (n > 1) {
        snprintf(err, errlen, "give at most one of 'response_format', 'grammar', 'regex' and 'choice'");
        return -1;
    }
    if (which < 0) return 0;
    json_t *v = json_object_get(o, keys[which]);
    if (which == 0) return ext_response_format(v, out, err, errlen);
    if (which < 3) {
        if (!json_is_string(v)) {
            snprintf(err, errlen, "'%s' must be a string", keys[which]);
            return -1;
        }
        char gerr[400];
        int rc = which == 1 ? grammar_compile_gbnf(out, json_string_value(v), json_string_length(v), gerr, sizeof gerr)
                            : grammar_compile_regex(out, json_string_value(v), json_string_length(v), gerr, sizeof gerr);
        if (rc) snprintf(err, errlen, "%s: %s", keys[which], gerr);
        return rc;
    }
    size_t cnt = json_array_size(v);
    if (!json_is_array(v) || cnt == 0 || cnt > 4096) {
        snprintf(err, errlen, "'choice' must be an array of 1 to 4096 strings");
        return -1;
    }
    const char **c = calloc(cnt, sizeof *c);
    if (!c) {
        snprintf(err, errlen, "out of memory");
        return -1;
    }
    for (size_t i = 0; i < cnt; i++) {
        json_t *s = json_array_get(v, i);
        if (!json_is_string(s) || strlen(json_string_value(s)) != json_string_length(s)) {
            free(c);
            snprintf(err, errlen, "'choice' entries must be strings without NUL");
            return -1;
        }
        c[i] = json_string_value(s);
    }
    char gerr[400];
    int rc = grammar_compile_choice(out, c, (int)cnt, gerr, sizeof gerr);
    if (rc) snprintf(err, errlen, "choice: %s", gerr);
    free(c);
    return rc;
}

/* ==== Generation limits (node side) ==== */

int api_gen_limits(json_t *o, int n_vocab, int *min_tokens, int32_t *ids, int *n_ids, char *err, size_t errlen) {
    json_t *mt = json_object_get(o, "min_tokens"), *st = json_object_get(o, "stop_token_ids");
    *min_tokens = 0;
    *n_ids = 0;
    if (mt && !json_is_null(mt)) {
        if (!json_is_integer(mt) || json_integer_value(mt) < 0 || json_integer_value(mt) > (1 << 24)) {
            snprintf(err, errlen, "'min_tokens' must be an integer in [0, 16777216]");
            return -1;
        }
        *min_tokens = (int)json_integer_value(mt);
        static const char *const cons[] = { "response_format", "grammar", "regex", "choice" };
        for (int i = 0; i < 4 && *min_tokens > 0; i++) {
            json_t *c = json_object_get(o, cons[i]);
            if (c && !json_is_null(c) && !(i == 0 && !strcmp(json_string_value(json_object_get(c, "type")) ? json_string_value(json_object_get(c, "type")) : "", "text"))) {
                snprintf(err, errlen, "'min_tokens' cannot be combined with '%s'", cons[i]);
                return -1;
            }
        }
    }
    if (st && !json_is_null(st)) {
        if (!json_is_array(st) || json_array_size(st) > API_MAX_STOP_IDS) {
            snprintf(err, errlen, "'stop_token_ids' must be an array of at most %d token ids", API_MAX_STOP_IDS);
            return -1;
        }
        for (size_t i = 0; i < json_array_size(st); i++) {
            json_t *x = json_array_get(st, i);
            if (!json_is_integer(x) || json_integer_value(x) < 0 || json_integer_value(x) >= n_vocab) {
                snprintf(err, errlen, "'stop_token_ids'[%zu] must be a token id in [0, %d)", i, n_vocab);
                return -1;
            }
            ids[(*n_ids)++] = (int32_t)json_integer_value(x);
        }
    }
    return 0;
}

/* tok_api.c - the bodies of a decode node's POST /v1/tokenize and
 * POST /v1/detokenize, in llama-server's shapes (see tok_api.h). */
#include "api/tok_api.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include <jansson.h>

/* ==== Helpers ==== */

static int tk_fail(char *err, size_t errlen, const char *msg) {
    snprintf(err, errlen, "%s", msg);
    return 400;
}

static json_t *tk_load(const char *body, size_t len, char *err, size_t errlen) {
    json_error_t je;
    json_t *o = json_loadb(body ? body : "", len, JSON_REJECT_DUPLICATES, &je);
    if (!o) snprintf(err, errlen, "invalid JSON: %s (line %d, column %d)", je.text, je.line, je.column);
    else if (!json_is_object(o)) { snprintf(err, errlen, "the request body must be a JSON object"); json_decref(o); o = NULL; }
    return o;
}

static int tk_bool(json_t *o, const char *k, int *out, char *err, size_t errlen) {
    json_t *v = json_object_get(o, k);
    if (!v || json_is_null(v)) return 0;
    if (!json_is_boolean(v)) { snprintf(err, errlen, "'%s' must be a boolean", k); return -1; }
    *out = json_is_true(v);
    return 0;
}

/* Length of the valid UTF-8 sequence at s (n bytes left), 0 if invalid. */
static size_t tk_utf8_len(const unsigned char *s, size_t n) {
    size_t l = s[0] < 0x80 ? 1 : (s[0] & 0xE0) == 0xC0 ? 2 : (s[0] & 0xF0) == 0xE0 ? 3 : (s[0] & 0xF8) == 0xF0 ? 4 : 0;
    if (l == 0 || l > n || (l == 2 && s[0] < 0xC2)) return 0;
    for (size_t i = 1; i < l; i++) if ((s[i] & 0xC0) != 0x80) return 0;
    if (l == 3 && ((s[0] == 0xE0 && s[1] < 0xA0) || (s[0] == 0xED && s[1] >= 0xA0))) return 0;
    if (l == 4 && ((s[0] == 0xF0 && s[1] < 0x90) || s[0] > 0xF4 || (s[0] == 0xF4 && s[1] >= 0x90))) return 0;
    return l;
}

/* A JSON string of bytes that may not be valid UTF-8: bad bytes become U+FFFD. */
static json_t *tk_text(const char *s, size_t n) {
    char *c = malloc(n * 3 + 1);
    if (!c) return NULL;
    size_t o = 0;
    for (size_t i = 0; i < n;) {
        size_t l = tk_utf8_len((const unsigned char *)s + i, n - i);
        if (l) { memcpy(c + o, s + i, l); o += l; i += l; }
        else { memcpy(c + o, "\xEF\xBF\xBD", 3); o += 3; i++; }
    }
    json_t *v = json_stringn(c, o);
    free(c);
    return v;
}

/* A piece: a string when its bytes are valid UTF-8, else the byte values. */
static json_t *tk_piece(const char *s, size_t n) {
    json_t *v = json_stringn(s, n);
    if (v) return v;
    json_t *a = json_array();
    for (size_t i = 0; a && i < n; i++) json_array_append_new(a, json_integer((unsigned char)s[i]));
    return a;
}

static char *tk_dump(json_t *o) {
    char *s = o ? json_dumps(o, JSON_COMPACT) : NULL;
    json_decref(o);
    return s;
}

/* ==== Tokenize ==== */

static json_t *tk_ids_json(const tokenizer *t, const int32_t *ids, int64_t n, int with_pieces, char *buf, size_t cap) {
    json_t *a = json_array();
    for (int64_t i = 0; a && i < n; i++) {
        if (!with_pieces) { json_array_append_new(a, json_integer(ids[i])); continue; }
        int k = tokenizer_token_bytes(t, ids[i], 1, buf, cap);
        json_array_append_new(a, json_pack("{s:i, s:o}", "id", ids[i], "piece", tk_piece(buf, k > 0 ? (size_t)k : 0)));
    }
    return a;
}

int tokapi_tokenize(const tokenizer *t, const char *body, size_t len, char **out, char *err, size_t errlen) {
    *out = NULL;
    json_t *o = tk_load(body, len, err, errlen);
    if (!o) return 400;
    int add_special = 0, parse_special = 1, with_pieces = 0, status = 400;
    json_t *c = json_object_get(o, "content");
    int32_t *ids = NULL;
    char *buf = NULL;
    if (!json_is_string(c)) { tk_fail(err, errlen, "'content' must be a string"); goto out; }
    if (tk_bool(o, "add_special", &add_special, err, errlen) || tk_bool(o, "parse_special", &parse_special, err, errlen) ||
        tk_bool(o, "with_pieces", &with_pieces, err, errlen))
        goto out;
    const char *text = json_string_value(c);
    size_t n = json_string_length(c);
    int64_t need = tokenizer_encode(t, text, n, add_special, parse_special, NULL, 0);
    size_t cap = tokenizer_max_token_bytes(t) + 8;
    if (need < 0) { tk_fail(err, errlen, "tokenization failed"); goto out; }
    status = 500;
    ids = malloc(sizeof *ids * (size_t)(need ? need : 1));
    buf = malloc(cap);
    if (!ids || !buf || tokenizer_encode(t, text, n, add_special, parse_special, ids, need) != need) {
        snprintf(err, errlen, "out of memory");
        goto out;
    }
    *out = tk_dump(json_pack("{s:o}", "tokens", tk_ids_json(t, ids, need, with_pieces, buf, cap)));
    status = *out ? 200 : 500;
    if (!*out) snprintf(err, errlen, "out of memory");
out:
    free(ids);
    free(buf);
    json_decref(o);
    return status;
}

/* ==== Detokenize ==== */

int tokapi_detokenize(const tokenizer *t, const char *body, size_t len, char **out, char *err, size_t errlen) {
    *out = NULL;
    json_t *o = tk_load(body, len, err, errlen);
    if (!o) return 400;
    json_t *a = json_object_get(o, "tokens");
    int status = 400;
    size_t cap = tokenizer_max_token_bytes(t) + 8, n = json_array_size(a), used = 0;
    char *text = NULL;
    if (!json_is_array(a)) { tk_fail(err, errlen, "'tokens' must be an array of token ids"); goto out; }
    if (n > TOKAPI_MAX_TOKENS) { snprintf(err, errlen, "'tokens' holds more than %d ids", TOKAPI_MAX_TOKENS); goto out; }
    if (!(text = malloc(n * cap + 1))) { status = 500; snprintf(err, errlen, "out of memory"); goto out; }
    for (size_t i = 0; i < n; i++) {
        json_t *v = json_array_get(a, i);
        int k = json_is_integer(v) && json_integer_value(v) >= 0 && json_integer_value(v) < tokenizer_n_vocab(t)
              ? tokenizer_token_bytes(t, (int32_t)json_integer_value(v), 1, text + used, cap) : -1;
        if (k < 0) { snprintf(err, errlen, "'tokens'[%zu] must be a token id in [0, %d)", i, tokenizer_n_vocab(t)); goto out; }
        used += (size_t)k;
    }
    *out = tk_dump(json_pack("{s:o}", "content", tk_text(text, used)));
    status = *out ? 200 : 500;
    if (!*out) snprintf(err, errlen, "out of memory");
out:
    free(text);
    json_decref(o);
    return status;
}

/* grade_rubric.c - the pure half of `tandem grade`: the Markdown rubric
 * parser, the JSON schema derived from a rubric, a validator for the schema
 * subset tandem supports, the analysis parser, and prompt templates.
 * No I/O here: tests call these directly and fuzz/fuzz_grade.c feeds them
 * hostile rubrics, templates and model answers. */
#include "grade/grade.h"

#include <ctype.h>
#include <math.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

static void gr_errf(char *err, size_t errlen, const char *fmt, ...) __attribute__((format(printf, 3, 4)));
static void gr_errf(char *err, size_t errlen, const char *fmt, ...) {
    if (!err || !errlen) return;
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(err, errlen, fmt, ap);
    va_end(ap);
}

/* ==== Text helpers ==== */

char *grade_utf8_clean(const char *s, size_t len) {
    /* worst case: every byte becomes the 3-byte U+FFFD */
    if (len > ((size_t)1 << 40)) return NULL;
    char *out = malloc(len * 3 + 1);
    if (!out) return NULL;
    size_t o = 0;
    const unsigned char *p = (const unsigned char *)s;
    for (size_t i = 0; i < len;) {
        unsigned c = p[i];
        size_t n = c < 0x80 ? 1 : (c & 0xE0) == 0xC0 ? 2 : (c & 0xF0) == 0xE0 ? 3 : (c & 0xF8) == 0xF0 ? 4 : 0;
        int ok = n > 0 && i + n <= len;
        unsigned cp = n == 1 ? c : n == 2 ? c & 0x1F : n == 3 ? c & 0x0F : c & 0x07;
        for (size_t k = 1; ok && k < n; k++) {
            if ((p[i + k] & 0xC0) != 0x80) ok = 0;
            else cp = (cp << 6) | (p[i + k] & 0x3F);
        }
        /* overlong forms, surrogates and code points past U+10FFFF are invalid */
        if (ok && ((n == 2 && cp < 0x80) || (n == 3 && cp < 0x800) || (n == 4 && cp < 0x10000) ||
                   (cp >= 0xD800 && cp <= 0xDFFF) || cp > 0x10FFFF)) ok = 0;
        if (!ok) { memcpy(out + o, "\xEF\xBF\xBD", 3); o += 3; i++; continue; }
        if (c != 0) { memcpy(out + o, p + i, n); o += n; }
        i += n;
    }
    out[o] = 0;
    return out;
}

void grade_file_stem(const char *name, char *out, size_t outlen) {
    size_t o = 0;
    for (const char *p = name; *p && o + 1 < outlen; p++) {
        unsigned char c = (unsigned char)*p;
        out[o++] = isalnum(c) || c == '.' || c == '_' || c == '-' ? (char)c : '_';
    }
    out[o] = 0;
    /* "." and ".." (or an empty name) would not be files of their own */
    if (o == 0 || !strcmp(out, ".") || !strcmp(out, "..")) snprintf(out, outlen, "submission");
    if (out[0] == '.') out[0] = '_';
}

static char *gr_strndup_trim(const char *s, size_t n) {
    while (n && isspace((unsigned char)*s)) { s++; n--; }
    while (n && isspace((unsigned char)s[n - 1])) n--;
    char *r = malloc(n + 1);
    if (!r) return NULL;
    memcpy(r, s, n);
    r[n] = 0;
    return r;
}

/* ==== Rubric ==== */

/* Finds "(N points)", "(N point)", "(N pts)" or "(N pt)" (case-insensitive)
 * in s[0..n). Returns the offset of '(' and sets *end (past ')') and *pts,
 * or -1. */
static long gr_find_points(const char *s, size_t n, size_t *end, long *pts) {
    for (size_t i = 0; i < n; i++) {
        if (s[i] != '(') continue;
        size_t j = i + 1;
        while (j < n && s[j] == ' ') j++;
        size_t d0 = j;
        long v = 0;
        while (j < n && isdigit((unsigned char)s[j]) && j - d0 < 7) v = v * 10 + (s[j++] - '0');
        if (j == d0 || (j < n && isdigit((unsigned char)s[j]))) continue;
        while (j < n && s[j] == ' ') j++;
        static const char *const words[] = {"points", "point", "pts", "pt"};
        size_t w = 0;
        for (size_t k = 0; k < 4 && !w; k++) {
            size_t wl = strlen(words[k]);
            if (j + wl <= n && !strncasecmp(s + j, words[k], wl)) w = wl;
        }
        if (!w) continue;
        j += w;
        if (j < n && s[j] == '.') j++;
        while (j < n && s[j] == ' ') j++;
        if (j < n && s[j] == ')') { *end = j + 1; *pts = v; return (long)i; }
    }
    return -1;
}

/* Name as written, without Markdown emphasis and trailing separators. */
static void gr_clean_name(const char *s, size_t n, char *out, size_t outlen) {
    size_t o = 0;
    for (size_t i = 0; i < n && o + 1 < outlen; i++)
        if (s[i] != '*' && s[i] != '_' && s[i] != '`') out[o++] = s[i];
    out[o] = 0;
    while (o && (isspace((unsigned char)out[o - 1]) || out[o - 1] == ':' || out[o - 1] == '-')) out[--o] = 0;
    size_t lead = 0;
    while (out[lead] && isspace((unsigned char)out[lead])) lead++;
    memmove(out, out + lead, strlen(out + lead) + 1);
}

static void gr_make_key(grade_rubric *r, grade_item *it) {
    char base[40];
    size_t o = 0;
    int us = 0;
    for (const char *p = it->name; *p && o + 1 < sizeof base; p++) {
        unsigned char c = (unsigned char)*p;
        if (isalnum(c) && c < 0x80) { base[o++] = (char)tolower(c); us = 0; }
        else if (!us && o) { base[o++] = '_'; us = 1; }
    }
    while (o && base[o - 1] == '_') o--;
    base[o] = 0;
    if (!o) snprintf(base, sizeof base, "item");
    char key[48];
    snprintf(key, sizeof key, "%s%s", isdigit((unsigned char)base[0]) ? "item_" : "", base);
    /* keys must be unique: "Style" twice becomes style, style_2 */
    char cand[64];
    snprintf(cand, sizeof cand, "%s", key);
    for (int k = 2; k < 2 * GRADE_MAX_ITEMS; k++) {
        int clash = 0;
        for (int i = 0; i < r->n_items; i++) clash |= &r->items[i] != it && !strcmp(r->items[i].key, cand);
        if (!clash) break;
        snprintf(cand, sizeof cand, "%.40s_%d", key, k);
    }
    snprintf(it->key, sizeof it->key, "%.47s", cand);
}

static int gr_append(char **dst, const char *s, size_t n) {
    size_t have = *dst ? strlen(*dst) : 0;
    char *d = realloc(*dst, have + n + 2);
    if (!d) return -1;
    if (have && n) d[have++] = '\n';
    memcpy(d + have, s, n);
    d[have + n] = 0;
    *dst = d;
    return 0;
}

enum { GR_NONE = 0, GR_HEADING = 1, GR_LIST = 2 };

/* One line: 1 = it started an item, 0 = other text, -1 = error. */
static int gr_rubric_line(grade_rubric *r, const char *l, size_t n, int lineno, int *form, grade_item **cur,
                          char *err, size_t errlen) {
    size_t i = 0;
    while (i < n && (l[i] == ' ' || l[i] == '\t')) i++;
    int hashes = 0;
    while (i + hashes < n && l[i + hashes] == '#') hashes++;
    int heading = hashes > 0 && i + hashes < n && l[i + hashes] == ' ';
    int list = !heading && i + 1 < n && (l[i] == '-' || l[i] == '*' || l[i] == '+') && l[i + 1] == ' ';
    size_t body = heading ? i + hashes + 1 : list ? i + 2 : i;
    if (!heading && !list && i < n && isdigit((unsigned char)l[i])) {   /* "1. Item" / "1) Item" */
        size_t j = i;
        while (j < n && isdigit((unsigned char)l[j])) j++;
        if (j + 1 < n && (l[j] == '.' || l[j] == ')') && l[j + 1] == ' ') { list = 1; body = j + 2; }
    }
    size_t pend;
    long pts;
    long at = (heading || list) ? gr_find_points(l + body, n - body, &pend, &pts) : -1;
    if (at < 0) {
        if (heading && hashes == 1 && !r->title[0]) gr_clean_name(l + body, n - body, r->title, sizeof r->title);
        /* a heading without points closes a heading item's description */
        if (heading) { if (*form == GR_HEADING) *cur = NULL; return 0; }
        if (*cur && n > 0 && gr_append(&(*cur)->description, l, n)) { gr_errf(err, errlen, "out of memory"); return -1; }
        return 0;
    }
    int f = heading ? GR_HEADING : GR_LIST;
    if (*form && *form != f) {
        gr_errf(err, errlen, "line %d: items are written both as headings and as list entries; use one form", lineno);
        return -1;
    }
    *form = f;
    if (r->n_items >= GRADE_MAX_ITEMS) { gr_errf(err, errlen, "line %d: more than %d rubric items", lineno, GRADE_MAX_ITEMS); return -1; }
    if (pts < 1 || pts > GRADE_MAX_POINTS) {
        gr_errf(err, errlen, "line %d: an item is worth 1 to %d points, not %ld", lineno, GRADE_MAX_POINTS, pts);
        return -1;
    }
    grade_item *it = &r->items[r->n_items];
    memset(it, 0, sizeof *it);
    gr_clean_name(l + body, (size_t)at, it->name, sizeof it->name);
    if (!it->name[0]) { gr_errf(err, errlen, "line %d: a rubric item needs a name before its points", lineno); return -1; }
    for (int k = 0; k < r->n_items; k++)
        if (!strcmp(r->items[k].name, it->name)) {
            gr_errf(err, errlen, "line %d: rubric item \"%s\" appears twice", lineno, it->name);
            return -1;
        }
    it->max_points = (int)pts;
    r->n_items++;
    gr_make_key(r, it);
    r->max_total += it->max_points;
    /* the rest of a list entry's line ("(5 pts): checks input") is its description */
    const char *rest = l + body + pend;
    size_t rn = n - body - pend;
    while (rn && (*rest == ' ' || *rest == ':' || *rest == '-' || *rest == '\t')) { rest++; rn--; }
    it->description = gr_strndup_trim(rest, rn);
    if (!it->description) { gr_errf(err, errlen, "out of memory"); return -1; }
    if (!it->description[0]) { free(it->description); it->description = NULL; }
    *cur = it;
    return 1;
}

int grade_rubric_parse(const char *text, size_t len, grade_rubric *r, char *err, size_t errlen) {
    memset(r, 0, sizeof *r);
    if (len > GRADE_MAX_RUBRIC_BYTES) { gr_errf(err, errlen, "the rubric is %zu bytes (at most %d)", len, GRADE_MAX_RUBRIC_BYTES); return -1; }
    r->text = grade_utf8_clean(text, len);
    r->items = calloc(GRADE_MAX_ITEMS, sizeof *r->items);
    if (!r->text || !r->items) { gr_errf(err, errlen, "out of memory"); grade_rubric_free(r); return -1; }
    int form = GR_NONE, lineno = 0;
    grade_item *cur = NULL;
    const char *p = r->text;
    int in_fence = 0;
    while (*p) {
        const char *e = strchr(p, '\n');
        size_t n = e ? (size_t)(e - p) : strlen(p);
        size_t ln = n;
        if (ln && p[ln - 1] == '\r') ln--;
        lineno++;
        /* code blocks in a rubric are examples, never items */
        if (ln >= 3 && !strncmp(p, "```", 3)) in_fence = !in_fence;
        if (in_fence) {
            if (cur && gr_append(&cur->description, p, ln)) { gr_errf(err, errlen, "out of memory"); grade_rubric_free(r); return -1; }
        } else if (gr_rubric_line(r, p, ln, lineno, &form, &cur, err, errlen) < 0) {
            grade_rubric_free(r);
            return -1;
        }
        p += n + (e ? 1 : 0);
    }
    if (r->n_items == 0) {
        gr_errf(err, errlen, "no rubric items found: write items as \"## Name (N points)\" or \"- Name (N pts): description\"");
        grade_rubric_free(r);
        return -1;
    }
    for (int i = 0; i < r->n_items; i++) {
        char *d = r->items[i].description;
        if (d) { char *t = gr_strndup_trim(d, strlen(d)); free(d); r->items[i].description = t; }
    }
    return 0;
}

void grade_rubric_free(grade_rubric *r) {
    if (r->items)
        for (int i = 0; i < r->n_items; i++) free(r->items[i].description);
    free(r->items);
    free(r->text);
    memset(r, 0, sizeof *r);
}

/* Caps in the derived schema (characters; problems listed). A bounded
 * string is printable ASCII without escapes (src/grammar.c). */
#define GR_MAX_JUSTIFICATION 200
#define GR_MAX_FILE_NAME 100
#define GR_MAX_PROBLEMS 10

json_t *grade_rubric_schema(const grade_rubric *r) {
    json_t *props = json_object(), *req = json_array();
    for (int i = 0; i < r->n_items; i++) {
        json_t *item = json_pack("{s:s, s:{s:{s:s, s:i, s:i}, s:{s:s, s:i}}, s:[s,s], s:b}",
                                 "type", "object", "properties",
                                 "score", "type", "integer", "minimum", 0, "maximum", r->items[i].max_points,
                                 "justification", "type", "string", "maxLength", GR_MAX_JUSTIFICATION,
                                 "required", "score", "justification", "additionalProperties", 0);
        json_object_set_new(props, r->items[i].key, item);
        json_array_append_new(req, json_string(r->items[i].key));
    }
    json_t *problem = json_pack("{s:s, s:{s:{s:s, s:i}, s:{s:s, s:i}, s:{s:s, s:i}}, s:[s,s,s], s:b}",
                                "type", "object", "properties",
                                "file", "type", "string", "maxLength", GR_MAX_FILE_NAME,
                                "line", "type", "integer", "minimum", 1,
                                "description", "type", "string", "maxLength", GR_MAX_JUSTIFICATION,
                                "required", "file", "line", "description", "additionalProperties", 0);
    /* Problems and texts are capped: an analysis lists what matters in a
     * sentence or two, and constrained decoding then always closes the
     * JSON (a bounded string must end by its maxLength) before a runaway
     * list or text eats the token budget. */
    return json_pack("{s:s, s:{s:{s:s, s:o, s:o, s:b}, s:{s:s, s:i, s:i}, s:{s:s, s:o, s:i}}, s:[s,s,s], s:b}",
                     "type", "object", "properties",
                     "scores", "type", "object", "properties", props, "required", req, "additionalProperties", 0,
                     "total", "type", "integer", "minimum", 0, "maximum", r->max_total,
                     "problems", "type", "array", "items", problem, "maxItems", GR_MAX_PROBLEMS,
                     "required", "scores", "total", "problems", "additionalProperties", 0);
}

/* ==== Schema validation ==== */

/* Nesting bound: a schema is a tree, but $ref can loop. */
#define GR_MAX_DEPTH 64

static int gr_is_integral(json_t *v) {
    if (json_is_integer(v)) return 1;
    if (!json_is_real(v)) return 0;
    double d = json_real_value(v);
    return isfinite(d) && floor(d) == d;
}

static int gr_type_matches(const char *t, json_t *v) {
    if (!strcmp(t, "object")) return json_is_object(v);
    if (!strcmp(t, "array")) return json_is_array(v);
    if (!strcmp(t, "string")) return json_is_string(v);
    if (!strcmp(t, "integer")) return gr_is_integral(v);
    if (!strcmp(t, "number")) return json_is_number(v);
    if (!strcmp(t, "boolean")) return json_is_boolean(v);
    if (!strcmp(t, "null")) return json_is_null(v);
    return -1;
}

static const char *gr_kind(json_t *v) {
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

typedef struct {
    json_t *root;
    char *err;
    size_t errlen;
} gr_vctx;

static int gr_validate(gr_vctx *c, json_t *s, json_t *v, const char *path, int depth);

static int gr_check_keywords(gr_vctx *c, json_t *s, const char *path) {
    static const char *const known[] = {"type", "properties", "required", "additionalProperties", "items",
                                        "minItems", "maxItems", "minLength", "maxLength", "enum", "const",
                                        "minimum", "maximum",
                                        "anyOf", "$ref", "$defs", "title", "description"};
    const char *k;
    json_t *x;
    json_object_foreach(s, k, x) {
        int ok = 0;
        for (size_t i = 0; i < sizeof known / sizeof known[0]; i++) ok |= !strcmp(k, known[i]);
        if (!ok) { gr_errf(c->err, c->errlen, "schema at %s: unsupported keyword \"%s\"", path, k); return -1; }
    }
    return 0;
}

static int gr_v_type(gr_vctx *c, json_t *t, json_t *v, const char *path) {
    if (!t) return 0;
    if (json_is_string(t)) {
        int m = gr_type_matches(json_string_value(t), v);
        if (m < 0) { gr_errf(c->err, c->errlen, "schema at %s: unknown type \"%s\"", path, json_string_value(t)); return -1; }
        if (!m) { gr_errf(c->err, c->errlen, "%s: expected %s, got %s", path, json_string_value(t), gr_kind(v)); return -1; }
        return 0;
    }
    if (!json_is_array(t)) { gr_errf(c->err, c->errlen, "schema at %s: \"type\" must be a string or an array", path); return -1; }
    size_t i;
    json_t *e;
    json_array_foreach(t, i, e) {
        int m = json_is_string(e) ? gr_type_matches(json_string_value(e), v) : -1;
        if (m < 0) { gr_errf(c->err, c->errlen, "schema at %s: bad entry in \"type\"", path); return -1; }
        if (m) return 0;
    }
    gr_errf(c->err, c->errlen, "%s: %s is none of the allowed types", path, gr_kind(v));
    return -1;
}

static int gr_v_object(gr_vctx *c, json_t *s, json_t *v, const char *path, int depth) {
    json_t *props = json_object_get(s, "properties"), *req = json_object_get(s, "required");
    json_t *addl = json_object_get(s, "additionalProperties");
    if (props && !json_is_object(props)) { gr_errf(c->err, c->errlen, "schema at %s: \"properties\" must be an object", path); return -1; }
    if (req && !json_is_array(req)) { gr_errf(c->err, c->errlen, "schema at %s: \"required\" must be an array", path); return -1; }
    if (!json_is_object(v)) return 0;
    char sub[512];
    size_t i;
    json_t *e;
    json_array_foreach(req, i, e) {
        if (!json_is_string(e)) { gr_errf(c->err, c->errlen, "schema at %s: \"required\" holds a non-string", path); return -1; }
        if (!json_object_get(v, json_string_value(e))) {
            gr_errf(c->err, c->errlen, "%s: missing required property \"%s\"", path, json_string_value(e));
            return -1;
        }
    }
    const char *k;
    json_t *x;
    json_object_foreach(v, k, x) {
        snprintf(sub, sizeof sub, "%s.%.200s", path, k);
        json_t *ps = props ? json_object_get(props, k) : NULL;
        if (ps) { if (gr_validate(c, ps, x, sub, depth + 1)) return -1; continue; }
        if (json_is_false(addl)) { gr_errf(c->err, c->errlen, "%s: property \"%.200s\" is not allowed", path, k); return -1; }
        if (json_is_object(addl) && gr_validate(c, addl, x, sub, depth + 1)) return -1;
    }
    return 0;
}

static int gr_v_array(gr_vctx *c, json_t *s, json_t *v, const char *path, int depth) {
    json_t *items = json_object_get(s, "items"), *mn = json_object_get(s, "minItems"), *mx = json_object_get(s, "maxItems");
    if ((mn && !json_is_integer(mn)) || (mx && !json_is_integer(mx))) {
        gr_errf(c->err, c->errlen, "schema at %s: minItems/maxItems must be integers", path);
        return -1;
    }
    if (!json_is_array(v)) return 0;
    long long n = (long long)json_array_size(v);
    if (mn && n < json_integer_value(mn)) { gr_errf(c->err, c->errlen, "%s: %lld items, at least %lld needed", path, n, json_integer_value(mn)); return -1; }
    if (mx && n > json_integer_value(mx)) { gr_errf(c->err, c->errlen, "%s: %lld items, at most %lld allowed", path, n, json_integer_value(mx)); return -1; }
    if (!items) return 0;
    char sub[512];
    size_t i;
    json_t *e;
    json_array_foreach(v, i, e) {
        snprintf(sub, sizeof sub, "%s[%zu]", path, i);
        if (gr_validate(c, items, e, sub, depth + 1)) return -1;
    }
    return 0;
}

static int gr_v_values(gr_vctx *c, json_t *s, json_t *v, const char *path) {
    json_t *en = json_object_get(s, "enum"), *cn = json_object_get(s, "const");
    json_t *mn = json_object_get(s, "minimum"), *mx = json_object_get(s, "maximum");
    if (en) {
        if (!json_is_array(en)) { gr_errf(c->err, c->errlen, "schema at %s: \"enum\" must be an array", path); return -1; }
        int hit = 0;
        size_t i;
        json_t *e;
        json_array_foreach(en, i, e) hit |= json_equal(e, v);
        if (!hit) { gr_errf(c->err, c->errlen, "%s: value is not one of the enum", path); return -1; }
    }
    if (cn && !json_equal(cn, v)) { gr_errf(c->err, c->errlen, "%s: value differs from the const", path); return -1; }
    if ((mn && !json_is_number(mn)) || (mx && !json_is_number(mx))) {
        gr_errf(c->err, c->errlen, "schema at %s: minimum/maximum must be numbers", path);
        return -1;
    }
    json_t *mnl = json_object_get(s, "minLength"), *mxl = json_object_get(s, "maxLength");
    if (json_is_string(v)) {
        /* characters, not bytes (JSON Schema counts code points) */
        size_t n = 0;
        for (const unsigned char *p = (const unsigned char *)json_string_value(v); *p; p++) n += (*p & 0xC0) != 0x80;
        if (mxl && (!json_is_integer(mxl) || (json_int_t)n > json_integer_value(mxl))) {
            gr_errf(c->err, c->errlen, "%s: string longer than maxLength", path);
            return -1;
        }
        if (mnl && (!json_is_integer(mnl) || (json_int_t)n < json_integer_value(mnl))) {
            gr_errf(c->err, c->errlen, "%s: string shorter than minLength", path);
            return -1;
        }
    }
    if (json_is_number(v)) {
        double d = json_number_value(v);
        if (mn && d < json_number_value(mn)) { gr_errf(c->err, c->errlen, "%s: %g is below the minimum %g", path, d, json_number_value(mn)); return -1; }
        if (mx && d > json_number_value(mx)) { gr_errf(c->err, c->errlen, "%s: %g is above the maximum %g", path, d, json_number_value(mx)); return -1; }
    }
    return 0;
}

static int gr_v_ref(gr_vctx *c, json_t *ref, json_t *v, const char *path, int depth) {
    const char *r = json_string_value(ref);
    json_t *target = NULL;
    if (r && !strncmp(r, "#/$defs/", 8)) target = json_object_get(json_object_get(c->root, "$defs"), r + 8);
    if (!json_is_object(target)) { gr_errf(c->err, c->errlen, "schema at %s: unresolvable $ref", path); return -1; }
    return gr_validate(c, target, v, path, depth + 1);
}

static int gr_v_anyof(gr_vctx *c, json_t *any, json_t *v, const char *path, int depth) {
    if (!json_is_array(any) || json_array_size(any) == 0) {
        gr_errf(c->err, c->errlen, "schema at %s: \"anyOf\" must be a non-empty array", path);
        return -1;
    }
    size_t i;
    json_t *e;
    char first[256] = "";
    json_array_foreach(any, i, e) {
        if (gr_validate(c, e, v, path, depth + 1) == 0) return 0;
        if (!strncmp(c->err, "schema", 6)) return -1;   /* a broken branch is the schema's fault */
        if (i == 0) snprintf(first, sizeof first, "%s", c->err);
    }
    gr_errf(c->err, c->errlen, "%s: matches no branch of anyOf (first: %s)", path, first);
    return -1;
}

static int gr_validate(gr_vctx *c, json_t *s, json_t *v, const char *path, int depth) {
    if (depth > GR_MAX_DEPTH) { gr_errf(c->err, c->errlen, "schema at %s: nested deeper than %d", path, GR_MAX_DEPTH); return -1; }
    if (json_is_true(s)) return 0;
    if (json_is_false(s)) { gr_errf(c->err, c->errlen, "%s: no value is allowed here", path); return -1; }
    if (!json_is_object(s)) { gr_errf(c->err, c->errlen, "schema at %s: not an object", path); return -1; }
    if (gr_check_keywords(c, s, path)) return -1;
    json_t *ref = json_object_get(s, "$ref"), *any = json_object_get(s, "anyOf");
    if (ref && gr_v_ref(c, ref, v, path, depth)) return -1;
    if (any && gr_v_anyof(c, any, v, path, depth)) return -1;
    if (gr_v_type(c, json_object_get(s, "type"), v, path)) return -1;
    if (gr_v_values(c, s, v, path)) return -1;
    if (gr_v_object(c, s, v, path, depth)) return -1;
    return gr_v_array(c, s, v, path, depth);
}

int grade_schema_validate(json_t *schema, json_t *v, char *err, size_t errlen) {
    char dummy[8];
    gr_vctx c = { .root = schema, .err = err ? err : dummy, .errlen = err ? errlen : sizeof dummy };
    c.err[0] = 0;
    return gr_validate(&c, schema, v, "$", 0);
}

json_t *grade_analysis_parse(const grade_rubric *r, json_t *schema, const char *text, char *err, size_t errlen) {
    (void)r;
    if (!text || !*text) { gr_errf(err, errlen, "the analysis is empty"); return NULL; }
    json_error_t je;
    json_t *o = json_loads(text, JSON_REJECT_DUPLICATES, &je);
    if (!o) {
        /* a model without constrained decoding may wrap the object in a
         * ```json fence or a sentence: try the outermost braces */
        const char *a = strchr(text, '{'), *b = strrchr(text, '}');
        if (a && b && b > a) o = json_loadb(a, (size_t)(b - a + 1), JSON_REJECT_DUPLICATES, NULL);
    }
    if (!o) { gr_errf(err, errlen, "not JSON: %s (line %d, column %d)", je.text, je.line, je.column); return NULL; }
    if (grade_schema_validate(schema, o, err, errlen)) { json_decref(o); return NULL; }
    return o;
}

/* ==== Prompt templates ==== */

const char grade_default_analysis_template[] =
    "[system]\n"
    "You are a careful teaching assistant who grades programming assignments against a rubric.\n"
    "\n"
    "Rubric:\n"
    "{{rubric}}\n"
    "\n"
    "Grade the submission the user sends against every rubric item. Answer with one JSON object and\n"
    "nothing else, following this JSON schema:\n"
    "{{schema}}\n"
    "\n"
    "\"scores\" has one entry per rubric item ({{items}}): an integer \"score\" from 0 to the item's\n"
    "points and a \"justification\" of one or two sentences. \"total\" is the sum of the scores (at most\n"
    "{{max_total}}). \"problems\" lists concrete defects, each with the file and the line number shown\n"
    "in the listing.\n"
    "[user]\n"
    "Submission \"{{name}}\":\n"
    "\n"
    "{{submission}}\n";

const char grade_default_feedback_template[] =
    "[system]\n"
    "You are a kind and precise teacher writing feedback to a student about a programming assignment.\n"
    "The assignment is graded with this rubric:\n"
    "\n"
    "{{rubric}}\n"
    "\n"
    "Write to the student directly (\"you\"), in plain prose of three short paragraphs: what works well,\n"
    "what to fix first (name the file and line numbers from the listing), and one concrete next step.\n"
    "Do not give a score: another reviewer assigns the scores.\n"
    "[user]\n"
    "My submission (\"{{name}}\"):\n"
    "\n"
    "{{submission}}\n";

static const char *const gr_vars[] = {"rubric", "schema", "items", "max_total", "name", "submission"};

/* Checks every {{...}} of a section; *uses is a bit set over gr_vars. */
static int gr_template_scan(const char *s, const char *section, unsigned *uses, char *err, size_t errlen) {
    *uses = 0;
    for (const char *p = strstr(s, "{{"); p; p = strstr(p + 2, "{{")) {
        const char *e = strstr(p + 2, "}}");
        size_t n = e ? (size_t)(e - p - 2) : 0;
        int k = -1;
        for (int i = 0; e && i < (int)(sizeof gr_vars / sizeof gr_vars[0]); i++)
            if (strlen(gr_vars[i]) == n && !strncmp(p + 2, gr_vars[i], n)) k = i;
        if (k < 0) {
            gr_errf(err, errlen, "unknown placeholder \"%.40s\" in the %s section (known: {{rubric}}, {{schema}}, "
                    "{{items}}, {{max_total}}, {{name}}, {{submission}})", p, section);
            return -1;
        }
        *uses |= 1u << k;
    }
    return 0;
}

int grade_template_parse(const char *text, grade_template *t, char *err, size_t errlen) {
    memset(t, 0, sizeof *t);
    const char *sys = NULL, *usr = NULL, *sys_end = NULL, *usr_end = NULL;
    const char *p = text;
    const char *end = text + strlen(text);
    while (p < end) {
        const char *e = strchr(p, '\n');
        if (!e) e = end;
        size_t n = (size_t)(e - p);
        while (n && (p[n - 1] == '\r' || p[n - 1] == ' ')) n--;
        const char *next = e < end ? e + 1 : end;
        if (n == 8 && !strncmp(p, "[system]", 8)) {
            if (sys) { gr_errf(err, errlen, "the template has two [system] sections"); return -1; }
            if (usr && !usr_end) usr_end = p;
            sys = next;
        } else if (n == 6 && !strncmp(p, "[user]", 6)) {
            if (usr) { gr_errf(err, errlen, "the template has two [user] sections"); return -1; }
            if (sys && !sys_end) sys_end = p;
            usr = next;
        } else if (!sys && !usr && n > 0) {
            gr_errf(err, errlen, "template text before the first [system] or [user] line");
            return -1;
        }
        p = next;
    }
    if (!usr) { gr_errf(err, errlen, "the template has no [user] section"); return -1; }
    if (sys && !sys_end) sys_end = end;
    if (!usr_end) usr_end = end;
    t->system = sys ? gr_strndup_trim(sys, (size_t)(sys_end - sys)) : strdup("");
    t->user = gr_strndup_trim(usr, (size_t)(usr_end - usr));
    if (!t->system || !t->user) { grade_template_free(t); gr_errf(err, errlen, "out of memory"); return -1; }
    unsigned su, uu;
    if (gr_template_scan(t->system, "[system]", &su, err, errlen) || gr_template_scan(t->user, "[user]", &uu, err, errlen)) {
        grade_template_free(t);
        return -1;
    }
    /* bits 4 and 5: {{name}}, {{submission}} */
    if (su & (3u << 4)) {
        gr_errf(err, errlen, "{{name}} and {{submission}} belong in the [user] section: the [system] section is "
                "the prefix every request of the class shares (and the nodes cache)");
        grade_template_free(t);
        return -1;
    }
    if (!(uu & (1u << 5))) {
        gr_errf(err, errlen, "the [user] section has no {{submission}}");
        grade_template_free(t);
        return -1;
    }
    return 0;
}

void grade_template_free(grade_template *t) {
    free(t->system);
    free(t->user);
    t->system = t->user = NULL;
}

/* Index of the placeholder starting at p, or -1. */
static int gr_placeholder_at(const char *p) {
    if (p[0] != '{' || p[1] != '{') return -1;
    for (int i = 0; i < (int)(sizeof gr_vars / sizeof gr_vars[0]); i++) {
        size_t l = strlen(gr_vars[i]);
        if (!strncmp(p + 2, gr_vars[i], l) && !strncmp(p + 2 + l, "}}", 2)) return i;
    }
    return -1;
}

/* Renders into out (when not NULL); returns the length. */
static size_t gr_render_into(const char *s, const char *const *vals, char *out) {
    size_t n = 0;
    for (const char *p = s; *p;) {
        int k = gr_placeholder_at(p);
        if (k < 0) { if (out) out[n] = *p; n++; p++; continue; }
        const char *val = vals[k] ? vals[k] : "";
        size_t l = strlen(val);
        if (out) memcpy(out + n, val, l);
        n += l;
        p += 4 + strlen(gr_vars[k]);
    }
    return n;
}

char *grade_template_render(const char *s, const grade_vars *v) {
    const char *vals[] = {v->rubric, v->schema, v->items, v->max_total, v->name, v->submission};
    size_t n = gr_render_into(s, vals, NULL);
    char *out = malloc(n + 1);
    if (!out) return NULL;
    gr_render_into(s, vals, out);
    out[n] = 0;
    return out;
}

/* grammar_schema.c - the JSON Schema subset compiled to grammar.c's rules:
 * known and inert keywords, $ref resolution (memoised, so recursive schemas
 * become recursive rules), enum/const, arrays, objects (required and
 * optional properties in order), integer and number bounds (grammar_range.c),
 * strings with length bounds, "pattern" and "format" (grammar_text.c's
 * regular expressions), type lists; and the schema entry points
 * (grammar_compile_schema, grammar_compile_schema_at). A refused keyword is
 * named with its JSON pointer.
 */
#include "engine/grammar_internal.h"

#include <math.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

/* ==== Errors ==== */

/* A refusal of one keyword: gfail, remembering the keyword and where it
 * stands (grammar_compile_schema_at reports them). */
static int gfail_kw(gctx *c, const char *kw, const char *fmt, ...) __attribute__((format(printf, 3, 4)));
static int gfail_kw(gctx *c, const char *kw, const char *fmt, ...)
{
    if (!c->failed) {
        snprintf(c->bad_kw, sizeof c->bad_kw, "%s", kw);
        snprintf(c->bad_at, sizeof c->bad_at, "%s", c->path);
    }
    va_list ap;
    va_start(ap, fmt);
    gvfail(c, fmt, ap);
    va_end(ap);
    return -1;
}

/* ==== Schema compiler ==== */

static const char *const sch_known[] = {
    "type", "properties", "required", "additionalProperties", "items", "minItems", "maxItems",
    "minLength", "maxLength", "enum", "const", "minimum", "maximum", "exclusiveMinimum", "exclusiveMaximum",
    "anyOf", "allOf", "$ref", "$defs", "definitions", "pattern", "format",
    /* annotations: no effect on validity */
    "title", "description", "default", "examples", "$schema", "$id", "$comment",
    "deprecated", "readOnly", "writeOnly", NULL
};
/* Keywords that may stand beside $ref/anyOf (they constrain nothing). */
static const char *const sch_inert[] = {
    "$defs", "definitions", "title", "description", "default", "examples", "$schema", "$id",
    "$comment", "deprecated", "readOnly", "writeOnly", NULL
};

static int in_list(const char *const *l, const char *k)
{
    for (; *l; l++)
        if (!strcmp(*l, k)) return 1;
    return 0;
}

static size_t path_push(gctx *c, const char *a, const char *b)
{
    size_t old = c->plen;
    const char *segs[2] = { a, b };
    for (int i = 0; i < 2 && segs[i]; i++) {
        if (c->plen + 1 < sizeof c->path) c->path[c->plen++] = '/';
        for (const char *p = segs[i]; *p && c->plen + 2 < sizeof c->path; p++) {
            if (*p == '~' || *p == '/') {   /* JSON pointer escapes */
                c->path[c->plen++] = '~';
                c->path[c->plen++] = *p == '~' ? '0' : '1';
            } else {
                c->path[c->plen++] = *p;
            }
        }
    }
    c->path[c->plen] = 0;
    return old;
}

static void path_pop(gctx *c, size_t old)
{
    c->plen = old;
    c->path[old] = 0;
}

static int64_t sch_compile(gctx *c, const json_t *s);

static int64_t sch_sub(gctx *c, const json_t *s, const char *k1, const char *k2)
{
    size_t old = path_push(c, k1, k2);
    int64_t r = sch_compile(c, s);
    path_pop(c, old);
    return r;
}

static const json_t *ref_resolve(const json_t *root, const char *ref)
{
    if (ref[0] != '#') return NULL;
    const json_t *cur = root;
    const char *p = ref + 1;
    if (*p && *p != '/') return NULL;
    while (*p == '/') {
        p++;
        char seg[256];
        size_t n = 0;
        for (; *p && *p != '/'; p++) {
            char ch = *p;
            if (ch == '~') {
                if (p[1] == '0') ch = '~';
                else if (p[1] == '1') ch = '/';
                else return NULL;
                p++;
            }
            if (n + 1 >= sizeof seg) return NULL;
            seg[n++] = ch;
        }
        seg[n] = 0;
        if (json_is_object(cur)) {
            cur = json_object_get(cur, seg);
        } else if (json_is_array(cur)) {
            char *end;
            unsigned long i = strtoul(seg, &end, 10);
            cur = *seg && !*end ? json_array_get(cur, i) : NULL;
        } else {
            return NULL;
        }
        if (!cur) return NULL;
    }
    return cur;
}

static int64_t sch_ref(gctx *c, const char *ref)
{
    for (uint32_t i = 0; i < c->n_refs; i++)
        if (!strcmp(c->refs[i].ptr, ref)) return c->refs[i].rule;
    const json_t *target = ref_resolve(c->root, ref);
    if (!target) return gfail(c, "$ref '%s' at %s does not resolve (only local '#/...' references)", ref, c->path);
    int64_t r = rule_new(c);
    if (r < 0 || grow((void **)&c->refs, &c->cap_refs, c->n_refs + 1, sizeof *c->refs)) return gfail(c, "out of memory");
    char *dup = strdup(ref);
    if (!dup) return gfail(c, "out of memory");
    c->refs[c->n_refs++] = (refmemo){ dup, (uint32_t)r };
    char saved[sizeof c->path];
    size_t saved_len = c->plen;
    memcpy(saved, c->path, sizeof saved);
    snprintf(c->path, sizeof c->path, "%s", ref);
    c->plen = strlen(c->path);
    int64_t body = sch_compile(c, target);
    memcpy(c->path, saved, sizeof saved);
    c->plen = saved_len;
    seq s = { 0 };
    seq_ref(c, &s, body);
    alts a = { 0 };
    seq *t = alt_new(c, &a);
    if (t) *t = s;
    else free(s.e);
    if (rule_def(c, r, &a)) return -1;
    return r;
}

/* Refuse keywords beside $ref/anyOf/allOf that would need an intersection. */
static int sch_only_inert(gctx *c, const json_t *s, const char *kw)
{
    const char *k;
    const json_t *v;
    json_object_foreach((json_t *)s, k, v) {
        if (strcmp(k, kw) && !in_list(sch_inert, k))
            return gfail_kw(c, k, "unsupported keyword '%s' beside '%s' at %s", k, kw, c->path);
    }
    return 0;
}

static int json_type_ok(const json_t *v, const char *type)
{
    if (!strcmp(type, "object")) return json_is_object(v);
    if (!strcmp(type, "array")) return json_is_array(v);
    if (!strcmp(type, "string")) return json_is_string(v);
    if (!strcmp(type, "integer"))
        return json_is_integer(v) || (json_is_real(v) && json_real_value(v) == floor(json_real_value(v)));
    if (!strcmp(type, "number")) return json_is_number(v);
    if (!strcmp(type, "boolean")) return json_is_boolean(v);
    if (!strcmp(type, "null")) return json_is_null(v);
    return 0;
}

static int type_allows(const json_t *type, const json_t *v)
{
    if (!type) return 1;
    if (json_is_string(type)) return json_type_ok(v, json_string_value(type));
    size_t i;
    const json_t *t;
    json_array_foreach(type, i, t)
        if (json_is_string(t) && json_type_ok(v, json_string_value(t))) return 1;
    return 0;
}

/* enum / const: the compact serialisations of the values as literals. */
static int64_t sch_enum(gctx *c, const json_t *vals, int n, const json_t *type, const char *kw)
{
    alts a = { 0 };
    for (int i = 0; i < n; i++) {
        const json_t *v = json_is_array(vals) && !strcmp(kw, "enum") ? json_array_get(vals, (size_t)i) : vals;
        if (!type_allows(type, v)) continue;
        char *txt = json_dumps(v, JSON_COMPACT | JSON_ENCODE_ANY);
        if (!txt) {
            alts_free(&a);
            return gfail(c, "out of memory");
        }
        seq *t = alt_new(c, &a);
        if (t) seq_str(c, t, txt);
        free(txt);
    }
    if (!a.n && !c->failed) return gfail(c, "'%s' at %s has no value of the given type", kw, c->path);
    return rule_make(c, &a);
}

static int get_count(gctx *c, const json_t *s, const char *kw, int64_t *out)
{
    const json_t *v = json_object_get(s, kw);
    if (!v) return 0;
    double d = json_number_value(v);
    if (!json_is_number(v) || d < 0 || d != floor(d))
        return gfail(c, "'%s' at %s must be a non-negative integer", kw, c->path);
    if (d > G_MAX_LIST) return gfail(c, "'%s' at %s above %d is not supported", kw, c->path, G_MAX_LIST);
    *out = (int64_t)d;
    return 0;
}

/* "[" ws ( item ws ( "," ws item ws ){min-1..max-1} )? "]" */
static int64_t sch_array(gctx *c, const json_t *s)
{
    const json_t *items = json_object_get(s, "items");
    int64_t mn = 0, mx = -1;
    if (get_count(c, s, "minItems", &mn) || get_count(c, s, "maxItems", &mx)) return -1;
    if (mx >= 0 && mn > mx) return gfail(c, "minItems > maxItems at %s", c->path);
    if (items && !json_is_object(items) && !json_is_boolean(items))
        return gfail_kw(c, "items", "unsupported keyword 'items' (tuple form) at %s", c->path);
    if (json_is_false(items) && mn > 0) return gfail(c, "'items' false with minItems at %s", c->path);
    if (json_is_false(items)) mx = 0;
    int64_t val = items && !json_is_boolean(items) ? sch_sub(c, items, "items", NULL) : rule_value(c);
    int64_t ws = rule_ws(c);
    if (val < 0) return -1;
    if (mn == 0 && mx < 0) return rule_list_any(c, val);
    /* after[k]: k items written; one more needs "," first */
    int64_t next = -1;
    if (mx < 0) {   /* unbounded: the star tail after min items */
        next = c->failed ? -1 : rule_new(c);
        alts a = { 0 };
        alt_new(c, &a);
        seq *t = alt_new(c, &a);
        if (t && !seq_str(c, t, ",") && !seq_ref(c, t, ws) && !seq_ref(c, t, val) && !seq_ref(c, t, ws))
            seq_ref(c, t, next);
        rule_def(c, next, &a);
    }
    int64_t top = mx < 0 ? mn - 1 : mx;
    for (int64_t k = top; k >= 1 && !c->failed; k--) {
        alts a = { 0 };
        seq *t;
        if (k >= mn) alt_new(c, &a);
        if ((k < mx || mx < 0) && (t = alt_new(c, &a)) && !seq_str(c, t, ",") && !seq_ref(c, t, ws) &&
            !seq_ref(c, t, val) && !seq_ref(c, t, ws) && next >= 0)
            seq_ref(c, t, next);
        next = rule_make(c, &a);
    }
    alts b = { 0 };
    seq *t;
    if (mn == 0) alt_new(c, &b);
    if (mx != 0 && (t = alt_new(c, &b)) && !seq_ref(c, t, val) && !seq_ref(c, t, ws)) seq_ref(c, t, next);
    int64_t body = rule_make(c, &b);
    seq o = { 0 };
    if (!seq_str(c, &o, "[") && !seq_ref(c, &o, ws) && !seq_ref(c, &o, body)) seq_str(c, &o, "]");
    return rule_seq(c, &o);
}

typedef struct {
    const char *name;
    const json_t *schema;   /* NULL: any value */
    int required;
} gprop;

/* Properties in declared order (then required names not declared), each
 * optional one skippable: first[i] = nothing written yet, rest[i] = some
 * property written, both for properties i.. still to come. */
static int64_t sch_object_props(gctx *c, gprop *p, int n)
{
    int64_t ws = rule_ws(c);
    int64_t *kv = calloc((size_t)n + 1, sizeof *kv);
    if (!kv) return gfail(c, "out of memory");
    for (int i = 0; i < n && !c->failed; i++) {
        int64_t val = p[i].schema ? sch_sub(c, p[i].schema, "properties", p[i].name) : rule_value(c);
        json_t *key = json_string(p[i].name);
        char *txt = key ? json_dumps(key, JSON_ENCODE_ANY) : NULL;
        json_decref(key);
        if (!txt) {
            gfail(c, "out of memory");
            break;
        }
        seq s = { 0 };
        if (!seq_str(c, &s, txt) && !seq_ref(c, &s, ws) && !seq_str(c, &s, ":") && !seq_ref(c, &s, ws) &&
            !seq_ref(c, &s, val))
            seq_ref(c, &s, ws);
        free(txt);
        kv[i] = rule_seq(c, &s);
    }
    int64_t rest = -1, first = -1;
    for (int i = n; i >= 0 && !c->failed; i--) {
        alts ra = { 0 }, fa = { 0 };
        seq *t;
        if (i == n) {
            alt_new(c, &ra);
            alt_new(c, &fa);
        } else {
            if ((t = alt_new(c, &ra)) && !seq_str(c, t, ",") && !seq_ref(c, t, ws) && !seq_ref(c, t, kv[i]))
                seq_ref(c, t, rest);
            if (!p[i].required && (t = alt_new(c, &ra))) seq_ref(c, t, rest);
            if ((t = alt_new(c, &fa)) && !seq_ref(c, t, kv[i])) seq_ref(c, t, rest);
            if (!p[i].required && (t = alt_new(c, &fa))) seq_ref(c, t, first);
        }
        rest = rule_make(c, &ra);
        first = rule_make(c, &fa);
    }
    free(kv);
    seq o = { 0 };
    if (!seq_str(c, &o, "{") && !seq_ref(c, &o, ws) && !seq_ref(c, &o, first)) seq_str(c, &o, "}");
    return rule_seq(c, &o);
}

static int64_t sch_object(gctx *c, const json_t *s)
{
    const json_t *props = json_object_get(s, "properties");
    const json_t *req = json_object_get(s, "required");
    const json_t *addl = json_object_get(s, "additionalProperties");
    if (props && !json_is_object(props)) return gfail(c, "'properties' at %s must be an object", c->path);
    if (req && !json_is_array(req)) return gfail(c, "'required' at %s must be an array", c->path);
    if (addl && !json_is_object(addl) && !json_is_boolean(addl))
        return gfail(c, "'additionalProperties' at %s must be a schema", c->path);
    size_t nreq = req ? json_array_size(req) : 0, np = props ? json_object_size(props) : 0;
    if (np + nreq > G_MAX_LIST) return gfail(c, "too many properties at %s", c->path);
    for (size_t i = 0; i < nreq; i++)
        if (!json_is_string(json_array_get(req, i)))
            return gfail(c, "'required' at %s must hold strings", c->path);
    if (!np && !nreq) {
        if (json_is_object(addl)) return rule_map(c, sch_sub(c, addl, "additionalProperties", NULL));
        if (json_is_false(addl)) return sch_object_props(c, NULL, 0);   /* "{" ws "}" */
        rule_value(c);
        return c->r_obj;
    }
    gprop *p = calloc(np + nreq, sizeof *p);
    if (!p) return gfail(c, "out of memory");
    int n = 0;
    const char *k;
    const json_t *v;
    json_object_foreach((json_t *)props, k, v) p[n++] = (gprop){ k, v, 0 };
    for (size_t i = 0; i < nreq; i++) {
        const char *name = json_string_value(json_array_get(req, i));
        int j = 0;
        while (j < n && strcmp(p[j].name, name)) j++;
        if (j == n) {
            if (json_is_false(addl)) {
                free(p);
                return gfail(c, "required property '%s' at %s is not in 'properties' and "
                                "additionalProperties is false", name, c->path);
            }
            p[n++] = (gprop){ name, json_is_object(addl) ? addl : NULL, 0 };
        }
        p[j].required = 1;
    }
    int m = 0;   /* an optional property whose schema is false is never written */
    for (int i = 0; i < n; i++)
        if (p[i].required || !json_is_false(p[i].schema)) p[m++] = p[i];
    int64_t r = sch_object_props(c, p, m);
    free(p);
    return r;
}

/* Number bounds: minimum/maximum and exclusive* (draft 6+ numbers, or the
 * draft 4 booleans). */
typedef struct {
    int has_lo, has_hi, lo_ex, hi_ex;
    double lo, hi;
} gbounds;

static int sch_bounds(gctx *c, const json_t *s, gbounds *b)
{
    *b = (gbounds){ 0 };
    const char *kws[4] = { "minimum", "exclusiveMinimum", "maximum", "exclusiveMaximum" };
    const json_t *v[4];
    for (int i = 0; i < 4; i++) {
        v[i] = json_object_get(s, kws[i]);
        if (v[i] && !json_is_number(v[i]) && !(i % 2 == 1 && json_is_boolean(v[i])))
            return gfail(c, "'%s' at %s must be a number", kws[i], c->path);
    }
    for (int side = 0; side < 2; side++) {
        const json_t *m = v[side * 2], *x = v[side * 2 + 1];
        int has = 0, ex = 0;
        double val = 0;
        if (m) {
            has = 1;
            val = json_number_value(m);
            ex = json_is_true(x);
        }
        if (json_is_number(x)) {
            double xv = json_number_value(x);
            if (!has || (side == 0 ? xv >= val : xv <= val)) {
                has = 1;
                val = xv;
                ex = 1;
            }
        }
        if (side == 0) {
            b->has_lo = has, b->lo = val, b->lo_ex = ex;
        } else {
            b->has_hi = has, b->hi = val, b->hi_ex = ex;
        }
    }
    return 0;
}

static int64_t sch_integer(gctx *c, const gbounds *b)
{
    if (!b->has_lo && !b->has_hi) return rule_integer(c);
    /* int64 range, one short of INT64_MIN so that negation is safe */
    double lim = 9.2e18;
    double lo = b->has_lo ? (b->lo_ex ? floor(b->lo) + 1 : ceil(b->lo)) : -lim;
    double hi = b->has_hi ? (b->hi_ex ? ceil(b->hi) - 1 : floor(b->hi)) : lim;
    if (lo < -lim) lo = -lim;
    if (hi > lim) hi = lim;
    if (lo > hi) return gfail(c, "no integer satisfies the bounds at %s", c->path);
    return rule_int_range(c, (int64_t)lo, (int64_t)hi);
}

static int64_t sch_number(gctx *c, const gbounds *b)
{
    if (!b->has_lo && !b->has_hi) return rule_number(c);
    double lo = b->has_lo ? b->lo : -G_DEC_LIMIT, hi = b->has_hi ? b->hi : G_DEC_LIMIT;
    int lo_ex = b->has_lo && b->lo_ex, hi_ex = b->has_hi && b->hi_ex;
    if (lo < -G_DEC_LIMIT) lo = -G_DEC_LIMIT, lo_ex = 0;   /* clamping moves a bound inward: still valid */
    if (hi > G_DEC_LIMIT) hi = G_DEC_LIMIT, hi_ex = 0;
    if (lo > hi) return gfail(c, "no number satisfies the bounds at %s", c->path);
    return rule_dec_range(c, lo, lo_ex, hi, hi_ex);
}

/* Longest bounded string: one E_REP counts to 254. */
#define G_MAX_STRLEN 254

/* "format": each as a regular expression over the string's text (what
 * Pydantic and zod emit by default). RFC 3339 dates and times (month days
 * up to 31, seconds up to 59, fractions to 9 digits), RFC 4122 UUIDs in
 * either case, a conservative e-mail address (dot-separated atoms, a domain
 * with a 2-12 letter top level), a URI with a scheme and RFC 3986
 * characters, dotted-quad IPv4. */
#define G_RX_DATE "[0-9]{4}-(0[1-9]|1[0-2])-(0[1-9]|[12][0-9]|3[01])"
#define G_RX_TIME "([01][0-9]|2[0-3]):[0-5][0-9]:[0-5][0-9](\\.[0-9]{1,9})?(Z|[+-]([01][0-9]|2[0-3]):[0-5][0-9])"
#define G_RX_OCTET "(25[0-5]|2[0-4][0-9]|1[0-9][0-9]|[1-9]?[0-9])"
static const struct { const char *name, *rx; } g_formats[] = {
    { "date", G_RX_DATE },
    { "time", G_RX_TIME },
    { "date-time", G_RX_DATE "T" G_RX_TIME },
    { "uuid", "[0-9a-fA-F]{8}-[0-9a-fA-F]{4}-[0-9a-fA-F]{4}-[0-9a-fA-F]{4}-[0-9a-fA-F]{12}" },
    { "email", "[A-Za-z0-9_%+-]{1,32}(\\.[A-Za-z0-9_%+-]{1,32}){0,3}@([A-Za-z0-9]([A-Za-z0-9-]{0,30}[A-Za-z0-9])?\\.){1,3}[A-Za-z]{2,12}" },
    { "uri", "[A-Za-z][A-Za-z0-9+.-]{0,15}:[A-Za-z0-9._~%!$&'()*+,;=:@/?#-]{1,200}" },
    { "ipv4", G_RX_OCTET "(\\." G_RX_OCTET "){3}" },
};

/* '"' + the pattern or format's text + '"'. */
static int64_t sch_string_rx(gctx *c, const json_t *s)
{
    const json_t *pat = json_object_get(s, "pattern"), *fmt = json_object_get(s, "format");
    const char *kw = pat ? "pattern" : "format", *rx = NULL;
    if (json_object_get(s, "minLength") || json_object_get(s, "maxLength"))
        return gfail_kw(c, json_object_get(s, "minLength") ? "minLength" : "maxLength",
                        "unsupported keyword '%s' beside '%s' at %s",
                        json_object_get(s, "minLength") ? "minLength" : "maxLength", kw, c->path);
    int search = 0;
    if (pat) {
        if (!json_is_string(pat)) return gfail(c, "'pattern' at %s must be a string", c->path);
        rx = json_string_value(pat);
        search = 1;
    } else {
        if (!json_is_string(fmt)) return gfail(c, "'format' at %s must be a string", c->path);
        for (size_t i = 0; i < sizeof g_formats / sizeof g_formats[0] && !rx; i++)
            if (!strcmp(json_string_value(fmt), g_formats[i].name)) rx = g_formats[i].rx;
        if (!rx)
            return gfail_kw(c, "format", "unsupported keyword 'format' (\"%.40s\") at %s: supported formats are "
                            "date, time, date-time, uuid, email, uri, ipv4", json_string_value(fmt), c->path);
    }
    size_t old = path_push(c, kw, NULL);
    int64_t body = grammar_regex_rule(c, rx, pat ? json_string_length(pat) : strlen(rx), 1, search);
    path_pop(c, old);
    if (c->failed && !c->bad_kw[0]) {   /* the expression is refused: name its keyword */
        snprintf(c->bad_kw, sizeof c->bad_kw, "%s", kw);
        snprintf(c->bad_at, sizeof c->bad_at, "%s", c->path);
    }
    seq q = { 0 };
    if (!seq_str(c, &q, "\"") && !seq_ref(c, &q, body)) seq_str(c, &q, "\"");
    return rule_seq(c, &q);
}

/* A string with maxLength (and minLength): '"' then min..max characters
 * from printable ASCII without '"' and '\\' (one byte each, so the byte
 * count is the character count), then '"'. Bounded strings give up escapes
 * and non-ASCII text; in exchange the output always ends: a model that never
 * writes a quote by itself is made to close the string at maxLength.
 * minLength alone: that many such characters, then any string body. */
static int64_t sch_string(gctx *c, const json_t *s)
{
    int64_t mn = 0, mx = -1;
    if (json_object_get(s, "pattern") || json_object_get(s, "format")) return sch_string_rx(c, s);
    uint64_t b[4] = { 0 };
    for (int x = 0x20; x <= 0x7e; x++)
        if (x != '"' && x != '\\') b[x >> 6] |= 1ull << (x & 63);
    seq q = { 0 };
    if (!json_object_get(s, "maxLength")) {
        if (!json_object_get(s, "minLength")) return rule_string(c);
        if (get_count(c, s, "minLength", &mn)) return -1;
        if (mn > G_MAX_STRLEN) return gfail_kw(c, "minLength", "'minLength' at %s above %d is not supported", c->path, G_MAX_STRLEN);
        if (!seq_str(c, &q, "\"") && (mn == 0 || !seq_rep(c, &q, set_add(c, b), (int)mn, (int)mn)))
            seq_add(c, &q, E_STR, 0, 0, 0);
        return rule_seq(c, &q);
    }
    if (get_count(c, s, "minLength", &mn) || get_count(c, s, "maxLength", &mx)) return -1;
    if (mx > G_MAX_STRLEN) return gfail_kw(c, "maxLength", "'maxLength' at %s above %d is not supported", c->path, G_MAX_STRLEN);
    if (mn > mx) return gfail(c, "'minLength' at %s exceeds 'maxLength'", c->path);
    if (!seq_str(c, &q, "\"") && !seq_rep(c, &q, set_add(c, b), (int)mn, (int)mx)) seq_str(c, &q, "\"");
    return rule_seq(c, &q);
}

static int64_t sch_type(gctx *c, const json_t *s, const char *type)
{
    if (strcmp(type, "string")) {
        const char *kw = json_object_get(s, "pattern") ? "pattern" : json_object_get(s, "format") ? "format" : NULL;
        if (kw) return gfail_kw(c, kw, "unsupported keyword '%s' on type '%s' at %s", kw, type, c->path);
    }
    if (!strcmp(type, "object")) return sch_object(c, s);
    if (!strcmp(type, "array")) return sch_array(c, s);
    if (!strcmp(type, "string")) return sch_string(c, s);
    if (!strcmp(type, "boolean")) {
        alts a = { 0 };
        seq *t = alt_new(c, &a);
        if (t) seq_str(c, t, "true");
        if ((t = alt_new(c, &a))) seq_str(c, t, "false");
        return rule_make(c, &a);
    }
    if (!strcmp(type, "null")) return rule_literal(c, "null");
    if (!strcmp(type, "integer") || !strcmp(type, "number")) {
        gbounds b;
        if (sch_bounds(c, s, &b)) return -1;
        return type[0] == 'i' ? sch_integer(c, &b) : sch_number(c, &b);
    }
    return gfail(c, "unknown type '%s' at %s", type, c->path);
}

static int64_t sch_types(gctx *c, const json_t *s)
{
    const json_t *type = json_object_get(s, "type");
    const char *names[8];
    int n = 0;
    if (json_is_string(type)) {
        names[n++] = json_string_value(type);
    } else if (json_is_array(type)) {
        size_t i;
        const json_t *t;
        json_array_foreach(type, i, t) {
            if (!json_is_string(t) || n == 8) return gfail(c, "'type' at %s must be a type name or list", c->path);
            names[n++] = json_string_value(t);
        }
        if (!n) return gfail(c, "'type' at %s is an empty list", c->path);
    } else if (type) {
        return gfail(c, "'type' at %s must be a type name or list", c->path);
    } else {   /* no type: what the keywords imply, or any value */
        if (json_object_get(s, "properties") || json_object_get(s, "required") ||
            json_object_get(s, "additionalProperties"))
            names[n++] = "object";
        if (json_object_get(s, "items") || json_object_get(s, "minItems") || json_object_get(s, "maxItems"))
            names[n++] = "array";
        if (json_object_get(s, "minLength") || json_object_get(s, "maxLength") || json_object_get(s, "pattern") ||
            json_object_get(s, "format"))
            names[n++] = "string";
        if (json_object_get(s, "minimum") || json_object_get(s, "maximum") ||
            json_object_get(s, "exclusiveMinimum") || json_object_get(s, "exclusiveMaximum"))
            names[n++] = "number";
        if (!n) return rule_value(c);
    }
    if (n == 1) return sch_type(c, s, names[0]);
    alts a = { 0 };
    for (int i = 0; i < n && !c->failed; i++) {
        int64_t r = sch_type(c, s, names[i]);
        seq *t = alt_new(c, &a);
        if (t) seq_ref(c, t, r);
    }
    return rule_make(c, &a);
}

static int64_t sch_compile(gctx *c, const json_t *s)
{
    if (c->failed) return -1;
    if (json_is_true(s)) return rule_value(c);
    if (json_is_false(s)) return gfail(c, "schema false at %s accepts nothing", c->path);
    if (!json_is_object(s)) return gfail(c, "schema at %s is not an object", c->path);
    if (c->depth >= G_MAX_SCHEMA_DEPTH) return gfail(c, "schema nested too deeply at %s", c->path);
    const char *k;
    const json_t *v;
    json_object_foreach((json_t *)s, k, v) {
        if (!in_list(sch_known, k)) return gfail_kw(c, k, "unsupported keyword '%s' at %s", k, c->path);
    }
    c->depth++;
    int64_t r;
    const json_t *ref = json_object_get(s, "$ref"), *any = json_object_get(s, "anyOf");
    const json_t *all = json_object_get(s, "allOf");
    if (ref) {
        if (!json_is_string(ref)) r = gfail(c, "'$ref' at %s must be a string", c->path);
        else r = sch_only_inert(c, s, "$ref") ? -1 : sch_ref(c, json_string_value(ref));
    } else if (all) {
        if (!json_is_array(all) || json_array_size(all) != 1)
            r = gfail_kw(c, "allOf", "unsupported keyword 'allOf' at %s (only a single schema)", c->path);
        else r = sch_only_inert(c, s, "allOf") ? -1 : sch_sub(c, json_array_get(all, 0), "allOf", "0");
    } else if (any) {
        if (!json_is_array(any) || !json_array_size(any)) {
            r = gfail(c, "'anyOf' at %s must be a non-empty array", c->path);
        } else if (sch_only_inert(c, s, "anyOf")) {
            r = -1;
        } else {
            alts a = { 0 };
            size_t i;
            const json_t *sub;
            json_array_foreach(any, i, sub) {
                char idx[24];
                snprintf(idx, sizeof idx, "%zu", i);
                int64_t x = sch_sub(c, sub, "anyOf", idx);
                seq *t = alt_new(c, &a);
                if (t) seq_ref(c, t, x);
                if (c->failed) break;
            }
            r = rule_make(c, &a);
        }
    } else if ((v = json_object_get(s, "const"))) {
        r = sch_enum(c, v, 1, json_object_get(s, "type"), "const");
    } else if ((v = json_object_get(s, "enum"))) {
        if (!json_is_array(v) || !json_array_size(v)) r = gfail(c, "'enum' at %s must be a non-empty array", c->path);
        else r = sch_enum(c, v, (int)json_array_size(v), json_object_get(s, "type"), "enum");
    } else {
        r = sch_types(c, s);
    }
    c->depth--;
    return c->failed ? -1 : r;
}

int grammar_compile_schema(grammar **out, const json_t *schema, char *err, size_t errlen)
{
    *out = NULL;
    grammar_lexer_init();
    gctx c;
    if (grammar_ctx_init(&c, schema, err, errlen)) return -1;
    int64_t root = sch_compile(&c, schema);
    return grammar_compile_finish(&c, root, out);
}

int grammar_compile_schema_at(grammar **out, const json_t *schema, char *err, size_t errlen, char *kw,
                              size_t kwlen, char *at, size_t atlen)
{
    *out = NULL;
    grammar_lexer_init();
    if (kwlen) kw[0] = 0;
    if (atlen) at[0] = 0;
    gctx c;
    if (grammar_ctx_init(&c, schema, err, errlen)) return -1;
    int64_t root = sch_compile(&c, schema);
    if (kwlen) snprintf(kw, kwlen, "%s", c.bad_kw);
    if (atlen) snprintf(at, atlen, "%s", c.bad_at);
    return grammar_compile_finish(&c, root, out);
}

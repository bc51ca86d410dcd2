/* grammar_text.c - grammars written as text: regular expressions (JSON
 * Schema "pattern" and "format", vLLM's guided_regex), GBNF (llama.cpp's
 * "grammar", vLLM's guided_grammar) and choice lists (guided_choice),
 * compiled with grammar.c's builder into the same byte grammar.
 *
 * Both parsers build a small tree over Unicode code points (classes as
 * sorted code-point ranges, sequences, alternatives, bounded or unbounded
 * repeats, rule references); the lowering turns classes into UTF-8 byte
 * sequences (the standard split of a code-point range into ranges of equal
 * encoded length and shared prefixes), repeats into unrolled copies or
 * tail-recursive rules. Inside a JSON string (pattern, format) every code
 * point that JSON must escape is written as its escape ("\"", "\\", "\n",
 * "\u0001"), so the string decodes to text the expression matches.
 *
 * The text is hostile: its length, the nesting of groups, repeat counts and
 * the number of GBNF rules are bounded before anything is sized from them,
 * and every error is a message (with the byte offset) for a 400.
 */
#include "engine/grammar_internal.h"

#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

/* ==== Limits ==== */

/* Text of a regular expression or GBNF grammar: far beyond what the
 * ecosystem sends (Pydantic's longest default patterns are ~100 bytes). */
#define GT_MAX_TEXT (64 * 1024)
/* Group nesting: the parsers recurse once per level. */
#define GT_MAX_NEST 64
/* {n,m} counts: copies are unrolled into rules (G_MAX_ELEMS bounds the rest). */
#define GT_MAX_REPEAT 1000
/* GBNF rules in one grammar. */
#define GT_MAX_RULES 4096
/* Tree nodes per text (each node is small; bounds parse memory). */
#define GT_MAX_NODES (1 << 18)
/* Code-point ranges in one class (after negation at most that plus one). */
#define GT_MAX_RANGES 1024
#define GT_MAX_CP 0x10FFFF

/* ==== The tree ==== */

enum { N_CLASS, N_SEQ, N_ALT, N_REP, N_REF };

typedef struct gnode gnode;
struct gnode {
    int type;
    int min, max;          /* N_REP: max -1 = unbounded */
    int rule;              /* N_REF: GBNF rule index */
    uint32_t *rg;          /* N_CLASS: [lo, hi] pairs, sorted, disjoint */
    int n_rg;
    gnode **kid;           /* N_SEQ, N_ALT: children; N_REP: kid[0] */
    int n_kid, cap_kid;
};

typedef struct {
    const char *s;
    size_t n, i;
    int depth;
    char *err;
    size_t errlen;
    int failed;
    gnode **all;           /* every node, for freeing */
    uint32_t n_all, cap_all;
    /* GBNF rules */
    char **names;
    gnode **body;
    int n_rules, cap_rules;
} gparse;

static int gp_fail(gparse *p, const char *fmt, ...) __attribute__((format(printf, 2, 3)));
static int gp_fail(gparse *p, const char *fmt, ...)
{
    if (!p->failed && p->errlen) {
        char msg[256];
        va_list ap;
        va_start(ap, fmt);
        vsnprintf(msg, sizeof msg, fmt, ap);
        va_end(ap);
        snprintf(p->err, p->errlen, "%s (at byte %zu)", msg, p->i);
    }
    p->failed = 1;
    return -1;
}

static gnode *node_new(gparse *p, int type)
{
    if (p->failed) return NULL;
    if (p->n_all >= GT_MAX_NODES) {
        gp_fail(p, "expression too large");
        return NULL;
    }
    gnode *x = calloc(1, sizeof *x);
    if (!x || grow((void **)&p->all, &p->cap_all, p->n_all + 1, sizeof *p->all)) {
        free(x);
        gp_fail(p, "out of memory");
        return NULL;
    }
    x->type = type;
    p->all[p->n_all++] = x;
    return x;
}

static int node_add(gparse *p, gnode *x, gnode *k)
{
    if (!x || !k) return -1;
    if (x->n_kid == x->cap_kid) {
        int nc = x->cap_kid ? 2 * x->cap_kid : 4;
        gnode **q = realloc(x->kid, (size_t)nc * sizeof *q);
        if (!q) return gp_fail(p, "out of memory");
        x->kid = q;
        x->cap_kid = nc;
    }
    x->kid[x->n_kid++] = k;
    return 0;
}

static void gparse_free(gparse *p)
{
    for (uint32_t i = 0; i < p->n_all; i++) {
        free(p->all[i]->rg);
        free(p->all[i]->kid);
        free(p->all[i]);
    }
    free(p->all);
    for (int i = 0; i < p->n_rules; i++) free(p->names[i]);
    free(p->names);
    free(p->body);
}

/* ==== Code-point ranges ==== */

typedef struct {
    uint32_t r[2 * GT_MAX_RANGES + 2];
    int n;                 /* pairs */
} rset;

static int rs_add(gparse *p, rset *s, uint32_t lo, uint32_t hi)
{
    if (lo > hi) return gp_fail(p, "class range out of order");
    if (s->n >= GT_MAX_RANGES) return gp_fail(p, "character class too large");
    s->r[2 * s->n] = lo;
    s->r[2 * s->n + 1] = hi;
    s->n++;
    return 0;
}

static int rs_cmp(const void *a, const void *b)
{
    const uint32_t *x = a, *y = b;
    return x[0] < y[0] ? -1 : x[0] > y[0];
}

/* Sort and merge overlapping or adjacent ranges. */
static void rs_norm(rset *s)
{
    if (s->n < 2) return;
    qsort(s->r, (size_t)s->n, 2 * sizeof(uint32_t), rs_cmp);
    int k = 0;
    for (int i = 1; i < s->n; i++) {
        if (s->r[2 * i] <= s->r[2 * k + 1] + 1) {
            if (s->r[2 * i + 1] > s->r[2 * k + 1]) s->r[2 * k + 1] = s->r[2 * i + 1];
        } else {
            k++;
            s->r[2 * k] = s->r[2 * i];
            s->r[2 * k + 1] = s->r[2 * i + 1];
        }
    }
    s->n = k + 1;
}

static void rs_negate(rset *s)
{
    rs_norm(s);
    rset o;
    o.n = 0;
    uint32_t next = 0;
    for (int i = 0; i < s->n; i++) {
        if (s->r[2 * i] > next) { o.r[2 * o.n] = next; o.r[2 * o.n + 1] = s->r[2 * i] - 1; o.n++; }
        next = s->r[2 * i + 1] + 1;
    }
    if (next <= GT_MAX_CP) { o.r[2 * o.n] = next; o.r[2 * o.n + 1] = GT_MAX_CP; o.n++; }
    *s = o;
}

static gnode *class_node(gparse *p, rset *s)
{
    rs_norm(s);
    gnode *x = node_new(p, N_CLASS);
    if (!x) return NULL;
    x->rg = malloc((size_t)(s->n ? s->n : 1) * 2 * sizeof *x->rg);
    if (!x->rg) { gp_fail(p, "out of memory"); return NULL; }
    memcpy(x->rg, s->r, (size_t)s->n * 2 * sizeof *x->rg);
    x->n_rg = s->n;
    return x;
}

static gnode *cp_node(gparse *p, uint32_t cp)
{
    rset s = { .n = 0 };
    rs_add(p, &s, cp, cp);
    return class_node(p, &s);
}

/* Any code point; any but a newline (the regex '.'). */
static gnode *any_node(gparse *p, int newline)
{
    rset s = { .n = 0 };
    if (newline) rs_add(p, &s, 0, GT_MAX_CP);
    else { rs_add(p, &s, 0, 9); rs_add(p, &s, 11, GT_MAX_CP); }
    return class_node(p, &s);
}

/* ==== Reading text ==== */

static int at_end(const gparse *p) { return p->i >= p->n; }
static int peek(const gparse *p) { return at_end(p) ? -1 : (unsigned char)p->s[p->i]; }

/* One UTF-8 code point (strict: no overlongs, no surrogates). */
static int read_cp(gparse *p, uint32_t *cp)
{
    const unsigned char *s = (const unsigned char *)p->s + p->i;
    size_t left = p->n - p->i;
    if (!left) return gp_fail(p, "unexpected end");
    unsigned c = s[0];
    int len = c < 0x80 ? 1 : (c & 0xE0) == 0xC0 ? 2 : (c & 0xF0) == 0xE0 ? 3 : (c & 0xF8) == 0xF0 ? 4 : 0;
    if (!len || (size_t)len > left) return gp_fail(p, "invalid UTF-8");
    uint32_t v = len == 1 ? c : len == 2 ? (c & 0x1F) : len == 3 ? (c & 0x0F) : (c & 0x07);
    for (int k = 1; k < len; k++) {
        if ((s[k] & 0xC0) != 0x80) return gp_fail(p, "invalid UTF-8");
        v = v << 6 | (s[k] & 0x3F);
    }
    static const uint32_t min[5] = { 0, 0, 0x80, 0x800, 0x10000 };
    if (v < min[len] || v > GT_MAX_CP || (v >= 0xD800 && v <= 0xDFFF)) return gp_fail(p, "invalid UTF-8");
    p->i += (size_t)len;
    *cp = v;
    return 0;
}

static int hex_val(int c)
{
    return c >= '0' && c <= '9' ? c - '0' : c >= 'a' && c <= 'f' ? c - 'a' + 10 : c >= 'A' && c <= 'F' ? c - 'A' + 10 : -1;
}

/* n hex digits. */
static int read_hex(gparse *p, int n, uint32_t *out)
{
    uint32_t v = 0;
    for (int k = 0; k < n; k++) {
        int h = hex_val(peek(p));
        if (h < 0) return gp_fail(p, "expected %d hex digits", n);
        v = v << 4 | (uint32_t)h;
        p->i++;
    }
    if (v > GT_MAX_CP || (v >= 0xD800 && v <= 0xDFFF)) return gp_fail(p, "escape names no Unicode scalar value");
    *out = v;
    return 0;
}

/* A decimal count up to GT_MAX_REPEAT. */
static int read_count(gparse *p, int *out)
{
    int v = 0, any = 0;
    while (peek(p) >= '0' && peek(p) <= '9') {
        v = v * 10 + (peek(p) - '0');
        p->i++;
        any = 1;
        if (v > GT_MAX_REPEAT) return gp_fail(p, "repeat count above %d", GT_MAX_REPEAT);
    }
    if (!any) return gp_fail(p, "expected a count");
    *out = v;
    return 0;
}

/* "{n}", "{n,}", "{n,m}" after '{' was seen: 0, or -1. */
static int read_braces(gparse *p, int *mn, int *mx)
{
    p->i++;
    if (read_count(p, mn)) return -1;
    *mx = *mn;
    if (peek(p) == ',') {
        p->i++;
        if (peek(p) == '}') *mx = -1;
        else if (read_count(p, mx)) return -1;
    }
    if (peek(p) != '}') return gp_fail(p, "expected '}'");
    p->i++;
    if (*mx >= 0 && *mx < *mn) return gp_fail(p, "repeat {%d,%d} has max below min", *mn, *mx);
    return 0;
}

static gnode *rep_node(gparse *p, gnode *x, int mn, int mx)
{
    gnode *r = node_new(p, N_REP);
    if (!r || node_add(p, r, x)) return NULL;
    r->min = mn;
    r->max = mx;
    return r;
}

/* A quantifier after an atom, if any (both dialects share * + ? {}). */
static gnode *quantify(gparse *p, gnode *x, int regex)
{
    while (x && !at_end(p)) {
        int c = peek(p), mn, mx;
        if (c == '*') { mn = 0; mx = -1; p->i++; }
        else if (c == '+') { mn = 1; mx = -1; p->i++; }
        else if (c == '?') { mn = 0; mx = 1; p->i++; }
        else if (c == '{' && (!regex || (p->i + 1 < p->n && p->s[p->i + 1] >= '0' && p->s[p->i + 1] <= '9'))) {
            if (read_braces(p, &mn, &mx)) return NULL;
        } else {
            break;
        }
        if (regex && peek(p) == '?') p->i++;   /* lazy: the same language */
        else if (regex && peek(p) == '+') { gp_fail(p, "possessive quantifiers are not supported"); return NULL; }
        x = rep_node(p, x, mn, mx);
    }
    return x;
}

/* ==== Regular expressions (ECMA-262, as JSON Schema specifies) ==== */

static int rx_class_escape(gparse *p, rset *s, int *single, uint32_t *cp);

/* \d \w \s and their negations into s. */
static int rx_perl_class(gparse *p, int c, rset *s)
{
    rset t = { .n = 0 };
    int lc = c | 0x20;
    if (lc == 'd') rs_add(p, &t, '0', '9');
    else if (lc == 'w') { rs_add(p, &t, '0', '9'); rs_add(p, &t, 'A', 'Z'); rs_add(p, &t, 'a', 'z'); rs_add(p, &t, '_', '_'); }
    else { rs_add(p, &t, '\t', '\r'); rs_add(p, &t, ' ', ' '); }
    if (c != lc) rs_negate(&t);
    for (int i = 0; i < t.n && !p->failed; i++) rs_add(p, s, t.r[2 * i], t.r[2 * i + 1]);
    return p->failed ? -1 : 0;
}

/* After '\': a class (*single = 0, added to s) or one code point (*cp). */
static int rx_class_escape(gparse *p, rset *s, int *single, uint32_t *cp)
{
    if (at_end(p)) return gp_fail(p, "trailing '\\'");
    int c = peek(p);
    *single = 1;
    if (strchr("dDwWsS", c)) {
        p->i++;
        *single = 0;
        return rx_perl_class(p, c, s);
    }
    p->i++;
    switch (c) {
    case 'n': *cp = '\n'; return 0;
    case 'r': *cp = '\r'; return 0;
    case 't': *cp = '\t'; return 0;
    case 'f': *cp = '\f'; return 0;
    case 'v': *cp = '\v'; return 0;
    case '0': *cp = 0; return 0;
    case 'x': return read_hex(p, 2, cp);
    case 'u': return read_hex(p, 4, cp);
    case 'b': case 'B': return gp_fail(p, "word boundaries (\\b) are not supported");
    case 'p': case 'P': return gp_fail(p, "Unicode property classes (\\p) are not supported");
    case 'k': return gp_fail(p, "back-references are not supported");
    default: break;
    }
    if (c >= '1' && c <= '9') return gp_fail(p, "back-references are not supported");
    if ((c >= 'a' && c <= 'z') || (c >= 'A' && c <= 'Z')) return gp_fail(p, "unknown escape '\\%c'", c);
    p->i--;
    return read_cp(p, cp);   /* an escaped punctuation or other character: itself */
}

/* '[' ... ']' with the '[' consumed. */
static gnode *rx_class(gparse *p)
{
    rset s = { .n = 0 };
    int neg = 0, first = 1;
    if (peek(p) == '^') { neg = 1; p->i++; }
    for (;;) {
        if (at_end(p)) { gp_fail(p, "unterminated '['"); return NULL; }
        int c = peek(p);
        if (c == ']' && !first) { p->i++; break; }
        first = 0;
        uint32_t lo;
        int single = 1;
        if (c == '\\') { p->i++; if (rx_class_escape(p, &s, &single, &lo)) return NULL; }
        else if (read_cp(p, &lo)) return NULL;
        if (!single) continue;
        uint32_t hi = lo;
        if (peek(p) == '-' && p->i + 1 < p->n && p->s[p->i + 1] != ']') {
            p->i++;
            if (peek(p) == '\\') {
                p->i++;
                if (rx_class_escape(p, &s, &single, &hi)) return NULL;
                if (!single) { gp_fail(p, "a class cannot end a range"); return NULL; }
            } else if (read_cp(p, &hi)) {
                return NULL;
            }
        }
        if (rs_add(p, &s, lo, hi)) return NULL;
    }
    if (neg) rs_negate(&s);
    if (!s.n) { gp_fail(p, "empty character class"); return NULL; }
    return class_node(p, &s);
}

static gnode *rx_alt(gparse *p, int top, int *anchors);

static gnode *rx_atom(gparse *p)
{
    int c = peek(p);
    if (c == '(') {
        p->i++;
        if (peek(p) == '?') {
            p->i++;
            int k = peek(p);
            if (k == ':') p->i++;
            else if (k == '<' && p->i + 1 < p->n && p->s[p->i + 1] != '=' && p->s[p->i + 1] != '!') {
                while (!at_end(p) && peek(p) != '>') p->i++;   /* a named group: the name is not needed */
                if (at_end(p)) { gp_fail(p, "unterminated group name"); return NULL; }
                p->i++;
            } else {
                gp_fail(p, "lookaround and inline flags ((?=, (?!, (?<=, (?<!, (?i)) are not supported");
                return NULL;
            }
        }
        if (++p->depth > GT_MAX_NEST) { gp_fail(p, "groups nested deeper than %d", GT_MAX_NEST); return NULL; }
        gnode *x = rx_alt(p, 0, NULL);
        p->depth--;
        if (!x) return NULL;
        if (peek(p) != ')') { gp_fail(p, "missing ')'"); return NULL; }
        p->i++;
        return x;
    }
    if (c == '[') { p->i++; return rx_class(p); }
    if (c == '.') { p->i++; return any_node(p, 0); }
    if (c == '\\') {
        p->i++;
        rset s = { .n = 0 };
        int single;
        uint32_t cp;
        if (rx_class_escape(p, &s, &single, &cp)) return NULL;
        return single ? cp_node(p, cp) : class_node(p, &s);
    }
    if (c == '*' || c == '+' || c == '?') { gp_fail(p, "nothing to repeat"); return NULL; }
    if (c == '^' || c == '$') { gp_fail(p, "anchors are only supported at the start and end of the pattern"); return NULL; }
    uint32_t cp;
    if (read_cp(p, &cp)) return NULL;
    return cp_node(p, cp);
}

/* A sequence up to '|' or ')' or the end. At the top level, a leading '^'
 * and a trailing '$' set bits 1 and 2 of *anchors. */
static gnode *rx_seq(gparse *p, int top, int *anchors)
{
    gnode *q = node_new(p, N_SEQ);
    if (top && peek(p) == '^') { p->i++; *anchors |= 1; }
    while (q && !at_end(p) && peek(p) != '|' && peek(p) != ')') {
        if (top && peek(p) == '$' && (p->i + 1 == p->n || p->s[p->i + 1] == '|')) {
            p->i++;
            *anchors |= 2;
            break;
        }
        gnode *a = quantify(p, rx_atom(p), 1);
        if (!a || node_add(p, q, a)) return NULL;
    }
    return p->failed ? NULL : q;
}

/* Alternatives. At the top level, each gets its own anchors: a branch
 * without '^' may start with anything (and likewise at its end), as a
 * JSON Schema pattern matches anywhere in the string. */
static gnode *rx_alt(gparse *p, int top, int *search)
{
    gnode *x = node_new(p, N_ALT);
    for (;;) {
        int anchors = 0;
        gnode *s = rx_seq(p, top, &anchors);
        if (!s) return NULL;
        if (top && search && *search) {
            gnode *w = node_new(p, N_SEQ);
            gnode *pre = (anchors & 1) ? NULL : rep_node(p, any_node(p, 1), 0, -1);
            gnode *post = (anchors & 2) ? NULL : rep_node(p, any_node(p, 1), 0, -1);
            if ((pre && node_add(p, w, pre)) || node_add(p, w, s) || (post && node_add(p, w, post))) return NULL;
            s = w;
        }
        if (node_add(p, x, s)) return NULL;
        if (peek(p) != '|') break;
        p->i++;
    }
    return p->failed ? NULL : x;
}

/* ==== GBNF (llama.cpp's grammar format) ==== */

static int gb_is_name(int c) { return (c >= 'a' && c <= 'z') || (c >= 'A' && c <= 'Z') || (c >= '0' && c <= '9') || c == '-' || c == '_'; }

/* Spaces, tabs and comments; newlines too when nl. */
static void gb_space(gparse *p, int nl)
{
    while (!at_end(p)) {
        int c = peek(p);
        if (c == ' ' || c == '\t' || (nl && (c == '\n' || c == '\r'))) p->i++;
        else if (c == '#') { while (!at_end(p) && peek(p) != '\n') p->i++; }
        else break;
    }
}

static int gb_rule_index(gparse *p, const char *name, size_t len)
{
    for (int i = 0; i < p->n_rules; i++)
        if (strlen(p->names[i]) == len && !memcmp(p->names[i], name, len)) return i;
    if (p->n_rules >= GT_MAX_RULES) return gp_fail(p, "more than %d rules", GT_MAX_RULES);
    if (p->n_rules == p->cap_rules) {
        int nc = p->cap_rules ? 2 * p->cap_rules : 16;
        char **nn = realloc(p->names, (size_t)nc * sizeof *nn);
        if (nn) p->names = nn;
        gnode **nb = nn ? realloc(p->body, (size_t)nc * sizeof *nb) : NULL;
        if (!nb) return gp_fail(p, "out of memory");
        p->body = nb;
        p->cap_rules = nc;
    }
    if (!(p->names[p->n_rules] = strndup(name, len))) return gp_fail(p, "out of memory");
    p->body[p->n_rules] = NULL;
    return p->n_rules++;
}

/* One character of a GBNF literal or class (escapes \n \r \t \\ \" \[ \]
 * \xHH \uHHHH \UHHHHHHHH, else UTF-8). */
static int gb_char(gparse *p, uint32_t *cp)
{
    if (peek(p) != '\\') return read_cp(p, cp);
    p->i++;
    int c = peek(p);
    p->i++;
    switch (c) {
    case 'n': *cp = '\n'; return 0;
    case 'r': *cp = '\r'; return 0;
    case 't': *cp = '\t'; return 0;
    case '\\': case '"': case '[': case ']': case '-': case '^': *cp = (uint32_t)c; return 0;
    case 'x': return read_hex(p, 2, cp);
    case 'u': return read_hex(p, 4, cp);
    case 'U': return read_hex(p, 8, cp);
    default: p->i--; return gp_fail(p, "unknown escape in grammar");
    }
}

static gnode *gb_alt(gparse *p, int nested);

static gnode *gb_atom(gparse *p)
{
    int c = peek(p);
    if (c == '"') {
        p->i++;
        gnode *q = node_new(p, N_SEQ);
        while (q && peek(p) != '"') {
            uint32_t cp;
            if (at_end(p) || peek(p) == '\n') { gp_fail(p, "unterminated string literal"); return NULL; }
            if (gb_char(p, &cp) || node_add(p, q, cp_node(p, cp))) return NULL;
        }
        if (q) p->i++;
        return q;
    }
    if (c == '[') {
        p->i++;
        rset s = { .n = 0 };
        int neg = 0;
        if (peek(p) == '^') { neg = 1; p->i++; }
        while (peek(p) != ']') {
            uint32_t lo, hi;
            if (at_end(p)) { gp_fail(p, "unterminated '['"); return NULL; }
            if (gb_char(p, &lo)) return NULL;
            hi = lo;
            if (peek(p) == '-' && p->i + 1 < p->n && p->s[p->i + 1] != ']') {
                p->i++;
                if (gb_char(p, &hi)) return NULL;
            }
            if (rs_add(p, &s, lo, hi)) return NULL;
        }
        p->i++;
        if (neg) rs_negate(&s);
        if (!s.n) { gp_fail(p, "empty character class"); return NULL; }
        return class_node(p, &s);
    }
    if (c == '(') {
        p->i++;
        if (++p->depth > GT_MAX_NEST) { gp_fail(p, "groups nested deeper than %d", GT_MAX_NEST); return NULL; }
        gb_space(p, 1);
        gnode *x = gb_alt(p, 1);
        p->depth--;
        if (!x) return NULL;
        if (peek(p) != ')') { gp_fail(p, "missing ')'"); return NULL; }
        p->i++;
        return x;
    }
    if (c == '.') { p->i++; return any_node(p, 1); }
    if (gb_is_name(c)) {
        size_t st = p->i;
        while (gb_is_name(peek(p))) p->i++;
        int r = gb_rule_index(p, p->s + st, p->i - st);
        gnode *x = r < 0 ? NULL : node_new(p, N_REF);
        if (x) x->rule = r;
        return x;
    }
    gp_fail(p, c < 0 ? "unexpected end of grammar" : "unexpected character '%c'", c);
    return NULL;
}

static gnode *gb_seq(gparse *p, int nested)
{
    gnode *q = node_new(p, N_SEQ);
    while (q && !at_end(p)) {
        int c = peek(p);
        if (c == '|' || c == ')' || c == '\n' || c == '\r') break;
        gnode *a = quantify(p, gb_atom(p), 0);
        if (!a || node_add(p, q, a)) return NULL;
        gb_space(p, nested);
    }
    return p->failed ? NULL : q;
}

static gnode *gb_alt(gparse *p, int nested)
{
    gnode *x = node_new(p, N_ALT);
    for (;;) {
        gnode *s = gb_seq(p, nested);
        if (!s || node_add(p, x, s)) return NULL;
        if (peek(p) != '|') break;
        p->i++;
        gb_space(p, 1);
    }
    return x;
}

static int gb_parse(gparse *p)
{
    gb_space(p, 1);
    while (!at_end(p) && !p->failed) {
        size_t st = p->i;
        while (gb_is_name(peek(p))) p->i++;
        if (p->i == st) return gp_fail(p, "expected a rule name");
        int r = gb_rule_index(p, p->s + st, p->i - st);
        if (r < 0) return -1;
        if (p->body[r]) return gp_fail(p, "rule '%s' is defined twice", p->names[r]);
        gb_space(p, 0);
        if (p->n - p->i < 3 || memcmp(p->s + p->i, "::=", 3)) return gp_fail(p, "expected '::='");
        p->i += 3;
        gb_space(p, 1);
        if (!(p->body[r] = gb_alt(p, 0))) return -1;
        gb_space(p, 0);
        if (!at_end(p) && peek(p) != '\n' && peek(p) != '\r') return gp_fail(p, "expected the end of the rule");
        gb_space(p, 1);
    }
    if (p->failed) return -1;
    for (int i = 0; i < p->n_rules; i++)
        if (!p->body[i]) { p->i = p->n; return gp_fail(p, "rule '%s' is used but not defined", p->names[i]); }
    p->i = p->n;
    for (int i = 0; i < p->n_rules; i++)
        if (!strcmp(p->names[i], "root")) return i;
    return gp_fail(p, "the grammar has no 'root' rule");
}

/* ==== Lowering to the byte grammar ==== */

typedef struct {
    gctx *c;
    int json;              /* inside a JSON string: escapes for what JSON must escape */
    int64_t *rules;        /* GBNF rule index -> grammar rule */
} glow;

static int64_t lower_rule(glow *L, const gnode *x);

/* The bytes of cp, or its JSON escape when L->json and JSON requires one. */
static int put_cp_bytes(glow *L, seq *s, uint32_t cp)
{
    char b[8];
    int n;
    if (L->json && (cp < 0x20 || cp == '"' || cp == '\\')) {
        const char *e = cp == '"' ? "\\\"" : cp == '\\' ? "\\\\" : cp == '\n' ? "\\n" : cp == '\t' ? "\\t"
                      : cp == '\r' ? "\\r" : cp == '\b' ? "\\b" : cp == '\f' ? "\\f" : NULL;
        if (e) return seq_str(L->c, s, e);
        if (cp == 0) return gfail(L->c, "a pattern cannot require the character U+0000 in a JSON string");
        snprintf(b, sizeof b, "\\u%04x", (unsigned)cp);
        return seq_str(L->c, s, b);
    }
    if (cp < 0x80) { b[0] = (char)cp; n = 1; }
    else if (cp < 0x800) { b[0] = (char)(0xC0 | cp >> 6); b[1] = (char)(0x80 | (cp & 0x3F)); n = 2; }
    else if (cp < 0x10000) {
        b[0] = (char)(0xE0 | cp >> 12); b[1] = (char)(0x80 | (cp >> 6 & 0x3F)); b[2] = (char)(0x80 | (cp & 0x3F)); n = 3;
    } else {
        b[0] = (char)(0xF0 | cp >> 18); b[1] = (char)(0x80 | (cp >> 12 & 0x3F));
        b[2] = (char)(0x80 | (cp >> 6 & 0x3F)); b[3] = (char)(0x80 | (cp & 0x3F)); n = 4;
    }
    return seq_lit(L->c, s, b, (size_t)n);
}

static void utf8_enc(uint32_t cp, uint8_t *b, int n)
{
    if (n == 1) { b[0] = (uint8_t)cp; return; }
    for (int k = n - 1; k > 0; k--) { b[k] = (uint8_t)(0x80 | (cp & 0x3F)); cp >>= 6; }
    b[0] = (uint8_t)((n == 2 ? 0xC0 : n == 3 ? 0xE0 : 0xF0) | cp);
}

static int utf8_len(uint32_t cp) { return cp < 0x80 ? 1 : cp < 0x800 ? 2 : cp < 0x10000 ? 3 : 4; }

/* Alternatives of byte-range sequences encoding exactly [lo, hi] (which
 * holds no surrogates): split until each piece encodes as one fixed
 * sequence of byte ranges. ascii collects the one-byte part as a set. */
static int utf8_ranges(glow *L, alts *a, uint64_t ascii[4], uint32_t lo, uint32_t hi)
{
    static const uint32_t top[4] = { 0x7F, 0x7FF, 0xFFFF, GT_MAX_CP };
    for (int k = 0; k < 3; k++)
        if (lo <= top[k] && hi > top[k]) {
            return utf8_ranges(L, a, ascii, lo, top[k]) ? -1 : utf8_ranges(L, a, ascii, top[k] + 1, hi);
        }
    if (hi < 0x80) {
        for (uint32_t x = lo; x <= hi; x++) ascii[x >> 6] |= 1ull << (x & 63);
        return 0;
    }
    int n = utf8_len(lo);
    for (int i = 1; i < n; i++) {
        uint32_t m = (1u << (6 * i)) - 1;
        if ((lo & ~m) != (hi & ~m)) {
            if (lo & m) return utf8_ranges(L, a, ascii, lo, lo | m) ? -1 : utf8_ranges(L, a, ascii, (lo | m) + 1, hi);
            if ((hi & m) != m) return utf8_ranges(L, a, ascii, lo, (hi & ~m) - 1) ? -1 : utf8_ranges(L, a, ascii, hi & ~m, hi);
        }
    }
    uint8_t bl[4], bh[4];
    utf8_enc(lo, bl, n);
    utf8_enc(hi, bh, n);
    seq *s = alt_new(L->c, a);
    for (int k = 0; s && k < n; k++)
        if (seq_add(L->c, s, E_SET, set_range(L->c, bl[k], bh[k]), 0, 0)) return -1;
    return L->c->failed ? -1 : 0;
}

/* A class: one E_SET when it is ASCII and needs no escapes, else a rule
 * of alternatives (the ASCII set, JSON escapes, multi-byte sequences). */
static int lower_class(glow *L, const gnode *x, seq *out)
{
    uint64_t ascii[4] = { 0 };
    alts a = { 0 };
    /* what JSON must escape, as one alternative: '\\' then the letter of a
     * short escape, or "u00" and two lowercase hex digits (put_cp_bytes's
     * forms), so that a broad class costs one stack here, not 33 */
    uint64_t letters[4] = { 0 }, hex0[4] = { 0 }, hex1[4] = { 0 };
    int n_esc = 0;
    for (int i = 0; i < x->n_rg && L->json; i++)
        for (uint32_t cp = x->rg[2 * i]; cp <= x->rg[2 * i + 1] && cp < 0x60; cp++) {
            if ((cp >= 0x20 && cp != '"' && cp != '\\') || cp == 0) continue;   /* \u0000: refused by JSON strings */
            int l = cp == '"' ? '"' : cp == '\\' ? '\\' : cp == '\b' ? 'b' : cp == '\f' ? 'f' : cp == '\n' ? 'n'
                  : cp == '\r' ? 'r' : cp == '\t' ? 't' : 0;
            if (l) letters[l >> 6] |= 1ull << (l & 63);
            else {
                int h = "0123456789abcdef"[cp & 15];
                if (cp < 0x10) hex0[h >> 6] |= 1ull << (h & 63);
                else hex1[h >> 6] |= 1ull << (h & 63);
            }
            n_esc++;
        }
    if (n_esc) {
        alts e = { 0 };
        seq *t;
        if ((letters[0] | letters[1]) && (t = alt_new(L->c, &e))) seq_add(L->c, t, E_SET, set_add(L->c, letters), 0, 0);
        if ((hex0[0] | hex0[1]) && (t = alt_new(L->c, &e)) && !seq_str(L->c, t, "u000"))
            seq_add(L->c, t, E_SET, set_add(L->c, hex0), 0, 0);
        if ((hex1[0] | hex1[1]) && (t = alt_new(L->c, &e)) && !seq_str(L->c, t, "u001"))
            seq_add(L->c, t, E_SET, set_add(L->c, hex1), 0, 0);
        int64_t er = rule_make(L->c, &e);
        seq *s = alt_new(L->c, &a);
        if (s && !seq_str(L->c, s, "\\")) seq_ref(L->c, s, er);
    }
    for (int i = 0; i < x->n_rg && !L->c->failed; i++) {
        uint32_t lo = x->rg[2 * i], hi = x->rg[2 * i + 1];
        if (lo <= 0xDFFF && hi >= 0xD800) {   /* surrogates are not characters */
            if (lo < 0xD800) utf8_ranges(L, &a, ascii, lo, 0xD7FF);
            if (hi > 0xDFFF) utf8_ranges(L, &a, ascii, 0xE000, hi);
        } else {
            utf8_ranges(L, &a, ascii, lo, hi);
        }
    }
    if (L->json) {
        ascii[0] &= ~0xFFFFFFFFull;            /* control characters */
        ascii['"' >> 6] &= ~(1ull << ('"' & 63));
        ascii['\\' >> 6] &= ~(1ull << ('\\' & 63));
    }
    int has_ascii = ascii[0] || ascii[1] || ascii[2] || ascii[3];
    if (L->c->failed) { alts_free(&a); return -1; }
    if (a.n == 0 && has_ascii) return seq_add(L->c, out, E_SET, set_add(L->c, ascii), 0, 0);
    if (has_ascii) {
        seq *s = alt_new(L->c, &a);
        if (s) seq_add(L->c, s, E_SET, set_add(L->c, ascii), 0, 0);
    }
    if (a.n == 0) { alts_free(&a); return gfail(L->c, "a character class matches nothing that can be written"); }
    if (a.n == 1 && a.a[0].n) {   /* one sequence: inline it */
        seq one = a.a[0];
        a.n = 0;
        alts_free(&a);
        for (uint32_t k = 0; k < one.n; k++)
            if (seq_add(L->c, out, one.e[k].type, one.e[k].arg, one.e[k].min, one.e[k].max)) { free(one.e); return -1; }
        free(one.e);
        return 0;
    }
    return seq_ref(L->c, out, rule_make(L->c, &a));
}

/* The single byte set a node stands for, or -1 (for E_REP). */
static int64_t single_set(glow *L, const gnode *x)
{
    if (x->type == N_SEQ && x->n_kid == 1) return single_set(L, x->kid[0]);
    if (x->type == N_ALT && x->n_kid == 1) return single_set(L, x->kid[0]);
    if (x->type != N_CLASS || x->n_rg == 0 || x->rg[2 * x->n_rg - 1] >= 0x80) return -1;
    uint64_t b[4] = { 0 };
    for (int i = 0; i < x->n_rg; i++)
        for (uint32_t cp = x->rg[2 * i]; cp <= x->rg[2 * i + 1]; cp++) {
            if (L->json && (cp < 0x20 || cp == '"' || cp == '\\')) return -1;
            b[cp >> 6] |= 1ull << (cp & 63);
        }
    return set_add(L->c, b);
}

/* x{min,max}: min copies, then max - min optional ones nested (or a
 * tail-recursive star for an unbounded max). */
static int lower_rep(glow *L, const gnode *x, seq *out)
{
    const gnode *k = x->kid[0];
    int64_t set = single_set(L, k);
    if (set >= 0 && x->min <= 254 && x->max <= 254 && x->max != 0) {
        if (x->max > 0) return seq_rep(L->c, out, set, x->min, x->max);
        if (x->min && seq_rep(L->c, out, set, x->min, x->min)) return -1;
        /* unbounded tail: star := set star | nothing */
    }
    if (x->max == 0) return 0;
    int64_t body = lower_rule(L, k);
    if (body < 0) return -1;
    int copies = set >= 0 && x->max < 0 && x->min <= 254 ? 0 : x->min;
    for (int i = 0; i < copies; i++)
        if (seq_ref(L->c, out, body)) return -1;
    if (x->max < 0) {
        int64_t star = rule_new(L->c);
        alts a = { 0 };
        alt_new(L->c, &a);
        seq *s = alt_new(L->c, &a);
        if (s && !seq_ref(L->c, s, body)) seq_ref(L->c, s, star);
        if (rule_def(L->c, star, &a)) return -1;
        return seq_ref(L->c, out, star);
    }
    int64_t opt = -1;   /* opt_j := body opt_{j-1} | nothing */
    for (int j = 0; j < x->max - x->min && !L->c->failed; j++) {
        alts a = { 0 };
        alt_new(L->c, &a);
        seq *s = alt_new(L->c, &a);
        if (s && !seq_ref(L->c, s, body) && opt >= 0) seq_ref(L->c, s, opt);
        opt = rule_make(L->c, &a);
    }
    return opt >= 0 ? seq_ref(L->c, out, opt) : L->c->failed ? -1 : 0;
}

static int lower_into(glow *L, const gnode *x, seq *out)
{
    if (L->c->failed) return -1;
    switch (x->type) {
    case N_CLASS:
        if (x->n_rg == 1 && x->rg[0] == x->rg[1]) return put_cp_bytes(L, out, x->rg[0]);
        return lower_class(L, x, out);
    case N_SEQ:
        for (int i = 0; i < x->n_kid; i++)
            if (lower_into(L, x->kid[i], out)) return -1;
        return 0;
    case N_ALT:
        if (x->n_kid == 1) return lower_into(L, x->kid[0], out);
        return seq_ref(L->c, out, lower_rule(L, x));
    case N_REP:
        return lower_rep(L, x, out);
    default:   /* N_REF */
        return seq_ref(L->c, out, L->rules[x->rule]);
    }
}

/* Rule r := x (the alternatives of an N_ALT kept apart). */
static int lower_def(glow *L, const gnode *x, int64_t r)
{
    alts a = { 0 };
    int n = x->type == N_ALT ? x->n_kid : 1;
    for (int i = 0; i < n && !L->c->failed; i++) {
        seq t = { 0 };
        if (lower_into(L, x->type == N_ALT ? x->kid[i] : x, &t) == 0) {
            seq *s = alt_new(L->c, &a);
            if (s) *s = t;
            else free(t.e);
        } else {
            free(t.e);
        }
    }
    return rule_def(L->c, r, &a);
}

/* x as a rule of its own. */
static int64_t lower_rule(glow *L, const gnode *x)
{
    if (x->type == N_REF) return L->rules[x->rule];
    int64_t r = L->c->failed ? -1 : rule_new(L->c);
    return lower_def(L, x, r) ? -1 : r;
}

/* ==== Entry points ==== */

static int text_check(const char *text, size_t len, const char *what, char *err, size_t errlen)
{
    if (len > GT_MAX_TEXT) {
        snprintf(err, errlen, "%s is %zu bytes; at most %d are accepted", what, len, GT_MAX_TEXT);
        return -1;
    }
    if (memchr(text, 0, len)) {
        snprintf(err, errlen, "%s contains a NUL byte", what);
        return -1;
    }
    return 0;
}

int64_t grammar_regex_rule(gctx *c, const char *pattern, size_t len, int json, int search)
{
    char perr[300] = "";
    if (text_check(pattern, len, "the pattern", perr, sizeof perr))
        return gfail(c, "pattern at %s: %s", c->path, perr);
    gparse p = { .s = pattern, .n = len, .err = perr, .errlen = sizeof perr };
    gnode *x = rx_alt(&p, 1, &search);
    if (x && !at_end(&p)) { gp_fail(&p, "unmatched ')'"); x = NULL; }
    int64_t r = -1;
    if (!x) {
        gfail(c, "pattern at %s: %s", c->path, perr);
    } else {
        glow L = { .c = c, .json = json };
        r = lower_rule(&L, x);
    }
    gparse_free(&p);
    return c->failed ? -1 : r;
}

static int compile_text(grammar **out, const char *text, size_t len, int gbnf, char *err, size_t errlen)
{
    *out = NULL;
    grammar_lexer_init();
    if (text_check(text, len, gbnf ? "the grammar" : "the regular expression", err, errlen)) return -1;
    grammar *g = calloc(1, sizeof *g);
    if (!g) {
        snprintf(err, errlen, "out of memory");
        return -1;
    }
    gctx c;
    grammar_ctx_init(&c, g, NULL, err, errlen);
    int64_t root = -1;
    if (gbnf) {
        char perr[300] = "";
        gparse p = { .s = text, .n = len, .err = perr, .errlen = sizeof perr };
        int ri = gb_parse(&p);
        int64_t *rules = ri >= 0 ? calloc((size_t)p.n_rules, sizeof *rules) : NULL;
        if (ri < 0) gfail(&c, "grammar: %s", perr);
        else if (!rules) gfail(&c, "out of memory");
        for (int i = 0; rules && i < p.n_rules && !c.failed; i++) rules[i] = rule_new(&c);
        glow L = { .c = &c, .rules = rules };
        for (int i = 0; rules && i < p.n_rules && !c.failed; i++) lower_def(&L, p.body[i], rules[i]);
        if (!c.failed && rules) root = rules[ri];
        free(rules);
        gparse_free(&p);
    } else {
        strcpy(c.path, "#");
        root = grammar_regex_rule(&c, text, len, 0, 0);
    }
    return grammar_compile_finish(&c, root, out);
}

int grammar_compile_regex(grammar **out, const char *pattern, size_t len, char *err, size_t errlen)
{
    return compile_text(out, pattern, len, 0, err, errlen);
}

int grammar_compile_gbnf(grammar **out, const char *text, size_t len, char *err, size_t errlen)
{
    return compile_text(out, text, len, 1, err, errlen);
}

int grammar_compile_choice(grammar **out, const char *const *choices, int n, char *err, size_t errlen)
{
    *out = NULL;
    grammar_lexer_init();
    if (n < 1 || n > GT_MAX_RULES) {
        snprintf(err, errlen, "a choice needs 1 to %d strings", GT_MAX_RULES);
        return -1;
    }
    size_t total = 0;
    for (int i = 0; i < n; i++) total += strlen(choices[i]);
    if (total > GT_MAX_TEXT) {
        snprintf(err, errlen, "the choices total %zu bytes; at most %d are accepted", total, GT_MAX_TEXT);
        return -1;
    }
    grammar *g = calloc(1, sizeof *g);
    if (!g) {
        snprintf(err, errlen, "out of memory");
        return -1;
    }
    gctx c;
    grammar_ctx_init(&c, g, NULL, err, errlen);
    alts a = { 0 };
    for (int i = 0; i < n && !c.failed; i++) {
        if (!choices[i][0]) { gfail(&c, "choice %d is empty", i); break; }
        seq *s = alt_new(&c, &a);
        if (s) seq_str(&c, s, choices[i]);
    }
    int64_t root = c.failed ? (alts_free(&a), -1) : rule_make(&c, &a);
    return grammar_compile_finish(&c, root, out);
}

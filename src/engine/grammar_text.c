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
 *
 * This file holds the parsers (the tree, code-point ranges, regular
 * expressions, GBNF); grammar_lower.c lowers the tree and holds the entry
 * points (grammar_text_internal.h between them).
 */


#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "engine/grammar_text_internal.h"

/* ==== The tree ==== */

int gp_fail(gparse *p, const char *fmt, ...)
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

void gparse_free(gparse *p)
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
gnode *rx_alt(gparse *p, int top, int *search)
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

int gb_parse(gparse *p)
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

/* grammar.c - constrained decoding: JSON Schema subset -> byte grammar ->
 * token masks.
 *
 * A grammar is a set of rules; a rule is a list of alternatives; an
 * alternative is a sequence of elements ending in E_END:
 *
 *   E_SET  one byte from a 256-bit set (literals are sequences of sets)
 *   E_REF  a rule (recursion allowed, left recursion refused at compile time)
 *   E_REP  a byte from a set, repeated min..max times (max <= 254)
 *   E_STR  the body of a JSON string up to and including its closing quote:
 *          escapes, valid UTF-8, no raw control characters, no \u0000, no
 *          lone surrogates (what jansson accepts)
 *
 * The runtime is a pushdown automaton interpreted the GBNF way: a state is a
 * set of stacks of positions (element index in the low 24 bits, an 8-bit
 * sub-state above: the repeat count of E_REP, the lexer state of E_STR).
 * The top of every stack is a terminal (E_SET/E_REP/E_STR) or the stack is
 * empty (the output may end there). Feeding a byte advances each stack whose
 * top accepts it and re-expands (pops finished alternatives, enters rules);
 * identical stacks are merged, so ambiguity (anyOf) costs one stack per live
 * alternative, not an explosion. A rule call in tail position pushes no
 * return address, so lists and property chains do not grow the stack.
 *
 * Masks: the vocabulary is a byte trie walked depth-first with the state;
 * a dead branch prunes its whole subtree, so at structural points (after
 * '{', ',', ':') only a few thousand nodes are visited. Inside a string
 * almost every token is allowed, so stacks whose top is E_STR take a fast
 * path: per lexer state, the vocabulary precomputes the bitset of tokens
 * that stay inside the string, and a trie of the tails of tokens that close
 * it; only those tails are walked with the state after the string.
 *
 * This file is the compiler (schema -> rules); grammar_match.c is the
 * runtime (lexer, stack sets, states, masks); grammar_internal.h is what
 * they share.
 */
#include "engine/grammar_internal.h"


#include <math.h>
#include <pthread.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>


/* ==== Building ==== */

int gfail(gctx *c, const char *fmt, ...)
{
    if (!c->failed) {
        va_list ap;
        va_start(ap, fmt);
        if (c->errlen) vsnprintf(c->err, c->errlen, fmt, ap);
        va_end(ap);
    }
    c->failed = 1;
    return -1;
}

/* A refusal of one keyword: gfail, remembering the keyword and where it
 * stands (grammar_compile_schema_at reports them). */
static int gfail_kw(gctx *c, const char *kw, const char *fmt, ...) __attribute__((format(printf, 3, 4)));
static int gfail_kw(gctx *c, const char *kw, const char *fmt, ...)
{
    if (!c->failed) {
        snprintf(c->bad_kw, sizeof c->bad_kw, "%s", kw);
        snprintf(c->bad_at, sizeof c->bad_at, "%s", c->path);
        va_list ap;
        va_start(ap, fmt);
        if (c->errlen) vsnprintf(c->err, c->errlen, fmt, ap);
        va_end(ap);
    }
    c->failed = 1;
    return -1;
}

int64_t set_add(gctx *c, const uint64_t bits[4])
{
    grammar *g = c->g;
    for (uint32_t i = 0; i < g->n_set; i++)
        if (!memcmp(g->set[i], bits, sizeof g->set[i])) return i;
    if (grow((void **)&g->set, &g->cap_set, g->n_set + 1, sizeof g->set[0]))
        return gfail(c, "out of memory");
    memcpy(g->set[g->n_set], bits, sizeof g->set[0]);
    return g->n_set++;
}

int64_t set_range(gctx *c, int lo, int hi)
{
    if (lo == hi && c->single[lo] >= 0) return c->single[lo];
    uint64_t b[4] = { 0 };
    for (int x = lo; x <= hi; x++) b[x >> 6] |= 1ull << (x & 63);
    int64_t s = set_add(c, b);
    if (lo == hi && s >= 0) c->single[lo] = (int32_t)s;
    return s;
}

int64_t set_chars(gctx *c, const char *chars)
{
    uint64_t b[4] = { 0 };
    for (const unsigned char *p = (const unsigned char *)chars; *p; p++) b[*p >> 6] |= 1ull << (*p & 63);
    return set_add(c, b);
}

int seq_add(gctx *c, seq *s, int type, int64_t arg, int min, int max)
{
    if (arg < 0) return -1;   /* a failed sub-build: the error is already set */
    if (grow((void **)&s->e, &s->cap, s->n + 1, sizeof *s->e)) return gfail(c, "out of memory");
    s->e[s->n++] = (gelem){ (uint8_t)type, (uint8_t)min, (uint8_t)max, (uint32_t)arg };
    return 0;
}

int seq_lit(gctx *c, seq *s, const char *bytes, size_t n)
{
    for (size_t i = 0; i < n; i++)
        if (seq_add(c, s, E_SET, set_range(c, (unsigned char)bytes[i], (unsigned char)bytes[i]), 0, 0)) return -1;
    return 0;
}

int seq_str(gctx *c, seq *s, const char *z) { return seq_lit(c, s, z, strlen(z)); }
int seq_ref(gctx *c, seq *s, int64_t rule) { return seq_add(c, s, E_REF, rule, 0, 0); }
int seq_rep(gctx *c, seq *s, int64_t set, int min, int max) { return seq_add(c, s, E_REP, set, min, max); }

/* A new empty alternative in a; the pointer is valid until the next call. */
seq *alt_new(gctx *c, alts *a)
{
    if (grow((void **)&a->a, &a->cap, a->n + 1, sizeof *a->a)) {
        gfail(c, "out of memory");
        return NULL;
    }
    a->a[a->n] = (seq){ 0 };
    return &a->a[a->n++];
}

void alts_free(alts *a)
{
    for (uint32_t i = 0; i < a->n; i++) free(a->a[i].e);
    free(a->a);
    *a = (alts){ 0 };
}

int64_t rule_new(gctx *c)
{
    grammar *g = c->g;
    if (grow((void **)&g->rule, &g->cap_rule, g->n_rule + 1, sizeof *g->rule)) return gfail(c, "out of memory");
    g->rule[g->n_rule] = (grule){ 0, 0 };
    return g->n_rule++;
}

/* Give rule r the alternatives in a (consumed). */
int rule_def(gctx *c, int64_t r, alts *a)
{
    grammar *g = c->g;
    uint32_t need = g->n_el;
    for (uint32_t i = 0; i < a->n; i++) need += a->a[i].n + 1;
    if (c->failed || r < 0) goto fail;
    if (need > G_MAX_ELEMS) {
        gfail(c, "schema too large (over %u grammar elements) at %s", G_MAX_ELEMS, c->path);
        goto fail;
    }
    if (grow((void **)&g->el, &g->cap_el, need, sizeof *g->el) ||
        grow((void **)&g->alt, &g->cap_alt, g->n_alt + a->n, sizeof *g->alt)) {
        gfail(c, "out of memory");
        goto fail;
    }
    g->rule[r] = (grule){ g->n_alt, a->n };
    for (uint32_t i = 0; i < a->n; i++) {
        g->alt[g->n_alt++] = g->n_el;
        if (a->a[i].n) memcpy(g->el + g->n_el, a->a[i].e, a->a[i].n * sizeof *g->el);
        g->n_el += a->a[i].n;
        g->el[g->n_el++] = (gelem){ E_END, 0, 0, 0 };
    }
    alts_free(a);
    return 0;
fail:
    alts_free(a);
    return -1;
}

int64_t rule_make(gctx *c, alts *a)
{
    int64_t r = c->failed ? -1 : rule_new(c);
    if (rule_def(c, r, a)) return -1;
    return r;
}

/* A rule with one alternative, the sequence s (consumed). */
int64_t rule_seq(gctx *c, seq *s)
{
    alts a = { 0 };
    seq *t = alt_new(c, &a);
    if (!t) {
        free(s->e);
        return -1;
    }
    *t = *s;
    return rule_make(c, &a);
}

/* ==== Shared rules: whitespace, strings, numbers, any value ==== */

int64_t rule_ws(gctx *c)
{
    if (c->r_ws >= 0) return c->r_ws;
    alts a = { 0 };
    alt_new(c, &a);   /* nothing */
    seq *s = alt_new(c, &a);
    if (s) seq_str(c, s, " ");
    s = alt_new(c, &a);
    if (s && !seq_str(c, s, "\n")) seq_rep(c, s, set_chars(c, " \t"), 0, G_WS_INDENT);
    return c->r_ws = rule_make(c, &a);
}

int64_t rule_string(gctx *c)
{
    if (c->r_string >= 0) return c->r_string;
    seq s = { 0 };
    if (!seq_str(c, &s, "\"")) seq_add(c, &s, E_STR, 0, 0, 0);
    return c->r_string = rule_seq(c, &s);
}

static int64_t digit_set(gctx *c)
{
    if (c->s_digit < 0) c->s_digit = (int32_t)set_range(c, '0', '9');
    return c->s_digit;
}

/* "0" | [1-9][0-9]{0,maxdig-1} */
static int64_t rule_int_part(gctx *c, int maxdig)
{
    alts a = { 0 };
    seq *s = alt_new(c, &a);
    if (s) seq_str(c, s, "0");
    s = alt_new(c, &a);
    if (s && !seq_add(c, s, E_SET, set_range(c, '1', '9'), 0, 0)) seq_rep(c, s, digit_set(c), 0, maxdig - 1);
    return rule_make(c, &a);
}

/* nothing | "." [0-9]{1,G_FRAC_DIGITS} */
static int64_t rule_frac_any(gctx *c)
{
    if (c->r_frac_any >= 0) return c->r_frac_any;
    alts a = { 0 };
    alt_new(c, &a);
    seq *s = alt_new(c, &a);
    if (s && !seq_str(c, s, ".")) seq_rep(c, s, digit_set(c), 1, G_FRAC_DIGITS);
    return c->r_frac_any = rule_make(c, &a);
}

static int64_t rule_number(gctx *c)
{
    if (c->r_number >= 0) return c->r_number;
    alts e = { 0 };
    alt_new(c, &e);
    seq *s = alt_new(c, &e);
    if (s && !seq_add(c, s, E_SET, set_chars(c, "eE"), 0, 0) && !seq_rep(c, s, set_chars(c, "+-"), 0, 1))
        seq_rep(c, s, digit_set(c), 1, G_EXP_DIGITS);
    int64_t r_exp = rule_make(c, &e);
    seq n = { 0 };
    if (!seq_rep(c, &n, set_chars(c, "-"), 0, 1) && !seq_ref(c, &n, rule_int_part(c, G_INT_DIGITS)) &&
        !seq_ref(c, &n, rule_frac_any(c)))
        seq_ref(c, &n, r_exp);
    return c->r_number = rule_seq(c, &n);
}

static int64_t rule_integer(gctx *c)
{
    if (c->r_int >= 0) return c->r_int;
    seq n = { 0 };
    if (!seq_rep(c, &n, set_chars(c, "-"), 0, 1)) seq_ref(c, &n, rule_int_part(c, G_INT_DIGITS));
    return c->r_int = rule_seq(c, &n);
}

int64_t rule_literal(gctx *c, const char *z)
{
    seq s = { 0 };
    seq_str(c, &s, z);
    return rule_seq(c, &s);
}

/* "{" ws ( key ws ":" ws value ws ( "," ws key ws ":" ws value ws )* )? "}"
 * with keys any string (key_rule -1) and values of rule val. */
static int64_t rule_map(gctx *c, int64_t val)
{
    int64_t ws = rule_ws(c), str = rule_string(c);
    seq m = { 0 };
    if (!seq_ref(c, &m, str) && !seq_ref(c, &m, ws) && !seq_str(c, &m, ":") && !seq_ref(c, &m, ws) &&
        !seq_ref(c, &m, val))
        seq_ref(c, &m, ws);
    int64_t member = rule_seq(c, &m);
    int64_t tail = c->failed ? -1 : rule_new(c);   /* nothing | "," ws member tail */
    alts a = { 0 };
    alt_new(c, &a);
    seq *s = alt_new(c, &a);
    if (s && !seq_str(c, s, ",") && !seq_ref(c, s, ws) && !seq_ref(c, s, member)) seq_ref(c, s, tail);
    rule_def(c, tail, &a);
    alts b = { 0 };
    alt_new(c, &b);
    s = alt_new(c, &b);
    if (s && !seq_ref(c, s, member)) seq_ref(c, s, tail);
    int64_t body = rule_make(c, &b);
    seq o = { 0 };
    if (!seq_str(c, &o, "{") && !seq_ref(c, &o, ws) && !seq_ref(c, &o, body)) seq_str(c, &o, "}");
    return rule_seq(c, &o);
}

/* "[" ws ( value ws ( "," ws value ws )* )? "]" for any values. */
static int64_t rule_list_any(gctx *c, int64_t val)
{
    int64_t ws = rule_ws(c);
    int64_t tail = c->failed ? -1 : rule_new(c);
    alts a = { 0 };
    alt_new(c, &a);
    seq *s = alt_new(c, &a);
    if (s && !seq_str(c, s, ",") && !seq_ref(c, s, ws) && !seq_ref(c, s, val) && !seq_ref(c, s, ws))
        seq_ref(c, s, tail);
    rule_def(c, tail, &a);
    alts b = { 0 };
    alt_new(c, &b);
    s = alt_new(c, &b);
    if (s && !seq_ref(c, s, val) && !seq_ref(c, s, ws)) seq_ref(c, s, tail);
    int64_t body = rule_make(c, &b);
    seq o = { 0 };
    if (!seq_str(c, &o, "[") && !seq_ref(c, &o, ws) && !seq_ref(c, &o, body)) seq_str(c, &o, "]");
    return rule_seq(c, &o);
}

/* Any JSON value (recursive through objects and arrays). */
int64_t rule_value(gctx *c)
{
    if (c->r_value >= 0) return c->r_value;
    int64_t v = c->failed ? -1 : rule_new(c);
    c->r_value = v;
    c->r_obj = rule_map(c, v);
    int64_t arr = rule_list_any(c, v);
    alts a = { 0 };
    int64_t parts[4] = { c->r_obj, arr, rule_string(c), rule_number(c) };
    for (int i = 0; i < 4; i++) {
        seq *s = alt_new(c, &a);
        if (s) seq_ref(c, s, parts[i]);
    }
    const char *lits[3] = { "true", "false", "null" };
    for (int i = 0; i < 3; i++) {
        seq *s = alt_new(c, &a);
        if (s) seq_str(c, s, lits[i]);
    }
    rule_def(c, v, &a);
    return c->failed ? -1 : v;
}

/* ==== Integer and decimal ranges ==== */

/* Digit strings of length n (no sign, leading zeros as given) between x and
 * y inclusive, x <= y, compared as numbers. The classic split: a common
 * prefix, then x's first digit with the rest >= x's rest, the digits in
 * between with anything, y's first digit with the rest <= y's rest. */
static int64_t rule_same_len(gctx *c, const char *x, const char *y, int n)
{
    int k = 0;
    while (k < n && x[k] == y[k]) k++;
    alts a = { 0 };
    seq *s;
    if (k == n) {
        if ((s = alt_new(c, &a))) seq_lit(c, s, x, (size_t)n);
        return rule_make(c, &a);
    }
    int m = n - k - 1, xlow = 1, yhigh = 1;
    for (int i = k + 1; i < n; i++) {
        if (x[i] != '0') xlow = 0;
        if (y[i] != '9') yhigh = 0;
    }
    char nines[24], zeros[24];
    memset(nines, '9', (size_t)m);
    memset(zeros, '0', (size_t)m);
    int lo = x[k] + !xlow, hi = y[k] - !yhigh;
    int64_t rx = xlow ? 0 : rule_same_len(c, x + k + 1, nines, m);
    int64_t ry = yhigh ? 0 : rule_same_len(c, zeros, y + k + 1, m);
    if (!xlow && (s = alt_new(c, &a)) && !seq_lit(c, s, x, (size_t)k + 1)) seq_ref(c, s, rx);
    if (lo <= hi && (s = alt_new(c, &a)) && !seq_lit(c, s, x, (size_t)k) &&
        !seq_add(c, s, E_SET, set_range(c, lo, hi), 0, 0) && m > 0)
        seq_rep(c, s, digit_set(c), m, m);
    if (!yhigh && (s = alt_new(c, &a)) && !seq_lit(c, s, y, (size_t)k + 1)) seq_ref(c, s, ry);
    return rule_make(c, &a);
}

static int n_digits(uint64_t v)
{
    int n = 1;
    while (v >= 10) {
        v /= 10;
        n++;
    }
    return n;
}

/* Magnitudes a..b (a <= b) written without leading zeros. */
static int64_t rule_mag_range(gctx *c, uint64_t a, uint64_t b)
{
    alts al = { 0 };
    uint64_t p = 1;
    for (int d = 1; d <= n_digits(b); d++, p = d <= 19 ? p * 10 : p) {
        if (d < n_digits(a)) continue;
        uint64_t lo = d == n_digits(a) ? a : p;
        uint64_t hi = d == n_digits(b) ? b : p * 10 - 1;
        char xs[24], ys[24];
        snprintf(xs, sizeof xs, "%llu", (unsigned long long)lo);
        snprintf(ys, sizeof ys, "%llu", (unsigned long long)hi);
        seq *s = alt_new(c, &al);
        if (s) seq_ref(c, s, rule_same_len(c, xs, ys, d));
    }
    return rule_make(c, &al);
}

/* Integers lo..hi (lo <= hi). "-0" is not produced. */
static int64_t rule_int_range(gctx *c, int64_t lo, int64_t hi)
{
    alts a = { 0 };
    seq *s;
    if (hi >= 0 && (s = alt_new(c, &a))) seq_ref(c, s, rule_mag_range(c, lo > 0 ? (uint64_t)lo : 0, (uint64_t)hi));
    if (lo < 0 && (s = alt_new(c, &a)) && !seq_str(c, s, "-"))
        seq_ref(c, s, rule_mag_range(c, hi < 0 ? (uint64_t)(-(hi + 1)) + 1 : 1, (uint64_t)(-(lo + 1)) + 1));
    return rule_make(c, &a);
}

/* A non-negative decimal: integer part and fraction digits (no trailing
 * zeros; "" is zero). */
typedef struct {
    uint64_t ip;
    char fr[G_DEC_FRAC + 1];
} gdec;

/* |x| as a decimal, x already clamped to G_DEC_LIMIT. round_up: a fraction
 * longer than G_DEC_FRAC digits is rounded up (a lower bound moves inward),
 * otherwise truncated (an upper bound moves inward). */
static void dec_from_double(double x, int round_up, gdec *d)
{
    char buf[64];
    x = fabs(x);
    for (int p = 1; p <= 17; p++) {   /* shortest form that reads back */
        snprintf(buf, sizeof buf, "%.*e", p - 1, x);
        if (strtod(buf, NULL) == x) break;
    }
    char dig[32];
    int nd = 0, e = 0;
    for (const char *q = buf; *q && *q != 'e'; q++)
        if (*q >= '0' && *q <= '9' && nd < 31) dig[nd++] = *q;
    const char *ep = strchr(buf, 'e');
    if (ep) e = atoi(ep + 1);
    /* value = 0.dig * 10^(e+1) */
    d->ip = 0;
    int nf = 0, inexact = 0;
    for (int i = 0; i < nd; i++) {
        int place = e - i;   /* power of ten of dig[i] */
        if (place >= 0)
            d->ip = d->ip * 10 + (uint64_t)(dig[i] - '0');
        else {
            while (nf < -place - 1 && nf < G_DEC_FRAC) d->fr[nf++] = '0';
            if (nf < G_DEC_FRAC) d->fr[nf++] = dig[i];
            else if (dig[i] != '0') inexact = 1;
        }
    }
    for (int i = nd; i <= e; i++) d->ip *= 10;   /* trailing zeros of the integer part */
    while (nf > 0 && d->fr[nf - 1] == '0') nf--;
    d->fr[nf] = 0;
    if (inexact && round_up) {   /* add one unit in the last place */
        while (nf < G_DEC_FRAC) d->fr[nf++] = '0';
        d->fr[nf] = 0;
        int i = nf - 1;
        while (i >= 0 && d->fr[i] == '9') d->fr[i--] = '0';
        if (i >= 0) d->fr[i]++;
        else d->ip++;
        while (nf > 0 && d->fr[nf - 1] == '0') nf--;
        d->fr[nf] = 0;
    }
}

static int dec_cmp(const gdec *a, const gdec *b)
{
    if (a->ip != b->ip) return a->ip < b->ip ? -1 : 1;
    for (int i = 0;; i++) {
        int x = a->fr[i] ? a->fr[i] : (b->fr[i] ? '0' : 0);
        int y = b->fr[i] ? b->fr[i] : (a->fr[i] ? '0' : 0);
        if (!x && !y) return 0;
        if (x != y) return x < y ? -1 : 1;
    }
}

#define R_EMPTY (-2)   /* "no string satisfies this": not an error */

/* Fraction digit strings D (at least one digit when first) with
 * 0.D >= 0.f (> when strict). */
static int64_t rule_dig_ge(gctx *c, const char *f, int strict, int first)
{
    seq s = { 0 };
    if (!*f) {
        if (!strict) {
            seq_rep(c, &s, digit_set(c), first, G_FRAC_DIGITS);
        } else if (!seq_rep(c, &s, set_chars(c, "0"), 0, G_FRAC_DIGITS - 1) &&
                   !seq_add(c, &s, E_SET, set_range(c, '1', '9'), 0, 0)) {
            seq_rep(c, &s, digit_set(c), 0, G_FRAC_DIGITS);
        }
        return rule_seq(c, &s);
    }
    alts a = { 0 };
    seq *t;
    if (f[0] < '9' && (t = alt_new(c, &a)) && !seq_add(c, t, E_SET, set_range(c, f[0] + 1, '9'), 0, 0))
        seq_rep(c, t, digit_set(c), 0, G_FRAC_DIGITS);
    int64_t sub = rule_dig_ge(c, f + 1, strict, 0);
    if (sub >= 0 && (t = alt_new(c, &a)) && !seq_lit(c, t, f, 1)) seq_ref(c, t, sub);
    return a.n ? rule_make(c, &a) : (alts_free(&a), c->failed ? -1 : R_EMPTY);
}

/* 0.D <= 0.f (< when strict). */
static int64_t rule_dig_le(gctx *c, const char *f, int strict, int first)
{
    if (!*f) {
        if (strict) return R_EMPTY;
        seq s = { 0 };
        seq_rep(c, &s, set_chars(c, "0"), first, G_FRAC_DIGITS);
        return rule_seq(c, &s);
    }
    alts a = { 0 };
    seq *t;
    if (!first) alt_new(c, &a);   /* D ends: the rest is 0 < the rest of f */
    if (f[0] > '0' && (t = alt_new(c, &a)) && !seq_add(c, t, E_SET, set_range(c, '0', f[0] - 1), 0, 0))
        seq_rep(c, t, digit_set(c), 0, G_FRAC_DIGITS);
    int64_t sub = rule_dig_le(c, f + 1, strict, 0);
    if (sub >= 0 && (t = alt_new(c, &a)) && !seq_lit(c, t, f, 1)) seq_ref(c, t, sub);
    return a.n ? rule_make(c, &a) : (alts_free(&a), c->failed ? -1 : R_EMPTY);
}

/* 0.f <= 0.D <= 0.g (strictness per side), 0.f <= 0.g. */
static int64_t rule_dig_between(gctx *c, const char *f, const char *g, int sf, int sg, int first)
{
    if (!*g) return !*f && !sf && !sg ? rule_dig_le(c, "", 0, first) : R_EMPTY;
    char f0 = *f ? f[0] : '0';
    const char *f1 = *f ? f + 1 : "";
    alts a = { 0 };
    seq *t;
    if (!first && !*f && !sf) alt_new(c, &a);   /* D ends: equals f, below g */
    if (f0 == g[0]) {
        int64_t sub = rule_dig_between(c, f1, g + 1, sf, sg, 0);
        if (sub >= 0 && (t = alt_new(c, &a)) && !seq_lit(c, t, &f0, 1)) seq_ref(c, t, sub);
    } else {
        int64_t ge = rule_dig_ge(c, f1, sf, 0), le = rule_dig_le(c, g + 1, sg, 0);
        if (ge >= 0 && (t = alt_new(c, &a)) && !seq_lit(c, t, &f0, 1)) seq_ref(c, t, ge);
        if (f0 + 1 <= g[0] - 1 && (t = alt_new(c, &a)) &&
            !seq_add(c, t, E_SET, set_range(c, f0 + 1, g[0] - 1), 0, 0))
            seq_rep(c, t, digit_set(c), 0, G_FRAC_DIGITS);
        if (le >= 0 && (t = alt_new(c, &a)) && !seq_lit(c, t, g, 1)) seq_ref(c, t, le);
    }
    return a.n ? rule_make(c, &a) : (alts_free(&a), c->failed ? -1 : R_EMPTY);
}

/* nothing (fraction 0, when zero_ok) | "." D with D from rule dig. */
static int64_t rule_frac(gctx *c, int zero_ok, int64_t dig)
{
    if (dig < 0 && dig != R_EMPTY) return -1;
    alts a = { 0 };
    seq *t;
    if (zero_ok) alt_new(c, &a);
    if (dig >= 0 && (t = alt_new(c, &a)) && !seq_str(c, t, ".")) seq_ref(c, t, dig);
    return a.n ? rule_make(c, &a) : (alts_free(&a), c->failed ? -1 : R_EMPTY);
}

/* Non-negative decimals m with A <= m <= B (ae/be: strict). */
static int64_t rule_dec_mag(gctx *c, const gdec *A, int ae, const gdec *B, int be)
{
    int cmp = dec_cmp(A, B);
    if (cmp > 0 || (cmp == 0 && (ae || be))) return R_EMPTY;
    alts a = { 0 };
    seq *t;
    char num[24];
    if (A->ip == B->ip) {
        int64_t fr = rule_frac(c, !A->fr[0] && !ae && (B->fr[0] || !be),
                               rule_dig_between(c, A->fr, B->fr, ae, be, 1));
        snprintf(num, sizeof num, "%llu", (unsigned long long)A->ip);
        if (fr >= 0 && (t = alt_new(c, &a)) && !seq_str(c, t, num)) seq_ref(c, t, fr);
    } else {
        int64_t lo = rule_frac(c, !A->fr[0] && !ae, rule_dig_ge(c, A->fr, ae, 1));
        int64_t hi = rule_frac(c, B->fr[0] || !be, rule_dig_le(c, B->fr, be, 1));
        snprintf(num, sizeof num, "%llu", (unsigned long long)A->ip);
        if (lo >= 0 && (t = alt_new(c, &a)) && !seq_str(c, t, num)) seq_ref(c, t, lo);
        if (A->ip + 1 <= B->ip - 1 && (t = alt_new(c, &a)) &&
            !seq_ref(c, t, rule_mag_range(c, A->ip + 1, B->ip - 1)))
            seq_ref(c, t, rule_frac_any(c));
        snprintf(num, sizeof num, "%llu", (unsigned long long)B->ip);
        if (hi >= 0 && (t = alt_new(c, &a)) && !seq_str(c, t, num)) seq_ref(c, t, hi);
    }
    return a.n ? rule_make(c, &a) : (alts_free(&a), c->failed ? -1 : R_EMPTY);
}

/* Decimals lo..hi (no exponent), each side inclusive or strict. */
static int64_t rule_dec_range(gctx *c, double lo, int lo_ex, double hi, int hi_ex)
{
    alts a = { 0 };
    seq *t;
    gdec A, B, zero = { 0, "" };
    if (hi > 0 || (hi == 0 && !hi_ex)) {   /* x >= 0 */
        if (lo >= 0) dec_from_double(lo, 1, &A);
        dec_from_double(hi, 0, &B);
        int64_t r = rule_dec_mag(c, lo >= 0 ? &A : &zero, lo >= 0 && lo_ex, &B, hi_ex);
        if (r >= 0 && (t = alt_new(c, &a))) seq_ref(c, t, r);
    }
    if (lo < 0) {   /* x < 0: magnitude in (max(-hi, 0), -lo] */
        if (hi < 0) dec_from_double(hi, 1, &A);
        dec_from_double(lo, 0, &B);
        int64_t r = rule_dec_mag(c, hi < 0 ? &A : &zero, hi < 0 ? hi_ex : 1, &B, lo_ex);
        if (r >= 0 && (t = alt_new(c, &a)) && !seq_str(c, t, "-")) seq_ref(c, t, r);
    }
    if (!a.n && !c->failed) gfail(c, "no number satisfies the bounds at %s", c->path);
    return rule_make(c, &a);
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

/* ==== Left recursion ==== */

/* A rule reaching itself before consuming a byte would expand forever
 * ({"$ref": "#"}, anyOf of itself). Kahn's algorithm over the edges
 * "rule r may start with rule s": leftovers are a cycle. */
static int check_left_recursion(gctx *c)
{
    grammar *g = c->g;
    uint32_t nr = g->n_rule;
    uint8_t *nullable = calloc(nr, 1);
    uint32_t *indeg = calloc(nr, sizeof *indeg), *queue = malloc(nr * sizeof *queue);
    int rc = -1;
    if (!nullable || !indeg || !queue) {
        gfail(c, "out of memory");
        goto out;
    }
    for (int changed = 1; changed;) {
        changed = 0;
        for (uint32_t r = 0; r < nr; r++) {
            if (nullable[r]) continue;
            for (uint32_t a = 0; a < g->rule[r].n && !nullable[r]; a++) {
                const gelem *e = &g->el[g->alt[g->rule[r].first + a]];
                for (; e->type != E_END; e++)
                    if (!((e->type == E_REP && e->min == 0) || (e->type == E_REF && nullable[e->arg]))) break;
                if (e->type == E_END) nullable[r] = changed = 1;
            }
        }
    }
    /* edges r -> s for each leading reference; count in-degrees */
    for (int pass = 0; pass < 2; pass++) {
        uint32_t qh = 0, qt = 0;
        if (pass == 1) {
            for (uint32_t r = 0; r < nr; r++)
                if (!indeg[r]) queue[qt++] = r;
        }
        for (uint32_t r = 0; r < nr && pass == 0; r++) {
            for (uint32_t a = 0; a < g->rule[r].n; a++) {
                for (const gelem *e = &g->el[g->alt[g->rule[r].first + a]]; e->type != E_END; e++) {
                    if (e->type == E_REF) indeg[e->arg]++;
                    if (!((e->type == E_REP && e->min == 0) || (e->type == E_REF && nullable[e->arg]))) break;
                }
            }
        }
        if (pass == 0) continue;
        uint32_t done = 0;
        while (qh < qt) {
            uint32_t r = queue[qh++];
            done++;
            for (uint32_t a = 0; a < g->rule[r].n; a++) {
                for (const gelem *e = &g->el[g->alt[g->rule[r].first + a]]; e->type != E_END; e++) {
                    if (e->type == E_REF && --indeg[e->arg] == 0) queue[qt++] = e->arg;
                    if (!((e->type == E_REP && e->min == 0) || (e->type == E_REF && nullable[e->arg]))) break;
                }
            }
        }
        if (done != nr) {
            gfail(c, "schema refers to itself without consuming input (left-recursive $ref or anyOf)");
            goto out;
        }
    }
    rc = 0;
out:
    free(nullable);
    free(indeg);
    free(queue);
    return rc;
}

/* ==== Compile entry points ==== */

void grammar_ctx_init(gctx *c, grammar *g, const json_t *root, char *err, size_t errlen)
{
    memset(c, 0, sizeof *c);
    c->g = g;
    c->err = err;
    c->errlen = errlen;
    c->root = root;
    strcpy(c->path, "#");
    c->plen = 1;
    for (int i = 0; i < 256; i++) c->single[i] = -1;
    c->s_digit = -1;
    c->r_ws = c->r_string = c->r_number = c->r_int = c->r_value = c->r_obj = c->r_frac_any = -1;
}

int grammar_compile_finish(gctx *c, int64_t root, grammar **out)
{
    grammar *g = c->g;
    for (uint32_t i = 0; i < c->n_refs; i++) free(c->refs[i].ptr);
    free(c->refs);
    if (!c->failed && root >= 0 && !check_left_recursion(c)) {
        seq s = { 0 };   /* start: [REF root] END, the bottom of every stack */
        alts a = { 0 };
        seq *t;
        if (!seq_ref(c, &s, root) && (t = alt_new(c, &a))) {
            *t = s;
            s = (seq){ 0 };
            int64_t r = rule_new(c);
            if (!rule_def(c, r, &a)) {
                g->start = g->alt[g->rule[r].first];
                *out = g;
                return 0;
            }
        }
        free(s.e);
        alts_free(&a);
    }
    if (!c->failed) gfail(c, "schema compile failed");
    grammar_free(g);
    return -1;
}

int grammar_compile_schema(grammar **out, const json_t *schema, char *err, size_t errlen)
{
    *out = NULL;
    grammar_lexer_init();
    grammar *g = calloc(1, sizeof *g);
    if (!g) {
        snprintf(err, errlen, "out of memory");
        return -1;
    }
    gctx c;
    grammar_ctx_init(&c, g, schema, err, errlen);
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
    grammar *g = calloc(1, sizeof *g);
    if (!g) {
        snprintf(err, errlen, "out of memory");
        return -1;
    }
    gctx c;
    grammar_ctx_init(&c, g, schema, err, errlen);
    int64_t root = sch_compile(&c, schema);
    if (kwlen) snprintf(kw, kwlen, "%s", c.bad_kw);
    if (atlen) snprintf(at, atlen, "%s", c.bad_at);
    return grammar_compile_finish(&c, root, out);
}

int grammar_compile_json_object(grammar **out, char *err, size_t errlen)
{
    *out = NULL;
    grammar_lexer_init();
    grammar *g = calloc(1, sizeof *g);
    if (!g) {
        snprintf(err, errlen, "out of memory");
        return -1;
    }
    gctx c;
    grammar_ctx_init(&c, g, NULL, err, errlen);
    rule_value(&c);
    return grammar_compile_finish(&c, c.failed ? -1 : c.r_obj, out);
}

void grammar_free(grammar *g)
{
    if (!g) return;
    free(g->el);
    free(g->set);
    free(g->alt);
    free(g->rule);
    free(g);
}

size_t grammar_size(const grammar *g) { return g->n_el; }

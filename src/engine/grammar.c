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
 */
#include "engine/grammar.h"

#include <math.h>
#include <pthread.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

/* ==== Limits ==== */

/* Grammar size: a schema compiling to more elements is refused (maxItems and
 * integer ranges unroll into rules; this bounds memory for any input). */
#define G_MAX_ELEMS (1u << 18)
/* Schema nesting followed by the compiler (properties/items/anyOf/$ref). */
#define G_MAX_SCHEMA_DEPTH 64
/* minItems/maxItems are unrolled into one rule per count. */
#define G_MAX_LIST 1024
/* Entries per stack: about 3 per level of JSON nesting, so ~170 levels
 * (jansson itself stops at 2048). Deeper outputs are refused. */
#define G_MAX_DEPTH 512
/* Live stacks per state (ambiguity of anyOf alternatives). */
#define G_MAX_STACKS 512
/* Expansion steps per stack advance (guards against pathological grammars). */
#define G_MAX_EXPAND 65536
/* Whitespace between tokens: "", " ", or "\n" then up to this many spaces or
 * tabs (indentation of pretty-printed output, ~8 levels of 4). Bounded so a
 * model cannot loop on whitespace. */
#define G_WS_INDENT 32
/* Digits: every output must parse with jansson, which refuses integers
 * beyond int64 and reals that overflow a double. So integer parts (of
 * "integer" and of "number") have at most 18 digits, and exponents at most 2
 * (18 digits + e99 stays far below DBL_MAX); fractions up to 20 digits. */
#define G_INT_DIGITS 18
#define G_FRAC_DIGITS 20
#define G_EXP_DIGITS 2
/* Bounded numbers are generated without exponent, |x| <= 1e18, fraction
 * digits of a bound beyond this are rounded inward. */
#define G_DEC_FRAC 20
#define G_DEC_LIMIT 1e18

#define POS_MASK 0x00ffffffu
#define SUB_SHIFT 24

enum { E_END = 0, E_SET, E_REF, E_REP, E_STR };

typedef struct {
    uint8_t type, min, max;
    uint32_t arg;   /* E_SET/E_REP: set index; E_REF: rule index */
} gelem;

typedef struct {
    uint32_t first, n;   /* alternatives g->alt[first .. first+n) */
} grule;

struct grammar {
    gelem *el;
    uint32_t n_el, cap_el;
    uint64_t (*set)[4];
    uint32_t n_set, cap_set;
    uint32_t *alt;   /* element index where each alternative starts */
    uint32_t n_alt, cap_alt;
    grule *rule;
    uint32_t n_rule, cap_rule;
    uint32_t start;  /* position of [REF root] END */
};

/* ==== String lexer ==== */

/* States of E_STR (the sub-state of its stack entry). */
enum {
    S_NORM, S_ESC, S_U1, S_UD, S_U0, S_U00, S_U000, S_H3, S_H2, S_H1,
    S_HS2, S_HS1, S_LBS, S_LU, S_LD, S_LC,
    S_C1, S_C2, S_C3, S_E0, S_ED, S_F0, S_F4,
    S_COUNT
};
#define S_DEAD 0xff
#define S_CLOSE 0xfe

static uint8_t str_tab[S_COUNT][256];
static pthread_once_t str_once = PTHREAD_ONCE_INIT;

static int is_hex(int c)
{
    return (c >= '0' && c <= '9') || (c >= 'a' && c <= 'f') || (c >= 'A' && c <= 'F');
}

static uint8_t str_step_slow(int q, int c)
{
    switch (q) {
    case S_NORM:
        if (c == '"') return S_CLOSE;
        if (c == '\\') return S_ESC;
        if (c < 0x20) return S_DEAD;
        if (c < 0x80) return S_NORM;
        if (c >= 0xc2 && c <= 0xdf) return S_C1;
        if (c == 0xe0) return S_E0;
        if (c == 0xed) return S_ED;
        if (c >= 0xe1 && c <= 0xef) return S_C2;
        if (c == 0xf0) return S_F0;
        if (c >= 0xf1 && c <= 0xf3) return S_C3;
        if (c == 0xf4) return S_F4;
        return S_DEAD;
    case S_ESC:
        if (c && strchr("\"\\/bfnrt", c)) return S_NORM;
        return c == 'u' ? S_U1 : S_DEAD;
    case S_U1:   /* first hex digit of \uXXXX */
        if (c == 'd' || c == 'D') return S_UD;
        if (c == '0') return S_U0;
        return is_hex(c) ? S_H3 : S_DEAD;
    case S_UD:   /* \uD?: 0-7 plain, 8-B high surrogate, C-F lone low surrogate */
        if (c >= '0' && c <= '7') return S_H2;
        if (c == '8' || c == '9' || (c >= 'a' && c <= 'b') || (c >= 'A' && c <= 'B')) return S_HS2;
        return S_DEAD;
    case S_U0: return c == '0' ? S_U00 : is_hex(c) ? S_H2 : S_DEAD;
    case S_U00: return c == '0' ? S_U000 : is_hex(c) ? S_H1 : S_DEAD;
    case S_U000: return c == '0' ? S_DEAD : is_hex(c) ? S_NORM : S_DEAD;   /* no \u0000 */
    case S_H3: return is_hex(c) ? S_H2 : S_DEAD;
    case S_H2: return is_hex(c) ? S_H1 : S_DEAD;
    case S_H1: return is_hex(c) ? S_NORM : S_DEAD;
    case S_HS2: return is_hex(c) ? S_HS1 : S_DEAD;
    case S_HS1: return is_hex(c) ? S_LBS : S_DEAD;
    case S_LBS: return c == '\\' ? S_LU : S_DEAD;
    case S_LU: return c == 'u' ? S_LD : S_DEAD;
    case S_LD: return c == 'd' || c == 'D' ? S_LC : S_DEAD;
    case S_LC: return (c >= 'c' && c <= 'f') || (c >= 'C' && c <= 'F') ? S_H2 : S_DEAD;
    case S_C1: return c >= 0x80 && c <= 0xbf ? S_NORM : S_DEAD;
    case S_C2: return c >= 0x80 && c <= 0xbf ? S_C1 : S_DEAD;
    case S_C3: return c >= 0x80 && c <= 0xbf ? S_C2 : S_DEAD;
    case S_E0: return c >= 0xa0 && c <= 0xbf ? S_C1 : S_DEAD;   /* no overlong */
    case S_ED: return c >= 0x80 && c <= 0x9f ? S_C1 : S_DEAD;   /* no surrogates */
    case S_F0: return c >= 0x90 && c <= 0xbf ? S_C2 : S_DEAD;
    case S_F4: return c >= 0x80 && c <= 0x8f ? S_C2 : S_DEAD;   /* <= U+10FFFF */
    }
    return S_DEAD;
}

static void str_tab_init(void)
{
    for (int q = 0; q < S_COUNT; q++)
        for (int c = 0; c < 256; c++)
            str_tab[q][c] = str_step_slow(q, c);
}

/* ==== Building ==== */

typedef struct {
    gelem *e;
    uint32_t n, cap;
} seq;

typedef struct {
    seq *a;
    uint32_t n, cap;
} alts;

typedef struct {
    char *ptr;
    uint32_t rule;
} refmemo;

typedef struct {
    grammar *g;
    char *err;
    size_t errlen;
    int failed;
    const json_t *root;
    char path[1024];
    size_t plen;
    refmemo *refs;
    uint32_t n_refs, cap_refs;
    int depth;
    int32_t single[256];   /* set index of each one-byte set, -1 if none yet */
    int32_t s_digit;
    /* shared rules, -1 until built */
    int64_t r_ws, r_string, r_number, r_int, r_value, r_obj, r_frac_any;
} gctx;

static int gfail(gctx *c, const char *fmt, ...)
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

static int grow(void **p, uint32_t *cap, uint32_t need, size_t elsize)
{
    if (need <= *cap) return 0;
    uint32_t nc = *cap ? *cap : 16;
    while (nc < need) nc *= 2;
    void *q = realloc(*p, (size_t)nc * elsize);
    if (!q) return -1;
    *p = q;
    *cap = nc;
    return 0;
}

static int64_t set_add(gctx *c, const uint64_t bits[4])
{
    grammar *g = c->g;
    for (uint32_t i = 0; i < g->n_set; i++)
        if (!memcmp(g->set[i], bits, sizeof g->set[i])) return i;
    if (grow((void **)&g->set, &g->cap_set, g->n_set + 1, sizeof g->set[0]))
        return gfail(c, "out of memory");
    memcpy(g->set[g->n_set], bits, sizeof g->set[0]);
    return g->n_set++;
}

static int64_t set_range(gctx *c, int lo, int hi)
{
    if (lo == hi && c->single[lo] >= 0) return c->single[lo];
    uint64_t b[4] = { 0 };
    for (int x = lo; x <= hi; x++) b[x >> 6] |= 1ull << (x & 63);
    int64_t s = set_add(c, b);
    if (lo == hi && s >= 0) c->single[lo] = (int32_t)s;
    return s;
}

static int64_t set_chars(gctx *c, const char *chars)
{
    uint64_t b[4] = { 0 };
    for (const unsigned char *p = (const unsigned char *)chars; *p; p++) b[*p >> 6] |= 1ull << (*p & 63);
    return set_add(c, b);
}

static int seq_add(gctx *c, seq *s, int type, int64_t arg, int min, int max)
{
    if (arg < 0) return -1;   /* a failed sub-build: the error is already set */
    if (grow((void **)&s->e, &s->cap, s->n + 1, sizeof *s->e)) return gfail(c, "out of memory");
    s->e[s->n++] = (gelem){ (uint8_t)type, (uint8_t)min, (uint8_t)max, (uint32_t)arg };
    return 0;
}

static int seq_lit(gctx *c, seq *s, const char *bytes, size_t n)
{
    for (size_t i = 0; i < n; i++)
        if (seq_add(c, s, E_SET, set_range(c, (unsigned char)bytes[i], (unsigned char)bytes[i]), 0, 0)) return -1;
    return 0;
}

static int seq_str(gctx *c, seq *s, const char *z) { return seq_lit(c, s, z, strlen(z)); }
static int seq_ref(gctx *c, seq *s, int64_t rule) { return seq_add(c, s, E_REF, rule, 0, 0); }
static int seq_rep(gctx *c, seq *s, int64_t set, int min, int max) { return seq_add(c, s, E_REP, set, min, max); }

/* A new empty alternative in a; the pointer is valid until the next call. */
static seq *alt_new(gctx *c, alts *a)
{
    if (grow((void **)&a->a, &a->cap, a->n + 1, sizeof *a->a)) {
        gfail(c, "out of memory");
        return NULL;
    }
    a->a[a->n] = (seq){ 0 };
    return &a->a[a->n++];
}

static void alts_free(alts *a)
{
    for (uint32_t i = 0; i < a->n; i++) free(a->a[i].e);
    free(a->a);
    *a = (alts){ 0 };
}

static int64_t rule_new(gctx *c)
{
    grammar *g = c->g;
    if (grow((void **)&g->rule, &g->cap_rule, g->n_rule + 1, sizeof *g->rule)) return gfail(c, "out of memory");
    g->rule[g->n_rule] = (grule){ 0, 0 };
    return g->n_rule++;
}

/* Give rule r the alternatives in a (consumed). */
static int rule_def(gctx *c, int64_t r, alts *a)
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

static int64_t rule_make(gctx *c, alts *a)
{
    int64_t r = c->failed ? -1 : rule_new(c);
    if (rule_def(c, r, a)) return -1;
    return r;
}

/* A rule with one alternative, the sequence s (consumed). */
static int64_t rule_seq(gctx *c, seq *s)
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

static int64_t rule_ws(gctx *c)
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

static int64_t rule_string(gctx *c)
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

static int64_t rule_literal(gctx *c, const char *z)
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

static int64_t rule_value(gctx *c);

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
static int64_t rule_value(gctx *c)
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
    "anyOf", "allOf", "$ref", "$defs", "definitions",
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
            return gfail(c, "unsupported keyword '%s' beside '%s' at %s", k, kw, c->path);
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
        return gfail(c, "unsupported keyword 'items' (tuple form) at %s", c->path);
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

/* A string with maxLength (and minLength): '"' then min..max characters
 * from printable ASCII without '"' and '\\' (one byte each, so the byte
 * count is the character count), then '"'. Bounded strings give up escapes
 * and non-ASCII text; in exchange the output always ends: a model that never
 * writes a quote by itself is made to close the string at maxLength. */
static int64_t sch_string(gctx *c, const json_t *s)
{
    int64_t mn = 0, mx = -1;
    if (!json_object_get(s, "maxLength")) {
        if (json_object_get(s, "minLength"))
            return gfail(c, "'minLength' at %s needs 'maxLength' (at most %d)", c->path, G_MAX_STRLEN);
        return rule_string(c);
    }
    if (get_count(c, s, "minLength", &mn) || get_count(c, s, "maxLength", &mx)) return -1;
    if (mx > G_MAX_STRLEN) return gfail(c, "'maxLength' at %s above %d is not supported", c->path, G_MAX_STRLEN);
    if (mn > mx) return gfail(c, "'minLength' at %s exceeds 'maxLength'", c->path);
    uint64_t b[4] = { 0 };
    for (int x = 0x20; x <= 0x7e; x++)
        if (x != '"' && x != '\\') b[x >> 6] |= 1ull << (x & 63);
    seq q = { 0 };
    if (!seq_str(c, &q, "\"") && !seq_rep(c, &q, set_add(c, b), (int)mn, (int)mx)) seq_str(c, &q, "\"");
    return rule_seq(c, &q);
}

static int64_t sch_type(gctx *c, const json_t *s, const char *type)
{
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
        if (json_object_get(s, "minLength") || json_object_get(s, "maxLength")) names[n++] = "string";
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
        if (!in_list(sch_known, k)) return gfail(c, "unsupported keyword '%s' at %s", k, c->path);
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
            r = gfail(c, "unsupported keyword 'allOf' at %s (only a single schema)", c->path);
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

static void ctx_init(gctx *c, grammar *g, const json_t *root, char *err, size_t errlen)
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

static int compile_finish(gctx *c, int64_t root, grammar **out)
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
    pthread_once(&str_once, str_tab_init);
    grammar *g = calloc(1, sizeof *g);
    if (!g) {
        snprintf(err, errlen, "out of memory");
        return -1;
    }
    gctx c;
    ctx_init(&c, g, schema, err, errlen);
    int64_t root = sch_compile(&c, schema);
    return compile_finish(&c, root, out);
}

int grammar_compile_json_object(grammar **out, char *err, size_t errlen)
{
    *out = NULL;
    pthread_once(&str_once, str_tab_init);
    grammar *g = calloc(1, sizeof *g);
    if (!g) {
        snprintf(err, errlen, "out of memory");
        return -1;
    }
    gctx c;
    ctx_init(&c, g, NULL, err, errlen);
    rule_value(&c);
    return compile_finish(&c, c.failed ? -1 : c.r_obj, out);
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

/* ==== Stack sets ==== */

typedef struct {
    uint32_t *d;        /* per stack: len, then entries bottom..top */
    uint32_t n, cap;    /* words used in d */
    uint32_t *off;      /* where each stack starts in d */
    uint32_t *h;        /* hash of each stack (merging duplicates) */
    uint32_t ns, cap_s;
    int overflow;
} sset;

typedef struct {
    uint32_t *d;
    uint32_t n, cap;
} u32buf;

static void sset_free(sset *s)
{
    free(s->d);
    free(s->off);
    free(s->h);
    memset(s, 0, sizeof *s);
}

static inline void sset_clear(sset *s)
{
    s->n = s->ns = 0;
    s->overflow = 0;
}

static inline uint32_t stack_hash(const uint32_t *st, uint32_t len)
{
    uint32_t h = 2166136261u ^ len;
    for (uint32_t i = 0; i < len; i++) h = (h ^ st[i]) * 16777619u;
    return h;
}

/* Add a stack unless present. -1 on overflow or allocation failure. */
static int sset_add(sset *s, const uint32_t *st, uint32_t len)
{
    uint32_t h = stack_hash(st, len);
    for (uint32_t i = 0; i < s->ns; i++)
        if (s->h[i] == h && s->d[s->off[i]] == len && !memcmp(s->d + s->off[i] + 1, st, len * sizeof *st)) return 0;
    if (s->ns >= G_MAX_STACKS) {
        s->overflow = 1;
        return -1;
    }
    if (grow((void **)&s->d, &s->cap, s->n + len + 1, sizeof *s->d)) {
        s->overflow = 1;
        return -1;
    }
    if (s->ns == s->cap_s) {   /* off and h share one capacity */
        uint32_t nc = s->cap_s ? s->cap_s * 2 : 16;
        uint32_t *off = realloc(s->off, nc * sizeof *off);
        if (off) s->off = off;
        uint32_t *h = off ? realloc(s->h, nc * sizeof *h) : NULL;
        if (!h) {
            s->overflow = 1;
            return -1;
        }
        s->h = h;
        s->cap_s = nc;
    }
    s->off[s->ns] = s->n;
    s->h[s->ns++] = h;
    s->d[s->n++] = len;
    memcpy(s->d + s->n, st, len * sizeof *st);
    s->n += len;
    return 0;
}

static int sset_copy(sset *dst, const sset *src)
{
    sset_clear(dst);
    for (uint32_t i = 0; i < src->ns; i++)
        if (sset_add(dst, src->d + src->off[i] + 1, src->d[src->off[i]])) return -1;
    return 0;
}

/* Expand a stack until every resulting stack has a terminal on top (or is
 * empty) and add them to out. work: scratch for pending alternatives. */
static int expand(const grammar *g, sset *out, u32buf *work, const uint32_t *st, uint32_t len)
{
    uint32_t cur[G_MAX_DEPTH];
    uint32_t base = work->n, steps = 0;
    if (len > G_MAX_DEPTH) return 0;
    if (grow((void **)&work->d, &work->cap, work->n + len + 1, sizeof *work->d)) return -1;
    memcpy(work->d + work->n, st, len * sizeof *st);
    work->n += len;
    work->d[work->n++] = len;
    while (work->n > base) {
        len = work->d[--work->n];
        work->n -= len;
        memcpy(cur, work->d + work->n, len * sizeof *cur);
        for (;;) {
            if (++steps > G_MAX_EXPAND) {
                work->n = base;
                return -1;
            }
            if (len == 0) {
                sset_add(out, cur, 0);
                break;
            }
            uint32_t pos = cur[len - 1] & POS_MASK, sub = cur[len - 1] >> SUB_SHIFT;
            const gelem *e = &g->el[pos];
            if (e->type == E_END) {
                len--;   /* the entry below is the return position */
                continue;
            }
            if (e->type == E_SET || e->type == E_STR) {
                sset_add(out, cur, len);
                break;
            }
            if (e->type == E_REP) {
                if (sub < e->max) sset_add(out, cur, len);
                if (sub < e->min) break;
                cur[len - 1] = pos + 1;
                continue;
            }
            /* E_REF: the return position replaces the top (dropped in tail
             * position), then each alternative is entered */
            const grule *r = &g->rule[e->arg];
            if (g->el[pos + 1].type == E_END) len--;
            else cur[len - 1] = pos + 1;
            if (len + 1 > G_MAX_DEPTH || r->n == 0) break;   /* too deep: this path dies */
            if (grow((void **)&work->d, &work->cap, work->n + (r->n - 1) * (len + 2), sizeof *work->d)) {
                work->n = base;
                return -1;
            }
            for (uint32_t a = 1; a < r->n; a++) {
                memcpy(work->d + work->n, cur, len * sizeof *cur);
                work->n += len;
                work->d[work->n++] = g->alt[r->first + a];
                work->d[work->n++] = len + 1;
            }
            cur[len++] = g->alt[r->first];
        }
    }
    return out->overflow ? -1 : 0;
}

/* out = the stacks of in advanced by byte ch. -1 if none survives. */
static int sset_advance(const grammar *g, const sset *in, uint8_t ch, sset *out, u32buf *work)
{
    uint32_t cur[G_MAX_DEPTH];
    sset_clear(out);
    for (uint32_t i = 0; i < in->ns; i++) {
        const uint32_t *st = in->d + in->off[i] + 1;
        uint32_t len = in->d[in->off[i]];
        if (!len) continue;
        uint32_t pos = st[len - 1] & POS_MASK, sub = st[len - 1] >> SUB_SHIFT;
        const gelem *e = &g->el[pos];
        uint32_t top;
        int direct = 0;
        if (e->type == E_STR) {
            uint8_t ns = str_tab[sub][ch];
            if (ns == S_DEAD) continue;
            if (ns == S_CLOSE) {
                top = pos + 1;
            } else {
                top = pos | (uint32_t)ns << SUB_SHIFT;
                direct = 1;   /* still inside the string: already a terminal */
            }
        } else if (!(g->set[e->arg][ch >> 6] >> (ch & 63) & 1)) {
            continue;
        } else if (e->type == E_SET) {
            top = pos + 1;
        } else {   /* E_REP, sub < max holds for every stored stack */
            top = pos | (sub + 1) << SUB_SHIFT;
        }
        memcpy(cur, st, (len - 1) * sizeof *cur);
        cur[len - 1] = top;
        if (direct) sset_add(out, cur, len);
        else expand(g, out, work, cur, len);
        if (out->overflow) return -1;
    }
    return out->ns ? 0 : -1;
}

/* ==== States ==== */

typedef struct {
    uint32_t n_node;
    uint32_t max_depth;
    struct tnode *node;
    int32_t *tok;
    uint32_t n_tok;
    int32_t *root_tok;   /* tokens with an empty byte string (closing tries) */
    uint32_t n_root;
} trie;

typedef struct {
    sset a, b;           /* accept_bytes ping-pong */
    sset rest, close;    /* mask: non-string stacks, the state after a closing quote */
    sset *lv;            /* trie walk: the set at each depth */
    uint32_t n_lv;
    u32buf work;
    uint64_t *bits;
    uint32_t n_words;
} gscratch;

struct grammar_state {
    const grammar *g;
    sset cur;
    gscratch *sc;
};

static gscratch *state_scratch(grammar_state *s)
{
    if (!s->sc) s->sc = calloc(1, sizeof *s->sc);
    return s->sc;
}

grammar_state *grammar_state_new(const grammar *g)
{
    grammar_state *s = calloc(1, sizeof *s);
    if (!s) return NULL;
    s->g = g;
    u32buf work = { 0 };
    uint32_t st = g->start;
    if (expand(g, &s->cur, &work, &st, 1) || !s->cur.ns) {
        free(work.d);
        grammar_state_free(s);
        return NULL;
    }
    free(work.d);
    return s;
}

grammar_state *grammar_state_clone(const grammar_state *s)
{
    grammar_state *c = calloc(1, sizeof *c);
    if (!c) return NULL;
    c->g = s->g;
    if (sset_copy(&c->cur, &s->cur)) {
        grammar_state_free(c);
        return NULL;
    }
    return c;
}

static void scratch_free(gscratch *sc)
{
    if (!sc) return;
    sset_free(&sc->a);
    sset_free(&sc->b);
    sset_free(&sc->rest);
    sset_free(&sc->close);
    for (uint32_t i = 0; i < sc->n_lv; i++) sset_free(&sc->lv[i]);
    free(sc->lv);
    free(sc->work.d);
    free(sc->bits);
    free(sc);
}

void grammar_state_free(grammar_state *s)
{
    if (!s) return;
    sset_free(&s->cur);
    scratch_free(s->sc);
    free(s);
}

int grammar_accept_bytes(grammar_state *s, const char *bytes, size_t n)
{
    if (!n) return 0;
    gscratch *sc = state_scratch(s);
    if (!sc) return -1;
    const sset *in = &s->cur;
    sset *out = &sc->a, *spare = &sc->b;
    for (size_t i = 0; i < n; i++) {
        if (sset_advance(s->g, in, (uint8_t)bytes[i], out, &sc->work)) return -1;
        in = out;
        sset *t = out;
        out = spare;
        spare = t;
    }
    /* in is the result (one of sc->a/b): swap it into cur */
    sset *res = (sset *)in, tmp = s->cur;
    s->cur = *res;
    *res = tmp;
    return 0;
}

int grammar_is_complete(const grammar_state *s)
{
    for (uint32_t i = 0; i < s->cur.ns; i++)
        if (s->cur.d[s->cur.off[i]] == 0) return 1;
    return 0;
}

int grammar_is_finished(const grammar_state *s)
{
    return s->cur.ns == 1 && s->cur.d[s->cur.off[0]] == 0;
}

uint64_t grammar_state_hash(const grammar_state *s)
{
    uint64_t h = s->cur.ns;
    for (uint32_t i = 0; i < s->cur.ns; i++) {
        uint64_t x = s->cur.h[i] * 0x9e3779b97f4a7c15ull;
        h += x ^ (x >> 29);   /* sum: independent of the order of stacks */
    }
    return h;
}

int grammar_state_equal(const grammar_state *a, const grammar_state *b)
{
    if (a->g != b->g || a->cur.ns != b->cur.ns) return 0;
    for (uint32_t i = 0; i < a->cur.ns; i++) {
        const uint32_t *x = a->cur.d + a->cur.off[i];
        uint32_t j = 0;
        for (; j < b->cur.ns; j++) {
            const uint32_t *y = b->cur.d + b->cur.off[j];
            if (x[0] == y[0] && !memcmp(x + 1, y + 1, x[0] * sizeof *x)) break;
        }
        if (j == b->cur.ns) return 0;
    }
    return 1;
}

/* ==== Vocabulary ==== */

/* Trie nodes in preorder; a node's subtree ends at index end. */
struct tnode {
    uint32_t end;
    uint32_t tok_first, tok_n;
    uint16_t depth;   /* bytes from the root to this node inclusive */
    uint8_t byte;
};

enum { TK_NONE = 0, TK_TEXT = 1, TK_EOG = 2 };

struct grammar_vocab {
    int32_t n_vocab;
    uint8_t *kind;
    uint32_t *off;     /* token bytes: bytes[off[i] .. off[i+1]) */
    char *bytes;
    int32_t *eog;
    uint32_t n_eog;
    uint32_t n_words;  /* bitset words */
    trie all;
    uint64_t *stay[S_COUNT];   /* tokens that stay inside a string from each lexer state */
    trie close[S_COUNT];       /* tails after the closing quote, per lexer state */
};

typedef struct {
    const char *p;
    uint32_t len;
    int32_t id;
} titem;

static int titem_cmp(const void *a, const void *b)
{
    const titem *x = a, *y = b;
    uint32_t n = x->len < y->len ? x->len : y->len;
    int c = memcmp(x->p, y->p, n);
    if (c) return c;
    if (x->len != y->len) return x->len < y->len ? -1 : 1;
    return x->id < y->id ? -1 : x->id > y->id;
}

typedef struct {
    trie *t;
    uint32_t cap_node, cap_tok;
    int failed;
} tbuild;

/* Items [lo, hi) share their first depth bytes; those of exactly depth bytes
 * belong to the parent node (skipped here). */
static void trie_build_range(tbuild *b, titem *it, uint32_t lo, uint32_t hi, uint32_t depth)
{
    trie *t = b->t;
    uint32_t i = lo;
    while (i < hi && it[i].len == depth) i++;
    while (i < hi && !b->failed) {
        uint8_t byte = (uint8_t)it[i].p[depth];
        uint32_t j = i;
        while (j < hi && (uint8_t)it[j].p[depth] == byte) j++;
        if (grow((void **)&t->node, &b->cap_node, t->n_node + 1, sizeof *t->node)) {
            b->failed = 1;
            return;
        }
        uint32_t me = t->n_node++;
        uint32_t k = i;
        uint32_t first = t->n_tok;
        while (k < j && it[k].len == depth + 1) {
            if (grow((void **)&t->tok, &b->cap_tok, t->n_tok + 1, sizeof *t->tok)) {
                b->failed = 1;
                return;
            }
            t->tok[t->n_tok++] = it[k++].id;
        }
        if (depth + 1 > t->max_depth) t->max_depth = depth + 1;
        t->node[me] = (struct tnode){ 0, first, t->n_tok - first, (uint16_t)(depth + 1), byte };
        trie_build_range(b, it, i, j, depth + 1);
        t->node[me].end = t->n_node;
        i = j;
    }
}

static int trie_build(trie *t, titem *it, uint32_t n)
{
    memset(t, 0, sizeof *t);
    qsort(it, n, sizeof *it, titem_cmp);
    uint32_t r = 0;
    while (r < n && it[r].len == 0) r++;
    if (r) {
        t->root_tok = malloc(r * sizeof *t->root_tok);
        if (!t->root_tok) return -1;
        for (uint32_t i = 0; i < r; i++) t->root_tok[i] = it[i].id;
        t->n_root = r;
    }
    tbuild b = { t, 0, 0, 0 };
    trie_build_range(&b, it, 0, n, 0);
    return b.failed ? -1 : 0;
}

static void trie_free(trie *t)
{
    free(t->node);
    free(t->tok);
    free(t->root_tok);
}

/* Token bytes longer than this are not allowed under a grammar (no real
 * vocabulary has them; the trie depth is a uint16). */
#define G_MAX_TOKEN_BYTES 1024

static int vocab_string_tables(grammar_vocab *v)
{
    titem *it = malloc((size_t)v->n_vocab * sizeof *it);
    if (!it) return -1;
    for (int q = 0; q < S_COUNT; q++) {
        v->stay[q] = calloc(v->n_words, sizeof(uint64_t));
        if (!v->stay[q]) goto fail;
        uint32_t n = 0;
        for (int32_t id = 0; id < v->n_vocab; id++) {
            if (v->kind[id] != TK_TEXT) continue;
            const uint8_t *p = (const uint8_t *)v->bytes + v->off[id];
            uint32_t len = v->off[id + 1] - v->off[id], k = 0;
            uint8_t st = (uint8_t)q;
            for (; k < len; k++) {
                st = str_tab[st][p[k]];
                if (st >= S_CLOSE) break;
            }
            if (k == len) v->stay[q][id >> 6] |= 1ull << (id & 63);
            else if (st == S_CLOSE) it[n++] = (titem){ (const char *)p + k + 1, len - k - 1, id };
        }
        if (trie_build(&v->close[q], it, n)) goto fail;
    }
    free(it);
    return 0;
fail:
    free(it);
    return -1;
}

grammar_vocab *grammar_vocab_new(const tokenizer *t, char *err, size_t errlen)
{
    pthread_once(&str_once, str_tab_init);
    grammar_vocab *v = calloc(1, sizeof *v);
    int32_t n = tokenizer_n_vocab(t);
    size_t cap = tokenizer_max_token_bytes(t) + 1;
    char *buf = malloc(cap);
    titem *it = malloc((size_t)(n > 0 ? n : 1) * sizeof *it);
    if (!v || !buf || !it || n <= 0) goto oom;
    v->n_vocab = n;
    v->n_words = (uint32_t)((n + 63) / 64);
    v->kind = calloc((size_t)n, 1);
    v->off = calloc((size_t)n + 1, sizeof *v->off);
    v->eog = malloc((size_t)n * sizeof *v->eog);
    if (!v->kind || !v->off || !v->eog) goto oom;
    size_t total = 0, cap_bytes = 0;
    for (int32_t id = 0; id < n; id++) {
        int type = tokenizer_token_type(t, id);
        int len = 0;
        v->off[id] = (uint32_t)total;
        if (tokenizer_is_eog(t, id)) {
            v->kind[id] = TK_EOG;
            v->eog[v->n_eog++] = id;
        } else if (type == TOK_NORMAL || type == TOK_USER_DEFINED || type == TOK_BYTE) {
            len = tokenizer_token_bytes(t, id, 0, buf, cap);
            if (len > 0 && len <= G_MAX_TOKEN_BYTES) v->kind[id] = TK_TEXT;
            else len = 0;
        }
        if (total + (size_t)len > cap_bytes) {
            cap_bytes = (total + (size_t)len) * 2 + 4096;
            char *nb = realloc(v->bytes, cap_bytes);
            if (!nb) goto oom;
            v->bytes = nb;
        }
        if (len) memcpy(v->bytes + total, buf, (size_t)len);
        total += (size_t)len;
        if (total > UINT32_MAX / 2) goto oom;
    }
    v->off[n] = (uint32_t)total;
    uint32_t m = 0;
    for (int32_t id = 0; id < n; id++)
        if (v->kind[id] == TK_TEXT) it[m++] = (titem){ v->bytes + v->off[id], v->off[id + 1] - v->off[id], id };
    if (trie_build(&v->all, it, m) || vocab_string_tables(v)) goto oom;
    free(buf);
    free(it);
    return v;
oom:
    snprintf(err, errlen, n <= 0 ? "empty vocabulary" : "out of memory building the grammar vocabulary");
    free(buf);
    free(it);
    grammar_vocab_free(v);
    return NULL;
}

void grammar_vocab_free(grammar_vocab *v)
{
    if (!v) return;
    free(v->kind);
    free(v->off);
    free(v->bytes);
    free(v->eog);
    trie_free(&v->all);
    for (int q = 0; q < S_COUNT; q++) {
        free(v->stay[q]);
        trie_free(&v->close[q]);
    }
    free(v);
}

int32_t grammar_vocab_n(const grammar_vocab *v) { return v->n_vocab; }

int grammar_accept_token(grammar_state *s, const grammar_vocab *v, int32_t id)
{
    if (id < 0 || id >= v->n_vocab) return -1;
    if (v->kind[id] == TK_EOG) return grammar_is_complete(s) ? 0 : -1;
    if (v->kind[id] != TK_TEXT) return -1;
    return grammar_accept_bytes(s, v->bytes + v->off[id], v->off[id + 1] - v->off[id]);
}

/* ==== Masks ==== */

/* Depth-first walk of trie t from the stacks in start, setting the bit of
 * every token whose bytes keep some stack alive. */
static int trie_walk(const grammar *g, const trie *t, const sset *start, gscratch *sc, uint64_t *bits)
{
    if (!start->ns) return 0;
    for (uint32_t i = 0; i < t->n_root; i++) bits[t->root_tok[i] >> 6] |= 1ull << (t->root_tok[i] & 63);
    if (t->max_depth + 1 > sc->n_lv) {
        sset *lv = realloc(sc->lv, (t->max_depth + 1) * sizeof *lv);
        if (!lv) return -1;
        memset(lv + sc->n_lv, 0, (t->max_depth + 1 - sc->n_lv) * sizeof *lv);
        sc->lv = lv;
        sc->n_lv = t->max_depth + 1;
    }
    for (uint32_t i = 0; i < t->n_node;) {
        const struct tnode *nd = &t->node[i];
        const sset *parent = nd->depth == 1 ? start : &sc->lv[nd->depth - 1];
        if (sset_advance(g, parent, nd->byte, &sc->lv[nd->depth], &sc->work)) {
            i = nd->end;   /* dead: skip the subtree */
            continue;
        }
        for (uint32_t k = 0; k < nd->tok_n; k++) {
            int32_t id = t->tok[nd->tok_first + k];
            bits[id >> 6] |= 1ull << (id & 63);
        }
        i++;
    }
    return 0;
}

/* The allowed tokens as a bitset in sc->bits. */
static int mask_bits(grammar_state *s, const grammar_vocab *v)
{
    gscratch *sc = state_scratch(s);
    if (!sc) return -1;
    if (sc->n_words < v->n_words) {
        free(sc->bits);
        sc->bits = malloc(v->n_words * sizeof *sc->bits);
        if (!sc->bits) {
            sc->n_words = 0;
            return -1;
        }
        sc->n_words = v->n_words;
    }
    uint64_t *bits = sc->bits;
    memset(bits, 0, v->n_words * sizeof *bits);
    const grammar *g = s->g;
    const sset *cur = &s->cur;
    uint32_t stk[G_MAX_DEPTH];
    sset_clear(&sc->rest);
    for (uint32_t i = 0; i < cur->ns; i++) {
        const uint32_t *st = cur->d + cur->off[i] + 1;
        uint32_t len = cur->d[cur->off[i]];
        if (!len) continue;
        uint32_t pos = st[len - 1] & POS_MASK, q = st[len - 1] >> SUB_SHIFT;
        if (g->el[pos].type != E_STR) {
            sset_add(&sc->rest, st, len);
            continue;
        }
        /* inside a string: the precomputed tokens that stay in it, then the
         * tails of the tokens that close it, from the state after the quote */
        const uint64_t *stay = v->stay[q];
        for (uint32_t w = 0; w < v->n_words; w++) bits[w] |= stay[w];
        memcpy(stk, st, len * sizeof *stk);
        stk[len - 1] = pos + 1;
        sset_clear(&sc->close);
        expand(g, &sc->close, &sc->work, stk, len);
        if (trie_walk(g, &v->close[q], &sc->close, sc, bits)) return -1;
    }
    if (trie_walk(g, &v->all, &sc->rest, sc, bits)) return -1;
    if (grammar_is_complete(s))
        for (uint32_t i = 0; i < v->n_eog; i++) bits[v->eog[i] >> 6] |= 1ull << (v->eog[i] & 63);
    return 0;
}

int64_t grammar_mask(grammar_state *s, const grammar_vocab *v, uint8_t *allowed)
{
    if (mask_bits(s, v)) {
        memset(allowed, 0, (size_t)v->n_vocab);
        return 0;
    }
    const uint64_t *bits = s->sc->bits;
    int64_t count = 0;
    for (int32_t i = 0; i < v->n_vocab; i++) {
        allowed[i] = (uint8_t)(bits[i >> 6] >> (i & 63) & 1);
        count += allowed[i];
    }
    return count;
}

int64_t grammar_mask_logits(grammar_state *s, const grammar_vocab *v, float *logits)
{
    if (mask_bits(s, v)) {
        for (int32_t i = 0; i < v->n_vocab; i++) logits[i] = -INFINITY;
        return 0;
    }
    const uint64_t *bits = s->sc->bits;
    int64_t count = 0;
    for (uint32_t w = 0; w < v->n_words; w++) {
        uint64_t x = bits[w];
        int32_t base = (int32_t)w * 64, lim = v->n_vocab - base < 64 ? v->n_vocab - base : 64;
        if (x == ~0ull && lim == 64) {
            count += 64;
            continue;
        }
        for (int32_t b = 0; b < lim; b++) {
            if (x >> b & 1) count++;
            else logits[base + b] = -INFINITY;
        }
    }
    return count;
}

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
 * This file is the builder (sets, sequences, rules), the shared rules
 * (whitespace, strings, numbers, any value), the left-recursion check and
 * the entry points that finish a grammar; grammar_range.c lowers numeric
 * bounds to digit rules, grammar_schema.c compiles a JSON schema with them;
 * grammar_match.c is the runtime (lexer, stack sets, states, masks);
 * grammar_internal.h is what they share.
 */
#include "engine/grammar_internal.h"


#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

/* ==== Building ==== */

int gvfail(gctx *c, const char *fmt, va_list ap)
{
    if (!c->failed && c->errlen) vsnprintf(c->err, c->errlen, fmt, ap);
    c->failed = 1;
    return -1;
}

int gfail(gctx *c, const char *fmt, ...)
{
    va_list ap;
    va_start(ap, fmt);
    gvfail(c, fmt, ap);
    va_end(ap);
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

int64_t digit_set(gctx *c)
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
int64_t rule_frac_any(gctx *c)
{
    if (c->r_frac_any >= 0) return c->r_frac_any;
    alts a = { 0 };
    alt_new(c, &a);
    seq *s = alt_new(c, &a);
    if (s && !seq_str(c, s, ".")) seq_rep(c, s, digit_set(c), 1, G_FRAC_DIGITS);
    return c->r_frac_any = rule_make(c, &a);
}

int64_t rule_number(gctx *c)
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

int64_t rule_integer(gctx *c)
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
int64_t rule_map(gctx *c, int64_t val)
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
int64_t rule_list_any(gctx *c, int64_t val)
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

int grammar_ctx_init(gctx *c, const json_t *root, char *err, size_t errlen)
{
    grammar *g = calloc(1, sizeof *g);
    if (!g) {
        snprintf(err, errlen, "out of memory");
        return -1;
    }
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
    return 0;
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

int grammar_compile_json_object(grammar **out, char *err, size_t errlen)
{
    *out = NULL;
    grammar_lexer_init();
    gctx c;
    if (grammar_ctx_init(&c, NULL, err, errlen)) return -1;
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

/* grammar_lower.c - a text grammar's code-point tree (grammar_text.c
 * parses it) lowered to grammar.c's byte grammar: classes as UTF-8 byte
 * sequences, repeats as unrolled copies or tail-recursive rules, JSON
 * escapes inside a JSON string; and the entry points that check the text,
 * parse it and lower it (grammar_regex_rule, grammar_compile_regex,
 * grammar_compile_gbnf, grammar_compile_choice). */


#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "engine/grammar_text_internal.h"

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
        /* cp < 0x20 here: the escape is always \u00XX, written digit by
         * digit (snprintf's "%04x" of a full unsigned could not fit b) */
        static const char hex[] = "0123456789abcdef";
        char u[7] = { '\\', 'u', '0', '0', hex[cp >> 4 & 0xF], hex[cp & 0xF], 0 };
        return seq_str(L->c, s, u);
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
    gctx c;
    if (grammar_ctx_init(&c, NULL, err, errlen)) return -1;
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
    gctx c;
    if (grammar_ctx_init(&c, NULL, err, errlen)) return -1;
    alts a = { 0 };
    for (int i = 0; i < n && !c.failed; i++) {
        if (!choices[i][0]) { gfail(&c, "choice %d is empty", i); break; }
        seq *s = alt_new(&c, &a);
        if (s) seq_str(&c, s, choices[i]);
    }
    int64_t root = c.failed ? (alts_free(&a), -1) : rule_make(&c, &a);
    return grammar_compile_finish(&c, root, out);
}

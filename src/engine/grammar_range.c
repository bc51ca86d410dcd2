/* grammar_range.c - numeric bounds as byte grammars: an integer range
 * [lo, hi] (rule_int_range) and a decimal range with open or closed ends
 * (rule_dec_range) become rules over digit strings, so that "minimum" and
 * "maximum" hold while the number is being written, not only at its end.
 * grammar_schema.c calls them for integer and number schemas.
 */
#include "engine/grammar_internal.h"

#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

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
int64_t rule_int_range(gctx *c, int64_t lo, int64_t hi)
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
int64_t rule_dec_range(gctx *c, double lo, int lo_ex, double hi, int hi_ex)
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

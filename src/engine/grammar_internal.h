/* grammar_internal.h - what the byte grammar's files share: grammar.c (the
 * builder, shared rules, the left-recursion check, finishing a grammar),
 * grammar_range.c (numeric bounds as digit rules), grammar_schema.c (JSON
 * Schema -> rules), grammar_lower.c (regular expressions and GBNF -> rules)
 * and grammar_match.c (the runtime: the string lexer, stack sets, states,
 * the vocabulary trie, masks): the limits, the element encoding, the grammar
 * itself, the builder. Private to these files (like model_internal.h). */
#ifndef TANDEM_GRAMMAR_INTERNAL_H
#define TANDEM_GRAMMAR_INTERNAL_H

#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <stdlib.h>

#include "engine/grammar.h"

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

static inline int grow(void **p, uint32_t *cap, uint32_t need, size_t elsize)
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

/* ==== Building (grammar.c; grammar_text.c compiles regular expressions
 * and GBNF with the same builder) ==== */

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
    char bad_kw[48];       /* a refused keyword, "" for other errors */
    char bad_at[1024];     /* the JSON pointer of the schema holding it */
} gctx;

int gfail(gctx *c, const char *fmt, ...) __attribute__((format(printf, 2, 3)));
/* gfail with a va_list (for wrappers that note more before failing). */
int gvfail(gctx *c, const char *fmt, va_list ap) __attribute__((format(printf, 2, 0)));
int64_t set_add(gctx *c, const uint64_t bits[4]);
int64_t set_range(gctx *c, int lo, int hi);
int64_t set_chars(gctx *c, const char *chars);
int seq_add(gctx *c, seq *s, int type, int64_t arg, int min, int max);
int seq_lit(gctx *c, seq *s, const char *bytes, size_t n);
int seq_str(gctx *c, seq *s, const char *z);
int seq_ref(gctx *c, seq *s, int64_t rule);
int seq_rep(gctx *c, seq *s, int64_t set, int min, int max);
/* A new empty alternative in a; the pointer is valid until the next call. */
seq *alt_new(gctx *c, alts *a);
void alts_free(alts *a);
int64_t rule_new(gctx *c);
/* Give rule r the alternatives in a (consumed). */
int rule_def(gctx *c, int64_t r, alts *a);
int64_t rule_make(gctx *c, alts *a);
/* A rule with one alternative, the sequence s (consumed). */
int64_t rule_seq(gctx *c, seq *s);
int64_t rule_ws(gctx *c);
int64_t rule_string(gctx *c);
int64_t rule_value(gctx *c);
int64_t rule_literal(gctx *c, const char *z);
/* The shared rules the schema compiler and the ranges build on (grammar.c):
 * the set [0-9], an optional fraction, any JSON number or integer, an
 * object with any string keys and values of rule val, an array of val. */
int64_t digit_set(gctx *c);
int64_t rule_frac_any(gctx *c);
int64_t rule_number(gctx *c);
int64_t rule_integer(gctx *c);
int64_t rule_map(gctx *c, int64_t val);
int64_t rule_list_any(gctx *c, int64_t val);
/* grammar_range.c: integers lo..hi (lo <= hi); decimals lo..hi (no
 * exponent), each side inclusive or strict (lo_ex, hi_ex). */
int64_t rule_int_range(gctx *c, int64_t lo, int64_t hi);
int64_t rule_dec_range(gctx *c, double lo, int lo_ex, double hi, int hi_ex);

/* A compile context over a new grammar (root: the schema $ref resolves in,
 * or NULL); 0, or -1 with "out of memory" in err. */
int grammar_ctx_init(gctx *c, const json_t *root, char *err, size_t errlen);
/* Checks left recursion, adds the start rule; *out = g, or frees g and -1. */
int grammar_compile_finish(gctx *c, int64_t root, grammar **out);
/* grammar_text.c: a regular expression (ECMA-262 subset) as a rule. json:
 * the text is the body of a JSON string (what JSON escapes is written
 * escaped); search: match anywhere (JSON Schema "pattern": a branch without
 * '^' / '$' may have anything before / after it), else the whole text. */
int64_t grammar_regex_rule(gctx *c, const char *pattern, size_t len, int json, int search);

/* Builds the string lexer's table once (grammar_match.c); the compile entry
 * points call it so that every grammar's states can run. */
void grammar_lexer_init(void);

#endif

/* grammar_internal.h - what grammar.c (the schema compiler: JSON Schema ->
 * rules) and grammar_match.c (the runtime: the string lexer, stack sets,
 * states, the vocabulary trie, masks) share: the limits, the element
 * encoding, the grammar itself. Private to these two files (like
 * model_internal.h). */
#ifndef TANDEM_GRAMMAR_INTERNAL_H
#define TANDEM_GRAMMAR_INTERNAL_H

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

/* Builds the string lexer's table once (grammar_match.c); the compile entry
 * points call it so that every grammar's states can run. */
void grammar_lexer_init(void);

#endif

/* grammar_text_internal.h - between the two halves of grammars written as
 * text (not part of the interface: grammar.h is): grammar_text.c parses a
 * regular expression or GBNF into the code-point tree declared here,
 * grammar_lower.c lowers that tree to grammar.c's byte grammar and holds
 * the entry points. grammar_internal.h is the byte grammar's builder. */

#ifndef TANDEM_ENGINE_GRAMMAR_TEXT_INTERNAL_H
#define TANDEM_ENGINE_GRAMMAR_TEXT_INTERNAL_H

#include "engine/grammar_internal.h"

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

/* ==== grammar_text.c ==== */

static inline int at_end(const gparse *p) { return p->i >= p->n; }
int gp_fail(gparse *p, const char *fmt, ...) __attribute__((format(printf, 2, 3)));
void gparse_free(gparse *p);
gnode *rx_alt(gparse *p, int top, int *search);
int gb_parse(gparse *p);

#endif /* TANDEM_ENGINE_GRAMMAR_TEXT_INTERNAL_H */

/* chain_plan.h - where to cut a model into the slices of a layer-split
 * prefill chain (issue 41; docs/layer-split.md, "Planning a chain"): for
 * N nodes of given relative speeds, the half-block bounds (wire_act.h:
 * "L" or "L.5") that minimise the slowest node's time for one prompt.
 *
 * The cost of each half block is counted in FLOPs (a multiply-add is 2)
 * for a prompt of T tokens computed from position 0, from the model's
 * shape alone:
 *   attention half of block l: Q/K/V projections 2 T E (qd + 2 kvd), the
 *     causal attention 2 n_head hd T (T + 1) (scores and weighted sum, row
 *     p reading p + 1 positions), the output projection 2 T qd E;
 *   feed-forward half: 6 T E n_ff (gate, up, down), or for a MoE block the
 *     router 2 T E n_expert plus 6 T E n_ff_exp for each of the n_used
 *     experts a row is sent to;
 *   the last block: its Q/K/V projections alone when no row of the prompt
 *     needs logits (a chain's case: the decode node computes the prompt's
 *     last position itself, forward.c stops after the last block's K/V);
 *     with logit_rows > 0 the whole block plus the output head
 *     2 logit_rows E n_vocab on the last half;
 *   the embedding lookup (T E, a row copy per token) on the first half.
 * Norms, RoPE and the element-wise steps (O(T E) each) are left out.
 *
 * The FLOPs come in two kinds (chain_plan_kinds): the weight products
 * (projections, feed-forward, router, head, and the embedding copy) and
 * the causal attention's score and value products, f32 over the cache,
 * which on the CPU run at about half the quantised products' FLOP rate
 * (docs/layer-split.md, "Planning a chain"). A half block's cost is its
 * weight FLOPs plus its attention FLOPs / R, R the attention's rate as a
 * fraction of the weight products' (chain_plan_weigh; R = 1 is the plain
 * FLOP count; chain_calib.h measures R). A node's time is its slices' cost
 * over its rate; the plan minimises the
 * largest (the pipeline runs at its slowest stage), every slice computing
 * at least one block's attention (chain_spec.h), so N <= n_layer. */
#ifndef TANDEM_CHAIN_PLAN_H
#define TANDEM_CHAIN_PLAN_H

#include <stddef.h>

#include "engine/model.h"
#include "net/chain_spec.h"

/* Prompt tokens a plan is made for: more than any context a model here
 * takes (MODEL_MAX_CTX, 2^24). */
#define CHAIN_PLAN_MAX_TOKENS (1 << 24)
/* A node's rate is relative: 1e-6..1e6 bounds the ratio of two nodes'
 * speeds far beyond any two machines, and keeps cost / rate finite. */
#define CHAIN_PLAN_RATE_MIN 1e-6
#define CHAIN_PLAN_RATE_MAX 1e6

/* The attention's rate relative to the weight products': 1e-3..1e3 is
 * beyond any kernel pair (measured 0.4-0.6 here), and keeps cost finite. */
#define CHAIN_PLAN_ATTN_RATE_MIN 1e-3
#define CHAIN_PLAN_ATTN_RATE_MAX 1e3

/* The kinds of work a half block's FLOPs are counted in. */
enum { CHAIN_KIND_MAT = 0, CHAIN_KIND_ATTN = 1, CHAIN_KINDS = 2 };

typedef struct {
    int n;                                  /* nodes */
    int lo[CHAIN_SPEC_MAX], hi[CHAIN_SPEC_MAX];   /* half blocks */
    double flops[CHAIN_SPEC_MAX];           /* each slice's cost */
    double time[CHAIN_SPEC_MAX];            /* flops / the node's rate */
    double slowest;                         /* the largest time */
    double total;                           /* the model's cost (all slices) */
} chain_plan;

/* The cost of each of the 2 n_layer half blocks (out: 2 * h->n_layer
 * doubles) for a prompt of tokens positions, logit_rows of which need
 * logits (0..tokens). 0, or -1 with a message for a shape or a count out
 * of range. */
int chain_plan_costs(const model_hparams *h, int tokens, int logit_rows, double *out, char *err, size_t errlen);
/* The same FLOPs by kind: out[k * CHAIN_KINDS + CHAIN_KIND_MAT] the weight
 * products of half block k, [... + CHAIN_KIND_ATTN] its attention's score
 * and value products (out: 2 * n_layer * CHAIN_KINDS doubles); their sum
 * is chain_plan_costs'. 0, or -1 with a message as chain_plan_costs. */
int chain_plan_kinds(const model_hparams *h, int tokens, int logit_rows, double *out, char *err, size_t errlen);
/* The cost of each of n_half half blocks from their kinds[] at an
 * attention rate of attn_rate (the weight products' rate 1): weight FLOPs
 * + attention FLOPs / attn_rate; attn_rate 1 gives chain_plan_costs'
 * numbers exactly. 0, or -1 with a message (attn_rate out of
 * CHAIN_PLAN_ATTN_RATE_MIN..MAX, or not a number). */
int chain_plan_weigh(const double *kinds, int n_half, double attn_rate, double *out, char *err, size_t errlen);
/* FLOPs of one prompt row through one block's weight products (Q/K/V,
 * output, feed-forward or router and used experts); and of the causal
 * attention of rows [pos0, pos0 + n), row p reading p + 1 positions. */
double chain_plan_row_mat(const model_hparams *h);
double chain_plan_attn_span(const model_hparams *h, double pos0, double n);
/* The bounds for n nodes of rates[0..n) (NULL: all 1) over the n_half
 * half blocks of cost[] that minimise the slowest node's time, the first
 * slice at 0, the last ending at n_half, each computing one block's
 * attention (an even half block). Exact (dynamic programming over every
 * bound, n * n_half^2 steps: 67M for 16 nodes of 1,024 blocks). 0, or -1
 * with a message (n out of 1..min(n_half / 2, CHAIN_SPEC_MAX), a rate out
 * of range, a cost negative or not finite). */
int chain_plan_solve(const double *cost, int n_half, int n, const double *rates, chain_plan *out, char *err,
                     size_t errlen);
/* The even split by layer count for n nodes of n_layer blocks: slice k is
 * [floor(k L / n), floor((k + 1) L / n)) blocks (L / 2 for two, as
 * tools/bench_chain.sh's --split count), its costs filled in as
 * chain_plan_solve's. 0, or -1 when n is out of 1..min(n_layer,
 * CHAIN_SPEC_MAX). */
int chain_plan_count(const double *cost, int n_layer, int n, const double *rates, chain_plan *out);
/* Fills p's flops, time, slowest and total from its bounds (n, lo, hi)
 * over cost[] at rates (NULL: all 1): a plan made at one cost priced at
 * another. */
void chain_plan_price(chain_plan *p, const double *cost, const double *rates);
/* The plan's chain spec, "HOST1:PORT/0:7.5,HOST2:PORT/7.5:15,...", with
 * hosts[i] where given (NULL or a NULL entry: the placeholder "HOSTi:PORT").
 * Returns the length written (cut to len - 1 as snprintf). */
size_t chain_plan_spec(const chain_plan *p, const char *const *hosts, char *buf, size_t len);

#endif

/* chain_calib.h - the attention's rate against the weight products' on
 * this machine, for the chain planner (chain_plan.h, chain_plan_weigh;
 * `tandem chain-plan --attn-rate measure`; docs/layer-split.md, "Planning
 * a chain").
 *
 * It loads the model's first block alone (a one-block slice: the loader's
 * checks, the backend's real kernels on the model's own weights and head
 * dims) on one CPU thread, and times one pass of `rows` prompt rows twice
 * over: at positions 0.. (attention over few positions) and at the end of
 * a `tokens`-long prompt (over tokens - rows earlier positions, filled with
 * random K/V rows), each the least of two or more runs (a quarter
 * second in all at least), in CPU seconds (what load
 * from other processes leaves alone better than wall time). The two passes
 * do the same weight products; their difference is attention alone, so
 *   attention rate = (A_late - A_early) / (t_late - t_early)
 *   weight rate    = W / (t_early - A_early / attention rate)
 * with W and A counted as chain_plan_kinds counts them (norms, RoPE and
 * the routing fall to the weight products' time, as the planner leaves
 * them out of its count).
 *
 * What it assumes: every node of a chain has the same ratio of attention
 * to weight-product speed as this machine (the nodes' overall speeds are
 * what --rates carries), at one thread; and the rate at the measured span
 * holds for every span of the prompt (the attention's cost is linear in
 * the positions each row reads). */
#ifndef TANDEM_CHAIN_CALIB_H
#define TANDEM_CHAIN_CALIB_H

#include <stddef.h>

/* Longest prompt measured at: a longer plan is measured at 16,384 (a
 * pass's attention then reads 16 K positions: seconds for the largest
 * shapes here). */
#define CHAIN_CALIB_MAX_TOKENS 16384
/* Rows per timed pass: 16..512 (the CPU's pass size; slice nodes pass
 * 256-row chunks at 4,096 tokens, and fewer rows run a product slower). */
#define CHAIN_CALIB_MIN_ROWS 16
#define CHAIN_CALIB_MAX_ROWS 512
/* The block's K/V rows measured over, f16: at most 1 GiB. */
#define CHAIN_CALIB_MAX_KV_BYTES (1ull << 30)

typedef struct {
    int tokens, rows;              /* the prompt length and the rows of a pass measured */
    double mat_flops;              /* one pass's weight products */
    double attn_early, attn_late;  /* its attention at positions 0.. and tokens - rows.. */
    double t_early, t_late;        /* CPU seconds, least of two */
    double mat_rate, attn_rate;    /* FLOP/s */
    double ratio;                  /* attn_rate / mat_rate: chain_plan_weigh's attn_rate */
} chain_calib;

/* Measures the model at path for a prompt of tokens (cut to
 * CHAIN_CALIB_MAX_TOKENS) in passes of rows (CHAIN_CALIB_MIN..MAX_ROWS, at
 * most tokens / 2). 0, or -1 with a message: a file the loader refuses, a
 * count out of range, a cache over CHAIN_CALIB_MAX_KV_BYTES, or times that
 * do not give a rate (the attention's share too small to measure: a
 * longer prompt measures it). */
int chain_calib_measure(const char *path, int tokens, int rows, chain_calib *out, char *err, size_t errlen);

#endif

/* deadline.h - the total deadline of one prompt's remote prefill, shared by
 * the decode side of a handoff (node/handoff.c, node/chain.c), the prefill
 * node's limit on one request (node/node_prefill_job.c) and the router's
 * whole-request limit (router/router_request.c), so the three agree.
 *
 * A dead or hung prefill node is caught by the stall timeout (no frame for
 * --timeout-ms, default 10 s: a prefill node streams every layer of every
 * chunk, far more often). The total deadline only bounds a peer that keeps
 * sending but never finishes, so it must leave a long prompt on a slow
 * node, which does progress, its time: it grows with the prompt. An
 * operator's explicit limit (--handoff-deadline-ms, --request-ms, `tandem
 * run --deadline-ms`) replaces it whatever the prompt.
 */
#ifndef TANDEM_DEADLINE_H
#define TANDEM_DEADLINE_H

/* The least total deadline: any prompt may take this long (the fixed limit
 * the nodes had before it scaled). */
#define DEADLINE_BASE_MS 300000
/* Per prompt position beyond that: a 16,384-token prompt of Qwen3-0.6B
 * Q8_0 took 426 s to prefill on one core (26 ms a position, attention
 * growing with the length); 50 ms leaves it 1.9 times that (819 s) for a
 * loaded node. Below 6,000 positions the base rules. */
#define DEADLINE_MS_PER_POSITION 50
/* Never more than a day (an int of milliseconds holds 24 days). */
#define DEADLINE_MAX_MS 86400000

/* The default total deadline (ms) of a remote prefill of n_positions:
 * max(DEADLINE_BASE_MS, n_positions x DEADLINE_MS_PER_POSITION), at most
 * DEADLINE_MAX_MS. */
int deadline_prefill_ms(long long n_positions);

/* What the default grants a prompt of n_positions beyond the base (0 below
 * 6,000 positions): the router adds it to its whole-request limit. */
int deadline_prefill_extra_ms(long long n_positions);

#endif

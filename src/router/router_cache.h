/* router_cache.h - routing by cache and capacity (issue 47): what each node
 * holds, and the pick of a decode node (with its plan) by expected time to
 * first token. Private to src/router/ (router_internal.h has the types).
 *
 * What a node holds comes from two sources:
 *   - its report: a decode node's GET /v1/stats "prefix" (node/prefix_report.h)
 *     lists the chained block hashes (base/prefix_hash.h) of the prefixes in
 *     its slots (and, once it has one, its KV store's tiers), and per prefill
 *     node what that connection's session there holds;
 *   - this router's own routing: a request sent to a node is held there
 *     (prefilled there: from the moment it is sent; through a prefill node:
 *     from its first token, when its rows have arrived and the session it
 *     used is free again), until a report asked for after the request ended
 *     says otherwise.
 * A report older than RC_STALE_INTERVALS health intervals counts for
 * nothing: without fresh knowledge the pick is by capacity alone (today's
 * order), and a wrong guess costs time, never a wrong answer (nodes compare
 * token ids before they reuse a row).
 */
#ifndef TANDEM_ROUTER_CACHE_H
#define TANDEM_ROUTER_CACHE_H

#include "router/router_internal.h"

/* Hashes of one prompt looked at: 4096 blocks of 64 tokens, 256k positions. */
#define RC_PROMPT_BLOCKS 4096
/* A report's hashes kept per node, in all (prefix_report.h sends at most
 * 4096 per node; room for a newer node that sends more tiers). */
#define RC_HELD_MAX 16384
/* Prefill-node connections per decode node, and hashes per connection. */
#define RC_PEERS 16
#define RC_PEER_MAX 1024
/* Routing decisions remembered per decode node. */
#define RC_ROUTED_MAX 64
/* A report this many health intervals old (and at least RC_STALE_MIN_MS)
 * is stale: the node may have evicted anything since. */
#define RC_STALE_INTERVALS 5
#define RC_STALE_MIN_MS 5000.0
/* Slot hold time assumed until one is measured. */
#define RC_HOLD_DEFAULT_MS 1000.0

typedef struct rc_report rc_report;

/* Prefill node p takes q's prompt: its context (its HELLO's "; ctx N",
 * prefill_rate.h) is unknown or at least the prompt's count. */
int rc_prefill_fits(const rt_node *p, const rt_req *q);

/* Parses a decode node's "prefix" object (hostile input: every count and
 * string bounded); NULL when absent or malformed (the node is then treated
 * as reporting nothing). No lock needed. */
rc_report *rc_report_parse(json_t *prefix);
void rc_report_free(rc_report *rep);
/* Installs a parsed report for node i (taken; NULL clears it), asked for at
 * asked_ms (rt_now_ms before the probe): ended requests older than it are
 * forgotten. Caller holds mu. */
void rc_report_apply_locked(router *r, int i, rc_report *rep, double asked_ms);
/* Frees node i's cache state (rt_node_forget_locked, router_stop). Caller holds mu. */
void rc_node_free_locked(rt_node *n);

/* A request's prompt ids (from the decode node's tokenizer), taken; the
 * hashes per seed are made on demand. */
void rc_prompt_set(rt_req *q, int32_t *ids, int n);
void rc_prompt_free(rt_req *q);

/* The decode node for q (skipping skip[]) by expected time to first token:
 * the wait for a slot (requests ahead per slot times the time a request
 * holds one there), plus, when q's prompt is known and cache awareness is
 * on, the cheaper of its prefill there or through the best prefill node
 * (router_decide with the positions each holds). Near-ties keep the
 * capacity order of today (free slots, then fewer requests). With
 * with_plan: *pidx (-1: local) and *dec hold the plan. -1 when none.
 * Caller holds mu. */
int rc_choose_locked(rt_req *q, const int *skip, int with_plan, int *pidx, router_decision *dec);
/* The router_cost_in of decode node d and prefill node p (-1: none) for
 * q, cached positions included when known. Caller holds mu. */
void rc_cost_in_locked(rt_req *q, int d, int p, int ours_counted, router_cost_in *in);

/* q was sent to decode node d (through prefill node p, -1: local). Caller holds mu. */
void rc_note_route_locked(rt_req *q, int d, int p);
/* q's first token came from d: its prompt's rows are in d's slots and the
 * prefill-node session it used is free again. Caller holds mu. */
void rc_note_first_locked(rt_req *q, int d);
/* q's attempt on d ended: ok, its prompt is held there now; else forget it. Caller holds mu. */
void rc_note_end_locked(rt_req *q, int d, int ok);

#endif

/* draft.h - where a decode node's speculative drafts come from.
 *
 * Two sources, chosen per node (both may be on: lookup first, the model for
 * the sequences lookup found nothing for):
 *   - prompt lookup (--lookup N): up to N drafts copied from the history
 *     (prompt + generated text) after the longest recurring n-gram
 *     (engine/spec.h, spec_lookup); no second model;
 *   - a draft model (--draft-model FILE, --draft-max N): a smaller model
 *     with the same vocabulary (every token's bytes and type compared at
 *     start-up), one session (KV cache) per slot of the scheduler. Asked for
 *     drafts of several slots, it brings each slot's session up to that
 *     slot's history (rows it already holds are kept: the longest common
 *     prefix with what it evaluated last, so a rejected draft's row is
 *     dropped and a new request starting with the same text reuses it),
 *     then decodes greedily, all slots in one batched pass per draft. A
 *     slot far behind (a new prompt) catches up in chunks over several
 *     steps and drafts nothing until it has caught up: per step, shared by
 *     the slots, the caller's room for prompt work (draft_propose's
 *     target_rows: what the target itself prefills per step, less its own
 *     prompt rows of that step) in draft rows scaled by the draft's
 *     relative cost, so the draft catches up about as fast as the target
 *     prefilled and no step stalls the other streams for a whole prompt in
 *     the draft model.
 * Greedy sequences' drafts are proposed deterministically (a point mass:
 * spec.h); a sampled sequence's draft-model drafts are drawn from the
 * draft model's distribution q with its draft sampler, and verified with
 * the speculative-sampling rule (engine/spec_sample.h).
 *
 * Threading: used by the scheduler thread only.
 */
#ifndef TANDEM_DRAFT_H
#define TANDEM_DRAFT_H

#include <stddef.h>
#include <stdint.h>

#include "engine/model.h"
#include "engine/sampler.h"

typedef struct draft_src draft_src;
struct draft_remote;

typedef struct {
    int lookup;              /* drafts per step from prompt lookup, 0: off */
    model *dm;               /* the draft model (the caller keeps and frees it), or NULL */
    int draft_max;           /* drafts per step from the draft model (default 8) */
    int n_slots, n_ctx;      /* the scheduler's slots and their context */
    uint32_t kv_dtype;       /* the draft sessions' cache type */
    int fixed;               /* 1: every step asks for the most drafts (draft_cost 0, no
                              * adaptation): tests and benchmarks of the mechanism */
    /* --draft-node HOST:PORT: drafts from a draft node (draft_remote.h; not
     * with dm), draft_max per step */
    const char *node;
    const void *secret;
    size_t secret_len;
    const char *node_id;
    int node_timeout_ms;     /* an exchange's deadline (0: DRAFT_REMOTE_TIMEOUT_MS) */
} draft_opts;

/* NULL *out (and 0) when neither source is on. -1 with a message when the
 * draft model does not share the target's vocabulary or memory is short. */
int draft_create(draft_src **out, model *target, const draft_opts *o, char *err, size_t errlen);
void draft_free(draft_src *d);

/* "lookup", "model", "lookup+model", "node", "lookup+node". */
const char *draft_kind(const draft_src *d);
/* The most rows the draft model was fed for one slot in one step (catch-up
 * is chunked: draft_propose's target_rows). */
int draft_max_fed(const draft_src *d);
/* 1 when a draft model is on (its drafts may be sampled). */
int draft_has_model(const draft_src *d);
/* The most drafts a step may carry. */
int draft_k_max(const draft_src *d);
/* One more verified row plus one draft, as a fraction of a sequence's
 * decode step (spec_adapt_k's cost), given a verified row's (row_cost,
 * spec_cost_row; draft_row_prior() before the passes tell). 0 with fixed. */
double draft_cost(const draft_src *d, double row_cost);
double draft_row_prior(void);

/* One slot's question: its history (tokens in the target's cache, then the
 * token to be evaluated next) and how many drafts it wants; n_out receives
 * how many were written to out (0..k). */
typedef struct {
    int slot;
    const int32_t *hist;
    int n;
    int k;
    int32_t *out;
    int n_out;
    /* a sampled sequence's draft sampler (engine/spec_sample.h), NULL when
     * greedy: the draft model then draws each draft from its distribution,
     * written to q[i * n_vocab ...] for draft i, and sets sampled (lookup's
     * drafts stay point masses: sampled 0) */
    sampler *smp;
    float *q;
    int sampled;
} draft_ask;

/* Fills every ask; a source that fails leaves 0 drafts (decoding goes on
 * without them) and logs why. target_rows: the step's room for a draft
 * model's catch-up, in the target's rows (its prefill budget less the
 * step's own prompt rows; <= 0: a default of 256); the catch-up feeds
 * target_rows / (draft cost over the target's) draft rows at most, never
 * fewer than one steady step needs. */
void draft_propose(draft_src *d, draft_ask *asks, int n_asks, int target_rows);
/* The draft node's client (draft_remote.h), or NULL. */
struct draft_remote *draft_get_remote(const draft_src *d);

#endif

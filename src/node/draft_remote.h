/* draft_remote.h - a decode node's drafts from a draft node (--draft-node
 * HOST:PORT, issue 42; the draft node's side is draft_serve.h, the frames
 * net/wire_draft.h).
 *
 * One sealed wire connection (the handshake of docs/wire-protocol.md: the
 * same shared secret, the same model fingerprint and KV type, the peer a
 * prefill node whose HELLO has the DRAFT capability). Each decode step that
 * wants drafts is one exchange: a DRAFT frame with, per sequence (its id is
 * the scheduler's slot), the part of its history the draft node does not
 * hold yet (keep = the longest common prefix with what was sent before: the
 * tokens accepted since the last exchange; drafts sent and then rejected
 * lie beyond it, so the draft node drops them), then the DRAFTS answer,
 * waited for at most the exchange deadline (--draft-timeout-ms).
 *
 * Look-ahead: once a step's drafts are in, a second DRAFT asks, for each
 * sequence that got drafts here, k + 1 drafts after its history and those
 * drafts, sent before the target verifies them: the draft node's first is
 * its guess of the target's token after the last draft, the rest the next
 * step's drafts, computed while the target verifies. The next step reads
 * that answer first (answers come in order) and uses a sequence's drafts
 * when all its drafts were accepted and the target's token is the guess:
 * no round trip and no draft-node compute in that step. Else they are
 * dropped and a fresh exchange asks as before. One DRAFT is outstanding at
 * a time, as before.
 *
 * Never a stall: an answer later than the deadline leaves that step without
 * drafts and the next steps too until it has come (it is read and dropped:
 * its exchange number is old; the histories it carried stand); one still
 * missing after DRAFT_REMOTE_DEAD_MS, a closed or failed connection, an
 * ERROR, or an answer that does not match the question (exchange number,
 * sequences, more drafts than asked, a token id outside the vocabulary)
 * drops the connection, and decoding goes on without drafts while a
 * background thread reconnects with exponential backoff.
 *
 * Threading: draft_remote_propose from the scheduler thread only; the
 * connector thread only makes connections and hands them over (a mutex).
 */
#ifndef TANDEM_DRAFT_REMOTE_H
#define TANDEM_DRAFT_REMOTE_H

#include <stddef.h>
#include <stdint.h>

#include <jansson.h>

#include "engine/model.h"
#include "node/draft.h"

typedef struct draft_remote draft_remote;

typedef struct {
    const char *hostport;        /* the draft node */
    const void *secret;          /* the nodes' shared secret (copied) */
    size_t secret_len;
    const char *node_id;         /* our name in HELLO */
    uint32_t kv_dtype;           /* our KV type (the handshake compares it) */
    int n_slots;                 /* sequence ids 0..n_slots-1 */
    int timeout_ms;              /* an exchange's deadline (default DRAFT_REMOTE_TIMEOUT_MS) */
} draft_remote_opts;

/* The deadline of an exchange when none is given: a draft step of a small
 * model plus a LAN round trip is a few ms; more than this and the step
 * goes on without drafts. */
#define DRAFT_REMOTE_TIMEOUT_MS 100

/* Starts the connector (the first connection is attempted at once, in the
 * background). -1 with a message on a bad option or out of memory. */
int draft_remote_create(draft_remote **out, model *target, const draft_remote_opts *o, char *err, size_t errlen);
void draft_remote_free(draft_remote *r);
/* Fills the asks that have no drafts yet (n_out == 0, k > 0); asks get 0
 * drafts while there is no usable connection. */
void draft_remote_propose(draft_remote *r, draft_ask *asks, int n_asks);

/* A draft's cost as a fraction of a decode step (draft.h's draft_cost),
 * measured: called once per scheduler step, it times the steps and the
 * exchanges between them (the round trip and the draft node's passes, per
 * draft asked), moving averages of both; prior until both are known. */
double draft_remote_cost(draft_remote *r, double prior);

typedef struct {
    uint64_t exchanges, late, failures, connects;
    uint64_t ahead_sent, ahead_used, ahead_missed;   /* look-aheads: DRAFTs sent, asks served, not */
    int connected;
} draft_remote_stats;
void draft_remote_get_stats(draft_remote *r, draft_remote_stats *st);
/* /v1/stats: "draft_node": {"address", "connected", "connects", "exchanges",
 * "late" (answers past the deadline), "failures" (connections dropped),
 * "ahead_sent" (look-ahead DRAFTs), "ahead_used" / "ahead_missed" (asks a
 * look-ahead's drafts served / did not: a rejected draft or a wrong guess)};
 * nothing when r is NULL. */
void draft_remote_stats_json(json_t *o, draft_remote *r);

#endif

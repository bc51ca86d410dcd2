/* node_prefill_internal.h - what the prefill node's files share (its
 * interface is prefill_node_run in handoff.h). The node's state (pnode), a
 * request in flight (pn_req), a connection (pn_conn), their limits, and the
 * pn_ functions one file of the node calls in another:
 *   node_prefill.c         start, accept loop, metrics listener, run
 *   node_prefill_conn.c    a connection: handshake, frame loop, the
 *                          handshake pool's shares and trust
 *   node_prefill_job.c     a REQUEST: admitted, computed (compute turns,
 *                          layer-split slices), answered, accounted
 *   node_prefill_stream.c  KV streaming: the layer hook's queue, the sender
 *                          thread, the peer watched during the computation
 */

#ifndef TANDEM_NODE_PREFILL_INTERNAL_H
#define TANDEM_NODE_PREFILL_INTERNAL_H

#include <pthread.h>
#include <stdint.h>

#include "base/metrics.h"
#include "net/httpd.h"
#include "net/wire.h"
#include "node/chain.h"
#include "node/draft_serve.h"
#include "node/handoff.h"
#include "node/kvstore.h"
#include "node/node_drain.h"

/* Default concurrent authenticated connections: each holds a session (KV
 * cache pages are only touched as used) and a thread; more get BUSY. */
#define PN_DEFAULT_CONNS 16
#define PN_MAX_CONNS 256
/* Connections still in their handshake: a thread and a few hundred bytes
 * each. Past the cap the oldest is dropped, so idle strangers can delay a
 * real decode node's handshake by at most PN_DEFAULT_HANDSHAKE_MS, never
 * lock it out. */
#define PN_DEFAULT_PREAUTH 16
/* Shares of the handshake pool a stranger gets: one address a quarter,
 * one /24 or /64 block half, so a flood from one block leaves the other
 * half to everyone else; the block's own newcomers then push out its own
 * oldest handshakes, never another block's. */
#define PN_PREAUTH_ADDR_DIV 4
#define PN_PREAUTH_BLOCK_DIV 2
/* Handshakes kept apart for addresses that completed one within
 * PN_TRUST_MS (the decode nodes that use this node): strangers never take
 * or evict them. Half the strangers' pool, at least 4. */
#define PN_TRUSTED_PREAUTH_MIN 4
/* How long such an address stays trusted: decode nodes reconnect after an
 * idle link or a restart within minutes. */
#define PN_TRUST_MS (10 * 60 * 1000)
#define PN_TRUST_MAX 32
/* A handshake is two round trips and two HMACs: on any LAN far below this. */
#define PN_DEFAULT_HANDSHAKE_MS 2000
/* How long the accept loop waits for a dropped handshake's thread to exit
 * when every slot is taken (it only has to notice its socket was shut). */
#define PN_EVICT_WAIT_MS 1000
/* The limit on one request, from its REQUEST frame to its DONE, unless
 * --request-ms sets one: deadline_prefill_ms of its positions
 * (net/deadline.h; 300 s, more for prompts over 6,000 tokens), as on the
 * decode side, so that neither end gives up on a long prompt the other
 * still waits for. */
/* Descriptors a request may have computed but not yet sent: one chunk's
 * layers keeps the sender busy while the next chunk computes, and stops the
 * compute soon when the link is slow or dead (backpressure). */
#define PN_QUEUE_MIN 4
#define PN_QUEUE_MAX 64
/* A connection that sends no REQUEST for this long between requests is
 * dropped (decode nodes keep connections open between prompts; PINGs do not
 * count, so a peer cannot hold a slot with them forever). */
#define PN_IDLE_MS 300000
/* While a request waits for its turn at the model (another request's chunk
 * is computing: a 512-row chunk at 16k positions takes 10-25 s on one
 * core), its decode node receives no KV frame; a PING this often tells it
 * the node is alive, so its stall timeout (default 10 s: no frame at all)
 * does not give up on a request that is only queued. A PING moves no total
 * deadline (docs/wire-protocol.md 4.8), and a stopped or dead node sends
 * none. */
#define PN_QUEUE_PING_MS 500
/* How often blocked loops look at the stop flag. */
#define PN_TICK_MS 200
/* Positions per frame when resending a span the session already holds (the
 * size of a default prefill chunk, so frames look the same either way). */
#define PN_CACHED_SPAN 512

typedef struct pnode pnode;
typedef struct pn_waiter { struct pn_waiter *next; } pn_waiter;

/* /metrics families (metrics.h; docs/router.md lists them). */
typedef struct {
    metrics *reg;
    char model[128];              /* every series' "model" label */
    metrics_family *requests, *computed, *sent, *kv_bytes, *wire_bytes, *compute, *handoff, *conns, *conns_max;
    httpd *http;                  /* the metrics listener, or NULL */
} pn_metrics;

enum pn_state { PN_FREE, PN_PREAUTH, PN_AUTHED };

typedef struct {
    pthread_t th;
    int used, done;
    int fd;
    pnode *node;
    unsigned id;                  /* accept order: the smallest pre-auth id is the oldest */
    enum pn_state state;
    int evicted;                  /* dropped while in its handshake (its socket was shut down) */
    httpd_addr addr;              /* the peer's address (has_addr) */
    int has_addr;
    int trusted;                  /* in the trusted handshake pool */
} pn_slot;

typedef struct {
    httpd_addr addr;
    double until_ms;              /* monotonic; 0 = free */
} pn_trust;

struct pnode {
    atomic_int in_req;            /* requests being served (pn_request) */
    volatile int draining;        /* stopping: no new request, idle connections close */
    volatile int cut;             /* the drain timeout passed: requests in flight stop */
    model *m;
    const prefill_node_opts *o;
    draft_server *drafter;        /* --draft-model: DRAFT frames answered (draft_serve.h), or NULL */
    wire_hello hello;             /* fingerprint computed once; nonce renewed per connection */
    kvstore *store;               /* KV prefix store, or NULL */
    kvstore_metrics kvm;
    char base_desc[256];          /* hello.model_desc without the rate */
    double prefill_tps;           /* measured rate (mu): calibration, then a moving average of requests */
    /* Compute turns: one pass (at most n_batch tokens) at a time, handed out
     * in arrival order (a FIFO of waiters), so requests in flight interleave
     * chunk by chunk and a long prompt does not hold back a short one. */
    pthread_mutex_t turn_mu;
    pthread_cond_t turn_cv;
    struct pn_waiter *turn_head, *turn_tail;
    pthread_mutex_t mu;           /* slots, counters */
    pn_slot *slots;
    int n_slots;
    int max_authed, max_preauth, max_trusted_preauth;
    pn_trust trust[PN_TRUST_MAX];  /* addresses that completed a handshake */
    uint64_t preauth_evicted;      /* handshakes dropped for a newcomer */
    uint64_t preauth_refused;      /* newcomers refused: their address or block had its share */
    int n_authed, n_preauth;      /* slots in each state (evicted ones not counted as pre-auth) */
    unsigned next_conn;
    uint64_t n_requests;
    pn_metrics mt;
};

typedef struct { int layer, pos0, n; } pn_job;

/* One request in flight: shared by the compute (hook) and the sender. */
typedef struct {
    pthread_mutex_t mu;
    pthread_cond_t cv;
    pn_job q[PN_QUEUE_MAX];
    int head, count, cap;
    int producer_done, abort, failed, sender_exited;
    char fail_msg[300];

    pnode *node;
    wire_conn *conn;
    kvcache *kv;
    uint64_t req_id, seq;
    double deadline;              /* gen_now_ms() by which the request must be done */
    int limit_ms;                 /* that deadline's length, for messages */
    int start, end;
    uint32_t wire_dtype, send_flags;
    int cur_layer, cur_pos;
    int cancelled, peer_gone, stopping, expired;
    int computing;                /* got the model (or had nothing to compute): not merely queued */
    int too_big;                  /* positions of a chunk too big for one frame */
    /* a slice of a layer-split chain (chain.h) */
    int sliced, slice_lo, slice_hi, n_layer;   /* slice bounds in half blocks (wire_act.h) */
    int slice_ends;               /* the slice ends the model: no hidden states to send */
    char slice_txt[32];           /* "A:B", as --layers wrote it */
    uint32_t act_dtype;           /* ACT frames this request sends */
    chain_act_in act;             /* hidden states received (slice_lo > 0) */
    float *x_out;                 /* a chunk's hidden states to send (!slice_ends) */
    wire_buf act_fb;
    int act_frames;
    /* a slice's pipeline figures (its log line): waits for hidden states
     * (for the first frame apart: the pipeline filling), sending them */
    double act_wait_ms, act_first_wait_ms, act_send_ms;
    int n_chunks, chunk_rows;

    /* sender's */
    wire_buf fb;
    uint8_t *rows;                /* a job's rows gathered from the cache: K's, then V's */
    size_t rows_cap;
    uint8_t *conv;                /* the same in the wire dtype, when it differs */
    size_t conv_cap;
    float *tmp;
    int frames;
    uint64_t kv_bytes;
} pn_req;

/* Per connection. */
typedef struct {
    pnode *node;
    wire_conn conn;
    unsigned id;
    char peer[128];
    uint32_t caps;
    session *s;
    int32_t *prev;                /* tokens whose KV the session holds ([0, session_pos)) */
    int prev_cap;
    uint64_t last_req;            /* request ids must increase: the last one served */
} pn_conn;

/* ==== node_prefill.c ==== */

void pn_rid(uint64_t req, char *out);
int pn_stopped(const pnode *n);
void pn_sleep_ms(int ms);
void pn_send_error(wire_conn *c, uint64_t req, uint32_t code, const char *fmt, ...);
void pn_metrics_outcome(pnode *node, const char *outcome);
const char *pn_outcome(const pn_req *r, int rc, int keep);
void pn_metrics_request(pnode *node, const pn_req *r, const char *outcome, int computed, double compute_ms,
                        double total_ms, uint64_t wire_bytes);

/* ==== node_prefill_stream.c ==== */

void *pn_sender_main(void *arg);
int pn_check_peer(pn_req *r);
void pn_wait_tick(pn_req *r);
int pn_hook(void *ud, int layer, int pos0, int n);
int pn_push_cached(pn_req *r, int have);

/* ==== node_prefill_job.c ==== */

int pn_request(pn_conn *pc, uint64_t req);

/* ==== node_prefill_conn.c ==== */

double pn_mono_ms(void);
int pn_is_trusted(pnode *node, const httpd_addr *a, double now);
int pn_make_room(pnode *node, const httpd_addr *a, int has_addr, int trusted);
void *pn_conn_main(void *arg);

#endif /* TANDEM_NODE_PREFILL_INTERNAL_H */

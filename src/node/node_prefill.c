/* node_prefill.c - the prefill node: computes prompts' KV for decode nodes
 * and streams it to them layer by layer (see handoff.h, docs/wire-protocol.md).
 *
 * Threads: the accept loop; one thread per connection (handshake, then
 * REQUEST frames one after another); per request one sender thread.
 * Connections still in their handshake have slots of their own (a small
 * cap; the oldest is dropped when a new one needs the room, and each has a
 * short deadline), so strangers cannot take the slots of authenticated
 * decode nodes. The
 * connection thread runs model_eval (one evaluation at a time per model),
 * whose layer hook queues (layer, pos0, n) descriptors; the sender reads
 * those rows straight out of the session's cache - rows never change once
 * written - and puts them on the wire while later layers compute. The hook
 * also watches the socket, so a CANCEL or a vanished decode node stops the
 * evaluation at the next layer.
 */
#include "node/kvstore.h"
#include "node/handoff.h"
#include "node/chain.h"
#include "node/draft_serve.h"

#include <errno.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <poll.h>
#include <pthread.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <time.h>
#include <unistd.h>

#include "engine/generate.h"
#include "engine/gguf.h"
#include "net/httpd.h"
#include "node/node_drain.h"
#include "base/log.h"
#include "base/metrics.h"
#include "net/node_register.h"
#include "net/prefill_rate.h"
#include "net/wire.h"

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
/* Default limit on one request, from its REQUEST frame to its DONE. */
#define PN_DEFAULT_REQUEST_MS 300000
/* Descriptors a request may have computed but not yet sent: one chunk's
 * layers keeps the sender busy while the next chunk computes, and stops the
 * compute soon when the link is slow or dead (backpressure). */
#define PN_QUEUE_MIN 4
#define PN_QUEUE_MAX 64
/* A connection that sends no REQUEST for this long between requests is
 * dropped (decode nodes keep connections open between prompts; PINGs do not
 * count, so a peer cannot hold a slot with them forever). */
#define PN_IDLE_MS 300000
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
    int start, end;
    uint32_t wire_dtype, send_flags;
    int cur_layer, cur_pos;
    int cancelled, peer_gone, stopping, expired;
    int computing;                /* got the model (or had nothing to compute): not merely queued */
    int too_big;                  /* positions of a chunk too big for one frame */
    /* a slice of a layer-split chain (chain.h) */
    int sliced, slice_lo, slice_hi, n_layer;
    uint32_t act_dtype;           /* ACT frames this request sends */
    chain_act_in act;             /* hidden states received (slice_lo > 0) */
    float *x_out;                 /* a chunk's hidden states to send (slice_hi < n_layer) */
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

/* A request's id in the log (log.h): the low half of its wire id, where
 * tandem's decode node puts the router's request id. */
static void pn_rid(uint64_t req, char *out) { log_id_format((uint32_t)req, out); }

/* The hard stop: the drain is over (prefill_node_run). */
static int pn_stopped(const pnode *n) { return n->cut; }

static void pn_sleep_ms(int ms) {
    struct timespec ts = { ms / 1000, (long)(ms % 1000) * 1000000L };
    while (nanosleep(&ts, &ts) && errno == EINTR) {}
}

static void pn_send_error(wire_conn *c, uint64_t req, uint32_t code, const char *fmt, ...) {
    wire_error e = { .code = code };
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(e.message, sizeof e.message, fmt, ap);
    va_end(ap);
    wire_buf b = { 0 };
    char err[256];
    if (wire_encode_error(&b, &e) == 0) wire_send(c, WIRE_ERROR, req, 0, b.data, b.len, err, sizeof err);
    wire_buf_free(&b);
}

/* ==== Sender ==== */

/* --debug-corrupt-frame: one byte of the finished frame flipped after its
 * CRC was computed (the receiver sees a checksum error). */
static void pn_mangle_corrupt(uint8_t *frame, size_t n, void *ud) {
    (void)ud;
    frame[WIRE_HEADER_BYTES + (n - WIRE_HEADER_BYTES) / 2] ^= 0x5A;
}

/* --debug-tamper-frame: one sealed byte flipped and the CRC made right
 * again, as an attacker on the path would (the receiver sees a tag error). */
static void pn_mangle_tamper(uint8_t *frame, size_t n, void *ud) {
    (void)ud;
    uint8_t *pl = frame + WIRE_HEADER_BYTES;
    size_t len = n - WIRE_HEADER_BYTES;
    pl[len / 2] ^= 0x5A;
    uint32_t crc = wire_crc32c(0, pl, len);
    for (int i = 0; i < 4; i++) frame[20 + i] = (uint8_t)(crc >> (8 * i));
}

/* Grows *buf to at least need bytes. */
static int pn_grow(uint8_t **buf, size_t *cap, size_t need) {
    if (need <= *cap) return 0;
    uint8_t *p = realloc(*buf, need);
    if (!p) return -1;
    *buf = p;
    *cap = need;
    return 0;
}

/* Points k/v at the job's rows (gathered position-major from the cache's
 * head arrays), converted to the wire dtype if needed. */
static int pn_job_rows(pn_req *r, const pn_job *j, const uint8_t **k, const uint8_t **v, size_t *rb) {
    uint32_t cdt = kv_dtype(r->kv);
    int dim = kv_dim(r->kv);
    size_t half = kv_row_bytes(r->kv) * (size_t)j->n;
    char err[160];
    if (pn_grow(&r->rows, &r->rows_cap, 2 * half) ||
        kv_read_span(r->kv, j->layer, j->pos0, j->n, r->rows, r->rows + half, err, sizeof err))
        return -1;
    *k = r->rows;
    *v = r->rows + half;
    *rb = kv_row_bytes(r->kv);
    if (r->wire_dtype == cdt) return 0;
    size_t wrb = (size_t)gguf_row_bytes(r->wire_dtype, (uint64_t)dim);
    if (pn_grow(&r->conv, &r->conv_cap, 2 * wrb * (size_t)j->n)) return -1;
    if (!r->tmp && !(r->tmp = malloc(sizeof(float) * (size_t)dim))) return -1;
    handoff_convert_rows(cdt, *k, r->wire_dtype, r->conv, j->n, dim, r->tmp);
    handoff_convert_rows(cdt, *v, r->wire_dtype, r->conv + wrb * (size_t)j->n, j->n, dim, r->tmp);
    *k = r->conv;
    *v = r->conv + wrb * (size_t)j->n;
    *rb = wrb;
    return 0;
}

static int pn_send_job(pn_req *r, const pn_job *j, char *err, size_t errlen) {
    const uint8_t *k, *v;
    size_t rb;
    if (pn_job_rows(r, j, &k, &v, &rb)) {
        snprintf(err, errlen, "cannot gather the KV rows to send (out of memory?)");
        return -1;
    }
    wire_kv kv = { .layer = (uint32_t)j->layer, .pos0 = (uint32_t)j->pos0, .n = (uint32_t)j->n,
                   .dtype = r->wire_dtype, .row_bytes = (uint32_t)rb, .k = k, .v = v };
    r->fb.len = 0;
    if (wire_encode_kv(&r->fb, &kv)) { snprintf(err, errlen, "cannot encode a KV frame (out of memory?)"); return -1; }
    const prefill_node_opts *o = r->node->o;
    if (o->debug_frame_delay_ms > 0) pn_sleep_ms(o->debug_frame_delay_ms);
    r->frames++;
    int rc;
    void (*mangle)(uint8_t *, size_t, void *) = NULL;
    if (o->debug_corrupt_frame > 0 && r->frames == o->debug_corrupt_frame) mangle = pn_mangle_corrupt;
    if (o->debug_tamper_frame > 0 && r->frames == o->debug_tamper_frame) mangle = pn_mangle_tamper;
    if (mangle)   /* uncompressed, so the flipped byte is in the KV rows */
        rc = wire_send_raw(r->conn, WIRE_KV, r->req_id, 0, (uint32_t)r->fb.len, r->fb.data, r->fb.len, mangle, NULL,
                           err, errlen);
    else
        rc = wire_send(r->conn, WIRE_KV, r->req_id, r->send_flags, r->fb.data, r->fb.len, err, errlen);
    if (rc == 0) r->kv_bytes += 2ull * rb * (uint64_t)j->n;
    return rc;
}

static void *pn_sender_main(void *arg) {
    pn_req *r = arg;
    for (;;) {
        pthread_mutex_lock(&r->mu);
        while (!r->count && !r->producer_done && !r->abort) pthread_cond_wait(&r->cv, &r->mu);
        if (r->abort || !r->count) { pthread_mutex_unlock(&r->mu); break; }
        if (pn_stopped(r->node)) {
            r->failed = r->stopping = 1;   /* the DONE must not go out for a partial stream */
            snprintf(r->fail_msg, sizeof r->fail_msg, "shutting down");
            pthread_mutex_unlock(&r->mu);
            break;
        }
        if (gen_now_ms() > r->deadline) {
            r->failed = r->expired = 1;
            snprintf(r->fail_msg, sizeof r->fail_msg, "request deadline passed");
            pthread_mutex_unlock(&r->mu);
            break;
        }
        pn_job j = r->q[r->head];
        pthread_mutex_unlock(&r->mu);
        char err[256];
        int rc = pn_send_job(r, &j, err, sizeof err);
        pthread_mutex_lock(&r->mu);
        if (rc) {
            r->failed = 1;
            snprintf(r->fail_msg, sizeof r->fail_msg, "%s", err);
        } else {
            r->head = (r->head + 1) % r->cap;
            r->count--;
        }
        pthread_cond_broadcast(&r->cv);
        pthread_mutex_unlock(&r->mu);
        if (rc) break;
    }
    pthread_mutex_lock(&r->mu);
    r->sender_exited = 1;
    pthread_cond_broadcast(&r->cv);
    pthread_mutex_unlock(&r->mu);
    return NULL;
}

/* ==== Compute side ==== */

/* Reads a frame the decode node sent during the computation, if any.
 * Returns non-zero when the computation must stop. */
static int pn_check_peer(pn_req *r) {
    if (gen_now_ms() > r->deadline) { r->expired = 1; return 1; }
    struct pollfd p = { .fd = r->conn->fd, .events = POLLIN };
    if (poll(&p, 1, 0) <= 0) return 0;
    wire_header h;
    char err[256];
    if (wire_recv(r->conn, &h, err, sizeof err)) {
        r->peer_gone = 1;
        snprintf(r->fail_msg, sizeof r->fail_msg, "%s", err);
        if (r->conn->rx_err) wire_send_error(r->conn, 0, r->conn->rx_err, err);   /* a bad frame: say why */
        return 1;
    }
    if (h.type == WIRE_CANCEL && h.req_id == r->req_id) { r->cancelled = 1; return 1; }
    if (h.type == WIRE_ACT && h.req_id == r->req_id && r->slice_lo > 0) {
        if (chain_act_take(&r->act, r->conn->rx.data, r->conn->rx.len, err, sizeof err) == 0) return 0;
        r->peer_gone = 1;
        snprintf(r->fail_msg, sizeof r->fail_msg, "bad hidden states: %s", err);
        pn_send_error(r->conn, r->req_id, WERR_RANGE, "%s", r->fail_msg);
        return 1;
    }
    if (h.type == WIRE_PING) {
        wire_send(r->conn, WIRE_PONG, h.req_id, 0, r->conn->rx.data, r->conn->rx.len, err, sizeof err);
        return 0;
    }
    if (h.type == WIRE_PONG || h.type == WIRE_CANCEL) return 0;   /* a stale CANCEL is ignored */
    r->peer_gone = 1;
    if (h.type == WIRE_ERROR) {   /* the decode node gave up (e.g. a frame failed its checks) */
        wire_error we = { 0 };
        char rid[LOG_ID_CHARS + 1];
        pn_rid(r->req_id, rid);
        if (wire_decode_error(r->conn->rx.data, r->conn->rx.len, &we, err, sizeof err) == 0)
            log_warn(rid, "decode node reported error %u during request %llu: %s", we.code, (unsigned long long)r->seq,
                     we.message);
        snprintf(r->fail_msg, sizeof r->fail_msg, "the decode node sent ERROR %u", we.code);
        return 1;
    }
    snprintf(r->fail_msg, sizeof r->fail_msg, "unexpected %s frame during a request", wire_type_name(h.type));
    pn_send_error(r->conn, 0, WERR_PROTOCOL, "%s", r->fail_msg);
    return 1;
}

/* Waits on the request's condition variable for at most 100 ms (the
 * callers look at the socket and the stop flag in between). Locked. */
static void pn_wait_tick(pn_req *r) {
    struct timespec ts;
    clock_gettime(CLOCK_REALTIME, &ts);
    ts.tv_nsec += 100L * 1000000L;
    if (ts.tv_nsec >= 1000000000L) { ts.tv_sec++; ts.tv_nsec -= 1000000000L; }
    pthread_cond_timedwait(&r->cv, &r->mu, &ts);
}

/* Queues a descriptor, waiting while the queue is full. Non-zero: stop. */
static int pn_push(pn_req *r, int layer, int pos0, int n) {
    pthread_mutex_lock(&r->mu);
    while (r->count == r->cap && !r->failed) {
        pn_wait_tick(r);
        if (r->count == r->cap && !r->failed) {
            pthread_mutex_unlock(&r->mu);
            if (pn_stopped(r->node)) { r->stopping = 1; return 1; }
            if (pn_check_peer(r)) return 1;
            pthread_mutex_lock(&r->mu);
        }
    }
    int failed = r->failed;
    if (!failed) {
        r->q[(r->head + r->count) % r->cap] = (pn_job){ layer, pos0, n };
        r->count++;
        pthread_cond_broadcast(&r->cv);
    }
    pthread_mutex_unlock(&r->mu);
    return failed;
}

/* Payload bytes of a KV frame of n positions (with room for its fixed fields). */
static uint64_t pn_frame_bytes(const pn_req *r, int n) {
    return 2ull * (uint64_t)n * gguf_row_bytes(r->wire_dtype, (uint64_t)kv_dim(r->kv)) + 64;
}

static int pn_hook(void *ud, int layer, int pos0, int n) {
    pn_req *r = ud;
    r->cur_layer = layer;
    r->cur_pos = pos0;
    if (pn_stopped(r->node)) { r->stopping = 1; return 1; }
    if (pn_check_peer(r)) return 1;
    int lo = pos0 > r->start ? pos0 : r->start;
    int hi = pos0 + n < r->end ? pos0 + n : r->end;
    if (lo >= hi) return 0;   /* a chunk before start_pos: the decode node has it */
    if (pn_frame_bytes(r, hi - lo) > WIRE_MAX_PAYLOAD) { r->too_big = hi - lo; return 1; }
    return pn_push(r, layer, lo, hi - lo);
}

/* Queues the part of [start, end) the session already holds (prefix reuse). */
static int pn_push_cached(pn_req *r, int have) {
    int hi = have < r->end ? have : r->end;
    int span = PN_CACHED_SPAN;
    while (span > 1 && pn_frame_bytes(r, span) > WIRE_MAX_PAYLOAD) span /= 2;
    for (int p = r->start; p < hi; p += span) {
        int n = hi - p < span ? hi - p : span;
        for (int l = r->slice_lo; l < r->slice_hi; l++)
            if (pn_push(r, l, p, n)) return -1;
    }
    return 0;
}

/* ==== Requests ==== */

static int pn_conn_session(pn_conn *pc, int n, char *err, size_t errlen) {
    pnode *node = pc->node;
    if (!pc->s && session_new(&pc->s, node->m, node->o->n_ctx, node->o->kv_dtype, err, errlen)) return -1;
    if (n > pc->prev_cap) {
        int32_t *p = realloc(pc->prev, sizeof(int32_t) * (size_t)n);
        if (!p) { snprintf(err, errlen, "out of memory"); return -1; }
        pc->prev = p;
        pc->prev_cap = n;
    }
    return 0;
}

/* Checks a decoded REQUEST; on a problem sends the ERROR and returns -1. */
/* Checks a request against the node; on a refusal the ERROR is sent and
 * why holds its message. */
static int pn_validate(pn_conn *pc, uint64_t req, const wire_request *q, uint32_t *send_flags, char *why, size_t whylen) {
    const model_hparams *hp = model_get_hparams(pc->node->m);
    const prefill_node_opts *o = pc->node->o;
    uint32_t code = WERR_RANGE;
    why[0] = 0;
    if (q->n_tokens < 1 || q->n_tokens > (uint32_t)o->n_ctx)
        snprintf(why, whylen, "%u tokens: this prefill node takes 1..%d", q->n_tokens, o->n_ctx);
    else if (q->start_pos > q->end_pos || q->end_pos > q->n_tokens)
        snprintf(why, whylen, "bad span %u..%u for %u tokens", q->start_pos, q->end_pos, q->n_tokens);
    for (uint32_t i = 0; !why[0] && i < q->n_tokens; i++) {
        uint32_t t = wire_request_token(q, i);
        if (t >= (uint32_t)hp->n_vocab) snprintf(why, whylen, "token %u at index %u is outside the vocabulary (%d)", t, i, hp->n_vocab);
    }
    int ok = q->wire_dtype == o->kv_dtype || (q->wire_dtype == GGML_TYPE_Q8_0 && (pc->caps & WIRE_CAP_Q8_0));
    if (!why[0] && !ok) {
        code = WERR_DTYPE;
        snprintf(why, whylen, "wire dtype %s (%u) is not available: the cache holds %s "
                 "(q8_0 only if negotiated; KV is never upcast)", gguf_type_name(q->wire_dtype),
                 q->wire_dtype, gguf_type_name(o->kv_dtype));
    }
    uint32_t known = (pc->caps & WIRE_CAP_SLICE) ? 1u | CHAIN_REQ_ACT_MASK : 1u;
    if (!why[0] && ((q->flags & ~known) || chain_act_dtype_from_flags(q->flags) == UINT32_MAX)) {
        code = WERR_PROTOCOL;
        snprintf(why, whylen, "unknown request flags 0x%x", q->flags);
    }
    if (why[0]) {
        pn_send_error(&pc->conn, req, code, "%s", why);
        return -1;
    }
    *send_flags = ((q->flags & 1u) && (pc->caps & WIRE_CAP_ZSTD)) ? WIRE_FLAG_ZSTD : 0;
    return 0;
}

/* ==== Compute turns ==== */

static void pn_turn_unlink(pnode *node, pn_waiter *w) {
    pn_waiter **pp = &node->turn_head, *prev = NULL;
    while (*pp && *pp != w) { prev = *pp; pp = &(*pp)->next; }
    if (!*pp) return;
    *pp = w->next;
    if (node->turn_tail == w) node->turn_tail = prev;
}

/* Waits for the request's turn at the model, watching the peer and the stop
 * flag while queued: a request cancelled or abandoned before its turn never
 * computes. 0 = our turn (give it back with pn_turn_give), non-zero = gave up. */
static int pn_turn_take(pn_req *r, pn_waiter *w) {
    pnode *node = r->node;
    w->next = NULL;
    pthread_mutex_lock(&node->turn_mu);
    if (node->turn_tail) node->turn_tail->next = w; else node->turn_head = w;
    node->turn_tail = w;
    while (node->turn_head != w) {
        struct timespec ts;
        clock_gettime(CLOCK_REALTIME, &ts);
        ts.tv_nsec += 100L * 1000000L;
        if (ts.tv_nsec >= 1000000000L) { ts.tv_sec++; ts.tv_nsec -= 1000000000L; }
        if (pthread_cond_timedwait(&node->turn_cv, &node->turn_mu, &ts) != ETIMEDOUT) continue;
        pthread_mutex_unlock(&node->turn_mu);
        int give_up = 0;
        if (pn_stopped(node)) give_up = r->stopping = 1;
        else give_up = pn_check_peer(r);
        pthread_mutex_lock(&node->turn_mu);
        if (give_up && node->turn_head != w) {
            pn_turn_unlink(node, w);
            pthread_cond_broadcast(&node->turn_cv);
            pthread_mutex_unlock(&node->turn_mu);
            return 1;
        }
    }
    pthread_mutex_unlock(&node->turn_mu);
    return 0;
}

static void pn_turn_give(pnode *node, pn_waiter *w) {
    pthread_mutex_lock(&node->turn_mu);
    pn_turn_unlink(node, w);
    pthread_cond_broadcast(&node->turn_cv);
    pthread_mutex_unlock(&node->turn_mu);
}

/* ==== Slices (layer-split chain, chain.h) ==== */

/* Waits until the hidden states of positions up to `upto` arrived (upto < 0:
 * the first frame), reading the decode node's frames; non-zero: stop. */
static int pn_act_wait(pn_req *r, int upto, char *err, size_t errlen) {
    double last = gen_now_ms();
    int had = r->act.end;
    while (upto < 0 ? !r->act.started : r->act.end < upto) {
        if (pn_stopped(r->node)) { r->stopping = 1; snprintf(err, errlen, "shutting down"); return -1; }
        if (gen_now_ms() - last > r->node->o->timeout_ms) {
            snprintf(err, errlen, "no hidden states for %d ms (have positions up to %d, need %d)",
                     r->node->o->timeout_ms, r->act.end, upto);
            return -1;
        }
        struct pollfd pf = { .fd = r->conn->fd, .events = POLLIN };
        if (poll(&pf, 1, PN_TICK_MS) < 0 && errno != EINTR) { snprintf(err, errlen, "poll failed"); return -1; }
        if (pn_check_peer(r)) { snprintf(err, errlen, "%s", r->fail_msg[0] ? r->fail_msg : "stopped"); return -1; }
        if (r->act.end != had) { had = r->act.end; last = gen_now_ms(); }
    }
    return 0;
}

/* One chunk through this node's layers: from the tokens (the first slice)
 * or the received hidden states; the output states kept for pn_act_out. */
static int pn_slice_chunk(pn_conn *pc, pn_req *r, const int32_t *tokens, int p, int n, char *err, size_t errlen) {
    model *m = pc->node->m;
    size_t dim = (size_t)model_get_hparams(m)->n_embd;
    const float *xin = r->slice_lo > 0 ? r->act.rows + (size_t)(p - r->act.p0) * dim : NULL;
    if (r->slice_hi < r->n_layer && !r->x_out && !(r->x_out = malloc(sizeof(float) * dim * (size_t)model_get_n_batch(m)))) {
        snprintf(err, errlen, "out of memory for hidden states");
        return -1;
    }
    return model_eval_slice(m, pc->s, r->slice_lo > 0 ? NULL : tokens + p, xin, n,
                            r->slice_hi < r->n_layer ? r->x_out : NULL, pn_hook, r, err, errlen);
}

/* One chunk's pipeline figures: its wait for hidden states, its compute
 * and its send of them (a DEBUG line each; the sums go on the request's
 * slice line). */
static void pn_slice_account(pn_req *r, int p, int n, double wait_ms, double compute_ms, double send_ms) {
    r->act_wait_ms += wait_ms;   /* after pn_slice_start's wait for the first frame */
    r->n_chunks++;
    r->act_send_ms += send_ms;
    if (log_enabled(LOGL_DEBUG)) {
        char rid[LOG_ID_CHARS + 1];
        pn_rid(r->req_id, rid);
        log_debug(rid, "slice %d:%d chunk %d..%d wait_ms=%.1f compute_ms=%.1f act_send_ms=%.1f", r->slice_lo, r->slice_hi,
                  p, p + n, wait_ms, compute_ms, send_ms);
    }
}

/* The chunk's hidden states to the decode node, for the next slice. */
static int pn_act_out(pn_req *r, int p, int n, char *err, size_t errlen) {
    const prefill_node_opts *o = r->node->o;
    if (o->debug_act_stall > 0 && r->act_frames >= o->debug_act_stall) {
        /* fault injection: a node that stops sending but keeps its connection */
        while (!pn_stopped(r->node) && !pn_check_peer(r)) pn_sleep_ms(PN_TICK_MS);
        snprintf(err, errlen, "stalled on purpose (--debug-act-stall)");
        return -1;
    }
    r->act_frames++;
    int dim = model_get_hparams(r->node->m)->n_embd;
    return chain_act_send(r->conn, r->req_id, r->send_flags, r->act_dtype, p, n, dim, r->x_out, &r->act_fb, err, errlen);
}

/* Positions [have, end) one pass per turn; *ms: time spent computing (not
 * waiting for other requests' turns). */
static int pn_compute(pn_conn *pc, pn_req *r, const int32_t *tokens, int have, double *ms, char *err, size_t errlen) {
    pnode *node = pc->node;
    int chunk = model_get_n_batch(node->m), rc = 0;
    pn_waiter w;
    *ms = 0;
    if (r->sliced) {   /* the pipeline's chunks */
        const model_hparams *hp = model_get_hparams(node->m);
        chunk = r->chunk_rows = chain_chunk_rows(chunk, r->end - have, node->o->chain_min_chunks,
                                                 chain_min_rows(hp->n_expert, hp->n_expert_used));
    }
    for (int p = have; p < r->end && !rc; p += chunk) {
        int n = r->end - p < chunk ? r->end - p : chunk;
        double tw = gen_now_ms();
        if (r->slice_lo > 0 && pn_act_wait(r, p + n, err, errlen)) return -1;
        double waited = gen_now_ms() - tw;
        if (pn_turn_take(r, &w)) {
            snprintf(err, errlen, "gave up waiting for the model");
            return -1;
        }
        r->computing = 1;
        double t0 = gen_now_ms();
        if (r->sliced) rc = pn_slice_chunk(pc, r, tokens, p, n, err, errlen);
        else rc = model_eval(node->m, pc->s, tokens + p, n, NULL, pn_hook, r, err, errlen);
        double t1 = gen_now_ms();
        *ms += t1 - t0;
        pn_turn_give(node, &w);
        if (!rc && r->slice_hi < r->n_layer) rc = pn_act_out(r, p, n, err, errlen);
        if (r->sliced) pn_slice_account(r, p, n, waited, t1 - t0, gen_now_ms() - t1);
    }
    return rc;
}

/* Runs the evaluation and the sender; the caller reports. */
static int pn_run(pn_conn *pc, pn_req *r, const int32_t *tokens, int have, double *ms,
                  char *err, size_t errlen) {
    pnode *node = pc->node;
    pthread_t th;
    if (pthread_create(&th, NULL, pn_sender_main, r)) { snprintf(err, errlen, "cannot start the sender thread"); return -1; }
    int rc = pn_push_cached(r, have);
    *ms = 0;
    r->computing = have >= r->end;
    if (rc == 0 && have < r->end) rc = pn_compute(pc, r, tokens, have, ms, err, errlen);
    /* Let the sender drain, still listening for a CANCEL or a vanished peer. */
    pthread_mutex_lock(&r->mu);
    r->producer_done = 1;
    if (rc) r->abort = 1;
    pthread_cond_broadcast(&r->cv);
    while (!r->sender_exited) {
        pn_wait_tick(r);
        if (r->sender_exited || r->abort) continue;
        pthread_mutex_unlock(&r->mu);
        int stop = 0;
        if (pn_stopped(node)) stop = r->stopping = 1;
        else stop = pn_check_peer(r);
        pthread_mutex_lock(&r->mu);
        if (stop) { r->abort = 1; pthread_cond_broadcast(&r->cv); if (!rc) rc = -1; }
    }
    pthread_mutex_unlock(&r->mu);
    pthread_join(th, NULL);
    return rc;
}

static void pn_req_free(pn_req *r) {
    pthread_mutex_destroy(&r->mu);
    pthread_cond_destroy(&r->cv);
    wire_buf_free(&r->fb);
    free(r->rows);
    free(r->conv);
    free(r->tmp);
    chain_act_free(&r->act);
    free(r->x_out);
    wire_buf_free(&r->act_fb);
}

/* ==== Metrics ==== */

static int pn_write_port(const char *path, int lfd, char *err, size_t errlen);

static int pn_metrics_families(pn_metrics *m, char *err, size_t errlen) {
    static const char *const lm[] = {"model", NULL};
    metrics *g = m->reg;
    return !(m->requests = metrics_counter(g, "tandem_prefill_requests_total",
                                           "KV requests from decode nodes by outcome: ok, cancelled, timeout, peer_gone, "
                                           "refused (malformed or out of range), error.",
                                           (const char *[]){"model", "outcome", NULL}, err, errlen)) ||
           !(m->computed = metrics_counter(g, "tandem_prefill_tokens_computed_total",
                                           "Prompt positions evaluated (the rest came from the connection's cache).",
                                           lm, err, errlen)) ||
           !(m->sent = metrics_counter(g, "tandem_prefill_positions_sent_total", "Positions whose KV was sent.",
                                       lm, err, errlen)) ||
           !(m->kv_bytes = metrics_counter(g, "tandem_prefill_kv_sent_bytes_total", "KV cache bytes sent (wire dtype).",
                                           lm, err, errlen)) ||
           !(m->wire_bytes = metrics_counter(g, "tandem_prefill_wire_sent_bytes_total",
                                             "Bytes put on the wire for requests (frames, headers, seals).", lm, err, errlen)) ||
           !(m->compute = metrics_histogram(g, "tandem_prefill_compute_seconds", "Model evaluation time of a request.",
                                            lm, metrics_buckets_latency, METRICS_N_LATENCY, err, errlen)) ||
           !(m->handoff = metrics_histogram(g, "tandem_prefill_handoff_seconds",
                                            "REQUEST received to DONE sent: queue, compute and transfer.",
                                            lm, metrics_buckets_latency, METRICS_N_LATENCY, err, errlen)) ||
           !(m->conns = metrics_gauge(g, "tandem_prefill_connections", "Authenticated decode-node connections open.",
                                      lm, err, errlen)) ||
           !(m->conns_max = metrics_gauge(g, "tandem_prefill_connections_max",
                                          "Authenticated connections allowed (more get BUSY).", lm, err, errlen));
}

static int pn_metrics_init(pn_metrics *m, const prefill_node_opts *o, char *err, size_t errlen) {
    if (o->model_name && *o->model_name) snprintf(m->model, sizeof m->model, "%s", o->model_name);
    else node_register_default_model(o->model_path ? o->model_path : "model", m->model, sizeof m->model);
    if (!(m->reg = metrics_new())) { snprintf(err, errlen, "out of memory"); return -1; }
    if (pn_metrics_families(m, err, errlen)) return -1;
    const char *const lm[] = {m->model};
    metrics_family *one[] = {m->computed, m->sent, m->kv_bytes, m->wire_bytes, m->compute, m->handoff};
    for (size_t i = 0; i < sizeof one / sizeof one[0]; i++) metrics_touch(one[i], lm);
    metrics_touch(m->requests, (const char *[]){m->model, "ok"});
    return 0;
}

static void pn_metrics_outcome(pnode *node, const char *outcome) {
    metrics_add(node->mt.requests, (const char *[]){node->mt.model, outcome}, 1);
}

static const char *pn_outcome(const pn_req *r, int rc, int keep) {
    if (rc == 0 && !r->failed) return keep ? "ok" : "error";
    if (r->cancelled || r->stopping) return "cancelled";
    if (r->too_big) return "error";
    if (r->expired) return "timeout";
    if (r->failed || r->peer_gone) return "peer_gone";
    return "error";
}

/* A request that ran: when it succeeded, its figures; then its outcome
 * (last, so a scrape that sees the count sees the rest). */
static void pn_metrics_request(pnode *node, const pn_req *r, const char *outcome, int computed, double compute_ms,
                               double total_ms, uint64_t wire_bytes) {
    pn_metrics *m = &node->mt;
    const char *const lm[] = {m->model};
    if (!strcmp(outcome, "ok")) {
        metrics_add(m->computed, lm, computed);
        metrics_add(m->sent, lm, r->end - r->start);
        metrics_add(m->kv_bytes, lm, (double)r->kv_bytes);
        metrics_add(m->wire_bytes, lm, (double)wire_bytes);
        if (computed > 0) metrics_observe(m->compute, lm, compute_ms / 1e3);
        metrics_observe(m->handoff, lm, total_ms / 1e3);
    }
    pn_metrics_outcome(node, outcome);
}

/* GET /metrics on the metrics listener; everything else is 404/405. */
static enum MHD_Result pn_http(void *cls, struct MHD_Connection *c, const char *url, const char *method,
                               const char *version, const char *upload, size_t *upload_size, void **con_cls) {
    static int seen;
    pnode *node = cls;
    if (!*con_cls) { *con_cls = &seen; return MHD_YES; }   /* headers in; a body is read and dropped */
    if (*upload_size) { *upload_size = 0; return MHD_YES; }
    unsigned status = strcmp(url, "/metrics") ? 404 : strcmp(method, "GET") && strcmp(method, "HEAD") ? 405 : 200;
    char *text = NULL;
    if (status == 200) {
        const char *const lm[] = {node->mt.model};
        pthread_mutex_lock(&node->mu);
        int conns = node->n_authed;
        pthread_mutex_unlock(&node->mu);
        metrics_set(node->mt.conns, lm, conns);
        metrics_set(node->mt.conns_max, lm, node->max_authed);
        kvstore_metrics_update(node->store, &node->kvm, node->mt.model);
        text = metrics_render(node->mt.reg, NULL);
        if (!text) status = 500;
    }
    if (!text) text = strdup(status == 404 ? "not found (try GET /metrics)\n" : status == 405 ? "use GET\n" : "out of memory\n");
    if (!text) return MHD_NO;
    struct MHD_Response *resp = MHD_create_response_from_buffer(strlen(text), text, MHD_RESPMEM_MUST_FREE);
    if (!resp) { free(text); return MHD_NO; }
    MHD_add_response_header(resp, "Content-Type", status == 200 ? METRICS_CONTENT_TYPE : "text/plain");
    enum MHD_Result rc = MHD_queue_response(c, status, resp);
    MHD_destroy_response(resp);
    return rc;
}

/* The metrics listener, when one is asked for: small limits (a scraper or
 * two), a short deadline to send the request. */
static int pn_metrics_start(pnode *node, char *err, size_t errlen) {
    const prefill_node_opts *o = node->o;
    if (!o->metrics_listen) return 0;
    int fd = wire_listen(o->metrics_listen, err, errlen);
    if (fd < 0) return -1;
    int port = pn_write_port(o->metrics_port_file, fd, err, errlen);
    if (port < 0) { close(fd); return -1; }
    httpd_limits lim = { .max_conns = 64, .max_conns_per_ip = 16, .request_deadline_ms = 5000, .idle_timeout_s = 30 };
    char herr[200];
    if (httpd_start(&node->mt.http, &lim, fd, pn_http, node, NULL, NULL, herr, sizeof herr)) {
        snprintf(err, errlen, "metrics listener %s: %s", o->metrics_listen, herr);
        return -1;
    }
    log_info(NULL, "metrics: GET /metrics on port %d", port);
    return 0;
}

/* Checks a REQUEST before anything runs: its id, its payload, what it asks
 * for, a session for it. 0: admitted (q, send_flags filled); 1: refused
 * with an ERROR, the connection kept; -1: refused, the connection dropped. */
static int pn_request_admit(pn_conn *pc, uint64_t req, const char *rid, wire_request *q, uint32_t *send_flags) {
    pnode *node = pc->node;
    char err[512], why[WIRE_ERROR_MAX_MSG + 1];
    /* Ids are non-zero and increase along a connection (one request at a
     * time): a replayed or confused REQUEST is refused, and the connection
     * with it. */
    if (req == 0 || req <= pc->last_req) {
        pn_send_error(&pc->conn, req, WERR_PROTOCOL, "request id %llu refused: ids must be non-zero and increase "
                      "(last was %llu)", (unsigned long long)req, (unsigned long long)pc->last_req);
        log_warn(rid, "conn %u (%s): request id %llu refused (last %llu), closing", pc->id, pc->peer,
                 (unsigned long long)req, (unsigned long long)pc->last_req);
        pn_metrics_outcome(node, "refused");
        return -1;
    }
    pc->last_req = req;
    if (wire_decode_request(pc->conn.rx.data, pc->conn.rx.len, q, err, sizeof err)) {
        pn_send_error(&pc->conn, req, WERR_PROTOCOL, "malformed request: %s", err);
        log_warn(rid, "conn %u (%s): malformed request, closing: %s", pc->id, pc->peer, err);
        pn_metrics_outcome(node, "refused");
        return -1;
    }
    if (pn_validate(pc, req, q, send_flags, why, sizeof why)) {
        log_info(rid, "refused: %s", why);
        pn_metrics_outcome(node, "refused");
        return 1;
    }
    if (pn_conn_session(pc, (int)q->n_tokens, err, sizeof err)) {
        pn_send_error(&pc->conn, req, WERR_INTERNAL, "%s", err);
        log_error(rid, "refused: %s", err);
        pn_metrics_outcome(node, "error");
        return 1;
    }
    return 0;
}

/* Keeps whatever prefix of the previous prompt the session holds and makes
 * q's tokens the connection's prompt (rx is reused by the hook). Returns
 * the positions kept. */
static int pn_request_reuse(pn_conn *pc, const wire_request *q) {
    int have = 0, hold = session_pos(pc->s);
    while (have < hold && have < (int)q->end_pos && pc->prev[have] == (int32_t)wire_request_token(q, (uint32_t)have))
        have++;
    for (uint32_t i = 0; i < q->n_tokens; i++) pc->prev[i] = (int32_t)wire_request_token(q, i);
    session_reset(pc->s, have);
    return have;
}

/* The state one admitted request runs with (pn_run), or NULL. */
static pn_req *pn_request_new(pn_conn *pc, uint64_t req, const wire_request *q, uint32_t send_flags, double t_req) {
    pnode *node = pc->node;
    pthread_mutex_lock(&node->mu);
    uint64_t seq = ++node->n_requests;
    pthread_mutex_unlock(&node->mu);
    pn_req *r = calloc(1, sizeof *r);
    if (!r) return NULL;
    pthread_mutex_init(&r->mu, NULL);
    pthread_cond_init(&r->cv, NULL);
    int n_layer = kv_n_layer(session_kv(pc->s));
    r->cap = n_layer < PN_QUEUE_MIN ? PN_QUEUE_MIN : n_layer > PN_QUEUE_MAX ? PN_QUEUE_MAX : n_layer;
    r->node = node; r->conn = &pc->conn; r->kv = session_kv(pc->s);
    r->req_id = req; r->seq = seq; r->start = (int)q->start_pos; r->end = (int)q->end_pos;
    r->deadline = t_req + node->o->request_ms;
    r->wire_dtype = q->wire_dtype; r->send_flags = send_flags;
    r->n_layer = n_layer;
    r->sliced = model_get_layers(node->m, &r->slice_lo, &r->slice_hi);
    r->act_dtype = chain_act_dtype_from_flags(q->flags);
    r->act.dim = model_get_hparams(node->m)->n_embd;
    r->act.limit = r->end;
    return r;
}

/* A request that ran to its end: DONE with its figures, and its log line.
 * Returns 1 when DONE went out (the connection is kept). */
static int pn_request_done(pn_conn *pc, const pn_req *r, int have, double ms, double t0, uint64_t out0,
                           uint32_t n_tokens, const char *rid) {
    pnode *node = pc->node;
    char err[512];
    wire_done d = { .n_positions = (uint32_t)(r->end - r->start), .n_computed = (uint32_t)(r->end - have),
                    .prefill_ms = ms, .kv_bytes = r->kv_bytes, .wire_bytes = pc->conn.bytes_out - out0 };
    wire_buf b = { 0 };
    int keep = wire_encode_done(&b, &d) == 0 && wire_send(&pc->conn, WIRE_DONE, r->req_id, 0, b.data, b.len, err,
                                                           sizeof err) == 0;
    wire_buf_free(&b);
    pthread_mutex_lock(&node->mu);
    prefill_rate_update(&node->prefill_tps, r->end - have, ms);
    pthread_mutex_unlock(&node->mu);
    if (keep)
        log_info(rid, "done tokens=%u sent=%d..%d frames=%d cached=%d computed=%d prefill_ms=%.1f total_ms=%.1f "
                 "kv_bytes=%llu wire_bytes=%llu conn=%u seq=%llu", n_tokens, r->start, r->end, r->frames, have,
                 r->end - have, ms, gen_now_ms() - t0, (unsigned long long)r->kv_bytes,
                 (unsigned long long)d.wire_bytes, pc->id, (unsigned long long)r->seq);
    else
        log_warn(rid, "request %llu (conn %u): sending DONE failed: %s", (unsigned long long)r->seq, pc->id, err);
    if (keep && r->sliced && r->n_chunks)   /* where a chain slice's time went: waits for hidden states, sends */
        log_info(rid, "slice %d:%d chunks=%d rows=%d compute_ms=%.1f act_wait_first_ms=%.1f act_wait_ms=%.1f "
                 "act_send_ms=%.1f", r->slice_lo, r->slice_hi, r->n_chunks, r->chunk_rows, ms, r->act_first_wait_ms,
                 r->act_wait_ms, r->act_send_ms);
    return keep;
}

/* A request that did not finish: the ERROR that ends its stream (none when
 * the decode node is gone) and its log line. Returns 1 to keep the
 * connection. */
static int pn_request_failed(pn_conn *pc, const pn_req *r, const char *err, const char *rid) {
    pnode *node = pc->node;
    unsigned long long seq = (unsigned long long)r->seq;
    if (r->cancelled) {
        /* the ERROR ends the request's stream: a decode node may keep the connection */
        pn_send_error(&pc->conn, r->req_id, WERR_CANCELLED, "request cancelled");
        if (!r->computing)
            log_info(rid, "request %llu (conn %u) cancelled by the decode node while queued for the model (never computed)",
                     seq, pc->id);
        else
            log_info(rid, "request %llu (conn %u) cancelled by the decode node at layer %d of chunk %d (%d frames sent)",
                     seq, pc->id, r->cur_layer, r->cur_pos, r->frames);
        return 1;
    }
    if (r->too_big) {
        pn_send_error(&pc->conn, r->req_id, WERR_RANGE, "a %d-position chunk does not fit in one frame: "
                      "run the prefill node with a smaller -b", r->too_big);
        log_error(rid, "request %llu (conn %u): chunk too big for a frame (lower -b)", seq, pc->id);
        return 1;
    }
    if (r->expired) {
        pn_send_error(&pc->conn, r->req_id, WERR_TIMEOUT, "request not finished within the prefill node's %d ms limit",
                      node->o->request_ms);
        log_warn(rid, "request %llu (conn %u) stopped: past its %d ms deadline (%d frames sent)", seq, pc->id,
                 node->o->request_ms, r->frames);
        return 0;
    }
    if (r->stopping) {
        pn_send_error(&pc->conn, r->req_id, WERR_CANCELLED, "prefill node shutting down");
        log_info(rid, "request %llu (conn %u) stopped: shutting down", seq, pc->id);
        return 0;
    }
    if (r->peer_gone && !r->computing) {
        log_info(rid, "decode node went away while queued for the model, dropping request %llu (never computed): %s",
                 seq, r->fail_msg);
        return 0;
    }
    if (r->failed || r->peer_gone) {
        log_warn(rid, "decode node went away, stopping request %llu at layer %d of chunk %d (%d frames sent): %s", seq,
                 r->cur_layer, r->cur_pos, r->frames - (r->failed ? 1 : 0), r->fail_msg);
        return 0;
    }
    pn_send_error(&pc->conn, r->req_id, WERR_INTERNAL, "prefill failed: %s", err);
    log_error(rid, "request %llu (conn %u) failed: %s", seq, pc->id, err);
    return 1;
}

/* A slice after the first computes from where the hidden states it is
 * sent start: at most the positions it holds (a chain's nodes keep the
 * same prefix; one that holds fewer cannot fill the gap and refuses). */
static int pn_slice_start(pn_conn *pc, pn_req *r, int *have, char *err, size_t errlen) {
    double t = gen_now_ms();
    if (pn_act_wait(r, -1, err, errlen)) return -1;
    r->act_first_wait_ms = gen_now_ms() - t;   /* the pipeline filling up to this slice */
    if (r->act.p0 > *have) {
        snprintf(err, errlen, "hidden states start at position %d but this slice holds only %d", r->act.p0, *have);
        return -1;
    }
    *have = r->act.p0;
    session_reset(pc->s, *have);
    return 0;
}

/* Handles one REQUEST: admit, run, report. Returns 0 to keep the
 * connection, -1 to drop it. */
static int pn_request_serve(pn_conn *pc, uint64_t req) {
    pnode *node = pc->node;
    wire_request q;
    uint32_t send_flags;
    char err[512] = "", rid[LOG_ID_CHARS + 1];
    double t_req = gen_now_ms();
    pn_rid(req, rid);
    int admit = pn_request_admit(pc, req, rid, &q, &send_flags);
    if (admit) return admit > 0 ? 0 : -1;
    int have = pn_request_reuse(pc, &q);
    if (node->store && have < (int)q.end_pos)   /* continue with stored blocks */
        have = kvstore_fill(node->store, pc->prev, (int)q.end_pos, have, session_kv(pc->s), NULL);
    pn_req *r = pn_request_new(pc, req, &q, send_flags, t_req);
    if (!r) { pn_send_error(&pc->conn, req, WERR_INTERNAL, "out of memory"); pn_metrics_outcome(node, "error"); return 0; }
    if (r->slice_lo > 0 && have < r->end && pn_slice_start(pc, r, &have, err, sizeof err)) {
        int keep = pn_request_failed(pc, r, err, rid);
        pn_metrics_outcome(node, "error");
        pn_req_free(r);
        free(r);
        return keep ? 0 : -1;
    }

    double t0 = gen_now_ms(), ms = 0;
    uint64_t out0 = pc->conn.bytes_out;
    int rc = pn_run(pc, r, pc->prev, have, &ms, err, sizeof err);
    int keep = rc == 0 && !r->failed ? pn_request_done(pc, r, have, ms, t0, out0, q.n_tokens, rid)
                                     : pn_request_failed(pc, r, err, rid);
    if (node->store && rc == 0 && !r->failed)
        kvstore_put(node->store, pc->prev, session_pos(pc->s), session_kv(pc->s));
    pn_metrics_request(node, r, pn_outcome(r, rc, keep), r->end > have ? r->end - have : 0, ms, gen_now_ms() - t_req,
                       pc->conn.bytes_out - out0);
    pn_req_free(r);
    free(r);
    return keep ? 0 : -1;
}

/* One request, counted in in_req for the drain; a request that arrives
 * while draining is refused (its decode node prefills locally). */
static int pn_request(pn_conn *pc, uint64_t req) {
    pnode *node = pc->node;
    if (node->draining) {
        pn_send_error(&pc->conn, req, WERR_BUSY, "prefill node shutting down");
        return -1;
    }
    atomic_fetch_add(&node->in_req, 1);
    int rc = pn_request_serve(pc, req);
    atomic_fetch_sub(&node->in_req, 1);
    return rc;
}

/* ==== Connections ==== */

/* Waits until a frame starts arriving. 0 = readable, -1 = stop or idle
 * (nothing but PINGs since `since` for idle_ms counts as idle). */
static int pn_wait_frame(pn_conn *pc, double since) {
    while (!pn_stopped(pc->node) && !pc->node->draining) {
        /* checked before every frame: a peer sending PINGs faster than the
         * poll tick must still reach the limit */
        if (gen_now_ms() - since >= pc->node->o->idle_ms) {
            log_info(NULL, "conn %u (%s) sent no request for %d ms, closing", pc->id, pc->peer, pc->node->o->idle_ms);
            pn_send_error(&pc->conn, 0, WERR_TIMEOUT, "no request for %d ms", pc->node->o->idle_ms);
            return -1;
        }
        struct pollfd p = { .fd = pc->conn.fd, .events = POLLIN };
        int r = poll(&p, 1, PN_TICK_MS);
        if (r > 0) return 0;
        if (r < 0 && errno != EINTR) return -1;
    }
    return -1;
}

static int pn_handshake(pn_conn *pc) {
    pnode *node = pc->node;
    wire_hello mine = node->hello, peer;
    char err[512];
    pthread_mutex_lock(&node->mu);
    double tps = node->prefill_tps;
    pthread_mutex_unlock(&node->mu);
    prefill_rate_format(mine.model_desc, sizeof mine.model_desc, node->base_desc, tps);
    memset(&peer, 0, sizeof peer);
    if (wire_handshake(&pc->conn, &mine, node->o->secret, node->o->secret_len, &peer, err, sizeof err)) {
        /* A router's health probe reads our HELLO and hangs up without one
         * of its own: not worth a log line every second. */
        if (peer.node_id[0] || !strstr(err, "closed"))
            log_warn(NULL, "conn %u: handshake failed: %s", pc->id, err);
        return -1;
    }
    if (peer.role != WIRE_ROLE_DECODE && peer.role != WIRE_ROLE_ROUTER) {
        pn_send_error(&pc->conn, 0, WERR_PROTOCOL, "a prefill node serves decode nodes (peer role %u)", peer.role);
        log_warn(NULL, "conn %u: refused peer %s with role %u", pc->id, peer.node_id, peer.role);
        return -1;
    }
    pc->caps = mine.caps & peer.caps;
    snprintf(pc->peer, sizeof pc->peer, "%s", peer.node_id);
    return 0;
}

static void pn_conn_loop(pn_conn *pc) {
    char err[512];
    double since = gen_now_ms();
    while (pn_wait_frame(pc, since) == 0) {
        wire_header h;
        if (wire_recv(&pc->conn, &h, err, sizeof err)) {
            if (!strstr(err, "closed")) log_warn(NULL, "conn %u (%s): %s", pc->id, pc->peer, err);
            /* a bad CRC, tag or header is answered before we hang up */
            if (pc->conn.rx_err) wire_send_error(&pc->conn, 0, pc->conn.rx_err, err);
            return;
        }
        if (h.type == WIRE_REQUEST) {
            if (pn_request(pc, h.req_id)) return;
            since = gen_now_ms();
        } else if (h.type == WIRE_DRAFT && pc->node->drafter && (pc->caps & WIRE_CAP_DRAFT)) {
            if (draft_server_answer(pc->node->drafter, pc->id, &pc->conn, &h, err, sizeof err)) {
                log_warn(NULL, "conn %u (%s): draft: %s, closing", pc->id, pc->peer, err);
                return;
            }
            since = gen_now_ms();
        } else if (h.type == WIRE_PING) {
            wire_send(&pc->conn, WIRE_PONG, h.req_id, 0, pc->conn.rx.data, pc->conn.rx.len, err, sizeof err);
        } else if (h.type == WIRE_CANCEL || h.type == WIRE_PONG) {
            /* a cancel that crossed the DONE: nothing to stop */
        } else if (h.type == WIRE_ERROR) {
            wire_error we = { 0 };
            if (wire_decode_error(pc->conn.rx.data, pc->conn.rx.len, &we, err, sizeof err) == 0)
                log_warn(NULL, "conn %u (%s) reported error %u: %s", pc->id, pc->peer, we.code, we.message);
            if (h.req_id == 0) return;
        } else {
            pn_send_error(&pc->conn, 0, WERR_PROTOCOL, "unexpected frame type %u", h.type);
            log_warn(NULL, "conn %u (%s): unexpected frame type %u, closing", pc->id, pc->peer, h.type);
            return;
        }
    }
}

/* ==== Handshake pool shares ==== */

static double pn_mono_ms(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return ts.tv_sec * 1e3 + ts.tv_nsec / 1e6;
}

/* Locked. */
static int pn_is_trusted(pnode *node, const httpd_addr *a, double now) {
    for (int i = 0; i < PN_TRUST_MAX; i++)
        if (node->trust[i].until_ms > now && httpd_same_addr(&node->trust[i].addr, a)) return 1;
    return 0;
}

/* Locked: a (renewed), in its own entry or the soonest-expiring one. */
static void pn_trust_add(pnode *node, const httpd_addr *a) {
    int slot = 0;
    for (int i = 0; i < PN_TRUST_MAX; i++) {
        if (node->trust[i].until_ms > 0 && httpd_same_addr(&node->trust[i].addr, a)) { slot = i; break; }
        if (node->trust[i].until_ms < node->trust[slot].until_ms) slot = i;
    }
    node->trust[slot].addr = *a;
    node->trust[slot].until_ms = pn_mono_ms() + PN_TRUST_MS;
}

/* Locked: drops a handshake in progress (its thread notices the shut socket). */
static void pn_evict(pnode *node, pn_slot *s) {
    s->evicted = 1;
    node->n_preauth--;
    node->preauth_evicted++;
    shutdown(s->fd, SHUT_RDWR);
}

/* Locked: makes room in the handshake pool for a newcomer from a (trusted
 * or not), by the shares above: a trusted newcomer drops the oldest
 * trusted handshake when its pool is full; a stranger whose address or
 * block already holds its share is refused (-1: closed at once, no thread
 * spent, so a flood is drained as fast as it arrives); else in a full pool
 * the oldest of the block holding the most is dropped (when that is more
 * than the newcomer's block holds), else the oldest. 0 = admit. */
static int pn_make_room(pnode *node, const httpd_addr *a, int has_addr, int trusted) {
    pn_slot *pre[PN_MAX_CONNS * 3];
    int np = 0, nt = 0;
    pn_slot *oldest_t = NULL, *oldest = NULL, *own = NULL, *own_block = NULL;
    int same = 0, block = 0;
    for (int i = 0; i < node->n_slots && np < (int)(sizeof pre / sizeof pre[0]); i++) {
        pn_slot *s = &node->slots[i];
        if (!s->used || s->done || s->state != PN_PREAUTH || s->evicted) continue;
        if (s->trusted) {
            nt++;
            if (!oldest_t || s->id < oldest_t->id) oldest_t = s;
            continue;
        }
        pre[np++] = s;
        if (!oldest || s->id < oldest->id) oldest = s;
        if (has_addr && s->has_addr && httpd_same_addr(&s->addr, a)) { same++; if (!own || s->id < own->id) own = s; }
        if (has_addr && s->has_addr && httpd_same_block(&s->addr, a)) {
            block++;
            if (!own_block || s->id < own_block->id) own_block = s;
        }
    }
    if (trusted) {
        if (nt >= node->max_trusted_preauth && oldest_t) pn_evict(node, oldest_t);
        return 0;
    }
    int addr_share = node->max_preauth / PN_PREAUTH_ADDR_DIV, block_share = node->max_preauth / PN_PREAUTH_BLOCK_DIV;
    if (own && same >= (addr_share > 0 ? addr_share : 1)) return -1;
    if (own_block && block >= (block_share > 0 ? block_share : 1)) return -1;
    if (np < node->max_preauth) return 0;
    /* the block holding the most handshakes, and its oldest */
    pn_slot *greedy = NULL;
    int greedy_n = 0;
    for (int i = 0; i < np; i++) {
        int n = 0;
        pn_slot *first = NULL;
        for (int j = 0; j < np; j++)
            if (pre[i]->has_addr && pre[j]->has_addr && httpd_same_block(&pre[i]->addr, &pre[j]->addr)) {
                n++;
                if (!first || pre[j]->id < first->id) first = pre[j];
            }
        if (first && (n > greedy_n || (n == greedy_n && first->id < greedy->id))) { greedy = first; greedy_n = n; }
    }
    pn_evict(node, greedy && greedy_n > block ? greedy : oldest);
    return 0;
}

/* After a successful handshake: take an authenticated slot, or BUSY. */
static int pn_promote(pn_slot *slot, pn_conn *pc) {
    pnode *node = slot->node;
    pthread_mutex_lock(&node->mu);
    int ok = !slot->evicted && node->n_authed < node->max_authed;
    if (ok) {
        node->n_preauth--;
        node->n_authed++;
        slot->state = PN_AUTHED;
        if (slot->has_addr) pn_trust_add(node, &slot->addr);
    }
    int evicted = slot->evicted;
    pthread_mutex_unlock(&node->mu);
    if (!ok && !evicted) {
        pn_send_error(&pc->conn, 0, WERR_BUSY, "prefill node busy: %d connections", node->max_authed);
        log_warn(NULL, "refused %s after its handshake: all %d slots busy", pc->peer, node->max_authed);
    }
    return ok ? 0 : -1;
}

static void *pn_conn_main(void *arg) {
    pn_slot *slot = arg;
    pnode *node = slot->node;
    pn_conn pc = { .node = node, .id = slot->id };
    snprintf(pc.peer, sizeof pc.peer, "?");
    /* the handshake's whole deadline is the conn's timeout while it runs */
    wire_conn_init(&pc.conn, slot->fd, node->o->handshake_ms);
    if (pn_handshake(&pc) == 0 && pn_promote(slot, &pc) == 0) {
        pc.conn.timeout_ms = node->o->timeout_ms;
        pn_conn_loop(&pc);
    }
    session_free(pc.s);
    free(pc.prev);
    draft_server_conn_gone(node->drafter, pc.id);
    /* done before close: the shutdown path only touches fds of slots not
     * done, under the same lock, so it never sees a closed (reused) fd */
    pthread_mutex_lock(&node->mu);
    slot->done = 1;
    if (slot->state == PN_AUTHED) node->n_authed--;
    else if (!slot->evicted) node->n_preauth--;
    slot->state = PN_FREE;
    pthread_mutex_unlock(&node->mu);
    wire_conn_close(&pc.conn);
    return NULL;
}

/* ==== Accept loop ==== */

static void pn_reap(pnode *node, int all) {
    for (int i = 0; i < node->n_slots; i++) {
        pn_slot *s = &node->slots[i];
        pthread_mutex_lock(&node->mu);
        int join = s->used && (s->done || all);
        pthread_mutex_unlock(&node->mu);
        if (join) {
            pthread_join(s->th, NULL);
            s->used = 0;
            s->done = 0;
        }
    }
}

/* A free slot, waiting a little for dropped handshakes to exit; NULL if none. */
static pn_slot *pn_free_slot(pnode *node) {
    for (int waited = 0; waited <= PN_EVICT_WAIT_MS; waited += 10) {
        pn_reap(node, 0);
        for (int i = 0; i < node->n_slots; i++)
            if (!node->slots[i].used) return &node->slots[i];
        pn_sleep_ms(10);
    }
    return NULL;
}

static void pn_refuse(int fd, const char *fmt, int n) {
    wire_conn c;
    wire_conn_init(&c, fd, 500);
    pn_send_error(&c, 0, WERR_BUSY, fmt, n);
    wire_conn_close(&c);
}

static void pn_accept_one(pnode *node, int lfd) {
    char err[256];
    int fd = wire_accept(lfd, PN_TICK_MS, err, sizeof err);
    if (fd == -1) { log_error(NULL, "%s", err); pn_sleep_ms(PN_TICK_MS); }   /* e.g. out of fds: do not spin */
    if (fd < 0) return;
    struct sockaddr_storage ss;
    socklen_t sl = sizeof ss;
    httpd_addr a;
    int has_addr = !getpeername(fd, (struct sockaddr *)&ss, &sl) && !httpd_addr_of((struct sockaddr *)&ss, &a);
    pthread_mutex_lock(&node->mu);
    int full = node->n_authed >= node->max_authed;
    int trusted = has_addr && pn_is_trusted(node, &a, pn_mono_ms());
    int over = !full && pn_make_room(node, &a, has_addr, trusted);
    if (over) node->preauth_refused++;
    pthread_mutex_unlock(&node->mu);
    if (over) {   /* a flood: closed unanswered, at the cost of an accept */
        close(fd);
        return;
    }
    if (full) {
        pn_refuse(fd, "prefill node busy: %d connections", node->max_authed);
        log_warn(NULL, "refused a connection: all %d slots busy", node->max_authed);
        return;
    }
    pn_slot *slot = pn_free_slot(node);
    if (!slot) {
        pn_refuse(fd, "prefill node busy: %d handshakes in progress", node->max_preauth);
        log_warn(NULL, "refused a connection: no free slot");
        return;
    }
    pthread_mutex_lock(&node->mu);
    slot->used = 1;
    slot->done = 0;
    slot->fd = fd;
    slot->node = node;
    slot->id = ++node->next_conn;
    slot->state = PN_PREAUTH;
    slot->evicted = 0;
    slot->has_addr = has_addr;
    if (has_addr) slot->addr = a;
    slot->trusted = trusted;
    node->n_preauth++;
    pthread_mutex_unlock(&node->mu);
    if (pthread_create(&slot->th, NULL, pn_conn_main, slot)) {
        log_error(NULL, "cannot start a connection thread");
        close(fd);
        pthread_mutex_lock(&node->mu);
        slot->used = 0;
        slot->state = PN_FREE;
        node->n_preauth--;
        pthread_mutex_unlock(&node->mu);
    }
}

/* The rate a router sees before any request: one pass on the loaded model
 * (a failure only means no rate is reported until the first request). */
static void pn_calibrate(pnode *node) {
    char err[256];
    int n = node->o->n_ctx < PREFILL_RATE_CALIB_TOKENS ? node->o->n_ctx : PREFILL_RATE_CALIB_TOKENS;
    if (prefill_rate_calibrate(node->m, n, node->o->kv_dtype, &node->prefill_tps, err, sizeof err))
        log_warn(NULL, "calibration failed (no rate reported until the first request): %s", err);
    else
        log_info(NULL, "calibration: %d positions at %.0f t/s", n, node->prefill_tps);
}

static int pn_write_port(const char *path, int lfd, char *err, size_t errlen) {
    int port = wire_local_port(lfd);
    if (port < 0) { snprintf(err, errlen, "cannot find the listening port: %s", strerror(errno)); return -1; }
    if (!path) return port;
    char tmp[4096];
    snprintf(tmp, sizeof tmp, "%s.tmp", path);
    FILE *f = fopen(tmp, "w");
    int bad = !f;
    if (f) { bad = fprintf(f, "%d\n", port) < 0; bad |= fclose(f) != 0; }
    if (bad || rename(tmp, path)) { snprintf(err, errlen, "cannot write the port file %s", path); return -1; }
    return port;
}

/* --draft-model: the draft server, and DRAFT in our HELLO's caps. */
static int pn_drafter_start(pnode *node, char *err, size_t errlen) {
    int lo, hi;
    if (model_get_layers(node->m, &lo, &hi)) {
        snprintf(err, errlen, "--draft-model needs the whole model, not a slice (--layers)");
        return -1;
    }
    char e2[400];
    int slots = node->o->draft_slots > 0 ? node->o->draft_slots : 8;
    if (draft_server_create(&node->drafter, node->m, node->o->draft_model, slots, node->o->n_ctx, node->o->kv_dtype,
                            e2, sizeof e2)) {
        snprintf(err, errlen, "draft model: %s", e2);
        return -1;
    }
    node->hello.caps |= WIRE_CAP_DRAFT;
    log_info(NULL, "draft node: %d sequences of up to %d tokens", slots, node->o->n_ctx);
    return 0;
}

int prefill_node_run(model *m, const prefill_node_opts *o, char *err, size_t errlen) {
    pnode node = { .m = m, .o = o };
    prefill_node_opts oo = *o;
    if (oo.n_ctx <= 0) oo.n_ctx = 4096;
    if (!oo.kv_dtype) oo.kv_dtype = GGML_TYPE_F16;
    if (oo.timeout_ms <= 0) oo.timeout_ms = 10000;
    if (oo.handshake_ms <= 0) oo.handshake_ms = PN_DEFAULT_HANDSHAKE_MS;
    if (oo.idle_ms <= 0) oo.idle_ms = PN_IDLE_MS;
    if (oo.request_ms <= 0) oo.request_ms = PN_DEFAULT_REQUEST_MS;
    node.o = &oo;
    if (!o->secret || !o->secret_len) { snprintf(err, errlen, "a prefill node needs a shared secret"); return -1; }
    if (handoff_hello_init(&node.hello, m, oo.kv_dtype, WIRE_ROLE_PREFILL, o->node_id, err, errlen)) return -1;
    {   /* its context, for the router's plan (prefill_rate.h) */
        char d[sizeof node.hello.model_desc];
        prefill_ctx_format(d, sizeof d, node.hello.model_desc, oo.n_ctx);
        snprintf(node.hello.model_desc, sizeof node.hello.model_desc, "%s", d);
    }
    int lo, hi;
    if (o->draft_model && pn_drafter_start(&node, err, errlen)) return -1;
    if (model_get_layers(m, &lo, &hi)) {   /* a slice names its layers (chain.h reads them) */
        snprintf(node.base_desc, sizeof node.base_desc, "%.220s; layers %d:%d", node.hello.model_desc, lo, hi);
        snprintf(node.hello.model_desc, sizeof node.hello.model_desc, "%s", node.base_desc);
    } else {
        snprintf(node.base_desc, sizeof node.base_desc, "%s", node.hello.model_desc);
        pn_calibrate(&node);
    }
    node.max_authed = o->max_conns > 0 ? (o->max_conns < PN_MAX_CONNS ? o->max_conns : PN_MAX_CONNS) : PN_DEFAULT_CONNS;
    node.max_preauth = o->max_preauth > 0 ? (o->max_preauth < PN_MAX_CONNS ? o->max_preauth : PN_MAX_CONNS)
                                          : PN_DEFAULT_PREAUTH;
    node.max_trusted_preauth = node.max_preauth / 2 > PN_TRUSTED_PREAUTH_MIN ? node.max_preauth / 2 : PN_TRUSTED_PREAUTH_MIN;
    /* room for every authenticated and pre-auth connection, plus as many
     * dropped handshakes still on their way out */
    node.n_slots = node.max_authed + 2 * (node.max_preauth + node.max_trusted_preauth);
    node.slots = calloc((size_t)node.n_slots, sizeof *node.slots);
    if (!node.slots) { snprintf(err, errlen, "out of memory"); draft_server_free(node.drafter); return -1; }
    int lfd = wire_listen(o->listen ? o->listen : "127.0.0.1:0", err, errlen);
    if (lfd < 0) { free(node.slots); draft_server_free(node.drafter); return -1; }
    int port = pn_write_port(o->port_file, lfd, err, errlen);
    if (port < 0) { close(lfd); free(node.slots); draft_server_free(node.drafter); return -1; }
    pthread_mutex_init(&node.mu, NULL);
    pthread_mutex_init(&node.turn_mu, NULL);
    pthread_cond_init(&node.turn_cv, NULL);
    if (o->kv_cache_ram || o->kv_cache_dir) {
        kvstore_opts ko = { .ram_bytes = o->kv_cache_ram, .dir = o->kv_cache_dir, .disk_bytes = o->kv_cache_disk };
        if (kvstore_open(&node.store, m, oo.kv_dtype, oo.n_ctx, &ko, err, errlen)) {
            close(lfd);
            free(node.slots);
            draft_server_free(node.drafter);
            return -1;
        }
    }
    if (pn_metrics_init(&node.mt, &oo, err, errlen) ||
        (node.store && kvstore_metrics_init(&node.kvm, node.mt.reg, "tandem_prefill", err, errlen)) ||
        pn_metrics_start(&node, err, errlen)) {
        kvstore_close(node.store);
        metrics_free(node.mt.reg);
        close(lfd);
        pthread_mutex_destroy(&node.mu);
        pthread_mutex_destroy(&node.turn_mu);
        pthread_cond_destroy(&node.turn_cv);
        free(node.slots);
        draft_server_free(node.drafter);
        return -1;
    }
    if (o->port_out) *o->port_out = port;
    log_info(NULL, "node %s listening on port %d: %s", node.hello.node_id, port, node.hello.model_desc);
    while (!(o->stop && *o->stop)) {
        pn_reap(&node, 0);
        pn_accept_one(&node, lfd);
    }
    /* The drain (node_drain.h): deregister, stop accepting, let the
     * handoffs in flight finish, then cut what is left. */
    log_info(NULL, "shutting down: draining (up to %d ms)", oo.drain_timeout_ms);
    node_register_leave(o->reg);
    close(lfd);
    node.draining = 1;
    int left = node_drain_wait_count(&node.in_req, oo.drain_timeout_ms);
    if (left > 0) log_warn(NULL, "drain timeout (%d ms): cutting %d request(s) in flight", oo.drain_timeout_ms, left);
    node.cut = 1;
    /* Wake connection threads blocked in a handshake or a read so shutdown
     * does not wait out their I/O deadlines. */
    pthread_mutex_lock(&node.mu);
    for (int i = 0; i < node.n_slots; i++)
        if (node.slots[i].used && !node.slots[i].done) shutdown(node.slots[i].fd, SHUT_RDWR);
    pthread_mutex_unlock(&node.mu);
    pn_reap(&node, 1);
    log_info(NULL, "shut down after %llu requests", (unsigned long long)node.n_requests);
    kvstore_close(node.store);
    httpd_stop(node.mt.http);
    metrics_free(node.mt.reg);
    pthread_mutex_destroy(&node.mu);
    pthread_mutex_destroy(&node.turn_mu);
    pthread_cond_destroy(&node.turn_cv);
    free(node.slots);
    if (node.drafter) {
        uint64_t ex, nd;
        draft_server_counts(node.drafter, &ex, &nd);
        log_info(NULL, "draft node: %llu exchanges answered, %llu drafts sent", (unsigned long long)ex,
                 (unsigned long long)nd);
    }
    draft_server_free(node.drafter);
    return 0;
}

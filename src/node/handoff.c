/* handoff.c - the decode side of the KV handoff (see handoff.h), plus the
 * pieces both sides share: the HELLO a node presents (model fingerprint and
 * description) and KV row conversion between wire and cache types.
 *
 * A transfer is a stream of WIRE_KV frames in a strict order: chunk by chunk
 * (the prefill node's prefill batches), and within a chunk layer 0 first,
 * then 1, 2, ... n_layer - 1, every position of [start_pos, end_pos) covered
 * exactly once. Anything else is rejected, the partial KV is dropped (the
 * session is reset to start_pos) and the connection is given up.
 */
#include "node/handoff.h"

#include <errno.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <unistd.h>

#include "engine/fingerprint.h"
#include "engine/generate.h"
#include "engine/gguf.h"
#include "engine/quant.h"
#include "net/deadline.h"
#include "net/wire.h"

struct handoff_client {
    wire_conn conn;
    model *m;
    uint32_t kv_dtype;
    uint32_t caps;              /* capabilities both ends have */
    int timeout_ms;
    int deadline_ms;            /* 0: deadline_prefill_ms of each transfer's positions */
    int (*abandoned)(void *ud);
    void *abandoned_ud;
    uint32_t fail_code;         /* enum wire_err to tell the peer after a failed transfer, 0 = CANCEL */
    int zstd;
    uint32_t wire_dtype;
    int broken;                 /* a failed transfer left the stream in an unknown state */
    uint64_t next_req;
    uint32_t log_id;            /* low 32 bits of the next request ids (handoff_set_log_id) */
    char peer[400];             /* "node-id (model description)" */
    char peer_desc[256];        /* the peer HELLO's model_desc (a slice names its layers there) */
    float *tmp;                 /* one f32 row for dtype conversion */
    size_t tmp_cap;             /* floats in it */
    uint8_t *conv;              /* a frame's rows in the cache dtype: K's, then V's */
    size_t conv_cap;            /* bytes in it */
};

/* Default wait for the next frame (ms): a prefill node computes a layer of a
 * chunk in far less, so 10 s of silence means it is gone or stuck. */
#define HANDOFF_DEFAULT_TIMEOUT_MS 10000
/* The limit on a whole transfer, unless handoff_opts.deadline_ms sets one,
 * is deadline_prefill_ms of its positions (net/deadline.h: 300 s, more for
 * prompts over 6,000 tokens): a peer that keeps the connection busy (PINGs,
 * one frame just inside the stall timeout) is given up after it, so a
 * decode slot is never held forever, while a long prompt on a slow node,
 * which does progress, keeps its time. */

/* ==== HELLO ==== */

int handoff_hello_init(wire_hello *h, model *m, uint32_t kv_dtype, uint32_t role, const char *node_id,
                       char *err, size_t errlen) {
    memset(h, 0, sizeof *h);
    h->role = role;
    h->caps = WIRE_CAP_ZSTD | WIRE_CAP_Q8_0 | WIRE_CAP_BF16 | WIRE_CAP_SLICE;
    h->kv_dtype = kv_dtype;
    snprintf(h->node_id, sizeof h->node_id, "%s", node_id && *node_id ? node_id : wire_role_name(role));
    char desc[200];
    if (model_fingerprint(m, h->fingerprint, desc, sizeof desc)) {
        snprintf(err, errlen, "%s", desc);
        return -1;
    }
    snprintf(h->model_desc, sizeof h->model_desc, "%s, KV %s", desc, gguf_type_name(kv_dtype));
    return 0;
}

/* ==== Row conversion ==== */

void handoff_convert_rows(uint32_t src_type, const void *src, uint32_t dst_type, void *dst,
                          int n_rows, int dim, float *tmp) {
    size_t sb = (size_t)gguf_row_bytes(src_type, (uint64_t)dim);
    size_t db = (size_t)gguf_row_bytes(dst_type, (uint64_t)dim);
    for (int r = 0; r < n_rows; r++) {
        quant_dequantize_row(src_type, (const uint8_t *)src + (size_t)r * sb, tmp, dim);
        quant_quantize_act_row(dst_type, tmp, (uint8_t *)dst + (size_t)r * db, dim);
    }
}

/* ==== Connect ==== */

int handoff_connect(handoff_client **out, const char *hostport, model *m, uint32_t kv_dtype,
                    const handoff_opts *o, char *err, size_t errlen) {
    *out = NULL;
    if (!o || !o->secret || o->secret_len == 0) {
        snprintf(err, errlen, "a shared secret is needed to talk to prefill node %s", hostport);
        return -1;
    }
    handoff_client *c = calloc(1, sizeof *c);
    if (!c) { snprintf(err, errlen, "out of memory"); return -1; }
    c->m = m;
    c->kv_dtype = kv_dtype;
    c->timeout_ms = o->timeout_ms > 0 ? o->timeout_ms : HANDOFF_DEFAULT_TIMEOUT_MS;
    c->deadline_ms = o->deadline_ms > 0 ? o->deadline_ms : 0;
    c->abandoned = o->abandoned;
    c->abandoned_ud = o->abandoned_ud;
    c->zstd = o->zstd;
    c->wire_dtype = o->wire_dtype ? o->wire_dtype : kv_dtype;
    snprintf(c->peer, sizeof c->peer, "%s", hostport);
    char e2[512];
    int fd = wire_connect(hostport, c->timeout_ms, e2, sizeof e2);
    if (fd < 0) {
        snprintf(err, errlen, "cannot connect to prefill node %s: %s", hostport, e2);
        free(c);
        return -1;
    }
    wire_conn_init(&c->conn, fd, c->timeout_ms);
    wire_hello mine, peer;
    if (handoff_hello_init(&mine, m, kv_dtype, WIRE_ROLE_DECODE, o->node_id, e2, sizeof e2)) {
        snprintf(err, errlen, "%s", e2);
        goto fail;
    }
    if (wire_handshake(&c->conn, &mine, o->secret, o->secret_len, &peer, e2, sizeof e2)) {
        snprintf(err, errlen, "handshake with prefill node %s failed: %s", hostport, e2);
        goto fail;
    }
    snprintf(c->peer, sizeof c->peer, "%s [%s]", hostport, peer.node_id);
    snprintf(c->peer_desc, sizeof c->peer_desc, "%s", peer.model_desc);
    if (peer.role != WIRE_ROLE_PREFILL) {
        snprintf(err, errlen, "%s is not a prefill node (role %u)", c->peer, peer.role);
        goto fail;
    }
    c->caps = mine.caps & peer.caps;
    if (c->wire_dtype != kv_dtype && c->wire_dtype != GGML_TYPE_Q8_0) {
        snprintf(err, errlen, "wire dtype %s differs from the KV cache type %s (only q8_0 may differ: KV is never upcast)",
                 gguf_type_name(c->wire_dtype), gguf_type_name(kv_dtype));
        goto fail;
    }
    if (c->wire_dtype == GGML_TYPE_Q8_0 && kv_dtype != GGML_TYPE_Q8_0 && !(c->caps & WIRE_CAP_Q8_0)) {
        snprintf(err, errlen, "prefill node %s cannot send q8_0 KV", c->peer);
        goto fail;
    }
    *out = c;
    return 0;
fail:
    wire_conn_close(&c->conn);
    free(c);
    return -1;
}

void handoff_close(handoff_client *c) {
    if (!c) return;
    wire_conn_close(&c->conn);
    free(c->tmp);
    free(c->conv);
    free(c);
}

const char *handoff_peer(const handoff_client *c) { return c ? c->peer : "(none)"; }

/* ==== Transfer ==== */

/* Where the stream stands: positions [start, next) are complete in every
 * layer; the chunk [chunk_p0, chunk_p0 + chunk_n) has layers [0, layer). */
typedef struct {
    int start, end, next;
    int chunk_p0, chunk_n, layer;
    int n_layer;
    uint64_t kv_bytes;
    double deadline;            /* gen_now_ms() by which the transfer must be done */
    int deadline_ms;            /* that deadline's length, for messages */
} xfer_state;

static void xfer_where(const xfer_state *x, char *buf, size_t len) {
    int p0 = x->layer ? x->chunk_p0 : x->next;
    snprintf(buf, len, "%d of %d layers of chunk %d; %d of %d positions complete",
             x->layer, x->n_layer, p0, x->next - x->start, x->end - x->start);
}

/* Room for one f32 row of `floats` and `bytes` of converted rows. */
static int handoff_grow_conv(handoff_client *c, size_t floats, size_t bytes) {
    if (floats > c->tmp_cap) {
        float *t = realloc(c->tmp, floats * sizeof(float));
        if (!t) return -1;
        c->tmp = t;
        c->tmp_cap = floats;
    }
    if (bytes > c->conv_cap) {
        uint8_t *p = realloc(c->conv, bytes);
        if (!p) return -1;
        c->conv = p;
        c->conv_cap = bytes;
    }
    return 0;
}

/* Checks one KV frame against the model and the stream order. */
static int xfer_check(handoff_client *c, const xfer_state *x, const wire_kv *kv, kvcache *cache,
                      char *err, size_t errlen) {
    if (kv->layer >= (uint32_t)x->n_layer) {
        snprintf(err, errlen, "prefill node %s sent a frame for layer %u but the model has %d layers",
                 c->peer, kv->layer, x->n_layer);
        return -1;
    }
    if (kv->dtype != c->wire_dtype) {
        snprintf(err, errlen, "prefill node %s sent KV of type %s (%u), expected %s", c->peer,
                 gguf_type_name(kv->dtype), kv->dtype, gguf_type_name(c->wire_dtype));
        return -1;
    }
    uint64_t rb = gguf_row_bytes(kv->dtype, (uint64_t)kv_dim(cache));
    if (kv->row_bytes != rb) {
        snprintf(err, errlen, "prefill node %s sent rows of %u bytes, expected %llu (%s, dim %d)", c->peer,
                 kv->row_bytes, (unsigned long long)rb, gguf_type_name(kv->dtype), kv_dim(cache));
        return -1;
    }
    if (kv->n == 0 || kv->pos0 < (uint32_t)x->start || (uint64_t)kv->pos0 + kv->n > (uint64_t)x->end) {
        snprintf(err, errlen, "prefill node %s sent positions %u..%llu outside the requested span %d..%d",
                 c->peer, kv->pos0, (unsigned long long)kv->pos0 + kv->n, x->start, x->end);
        return -1;
    }
    int want_p0 = x->layer ? x->chunk_p0 : x->next;
    int bad = (int)kv->layer != x->layer || (int)kv->pos0 != want_p0 || (x->layer && (int)kv->n != x->chunk_n);
    if (bad) {
        snprintf(err, errlen, "prefill node %s sent frames out of order: expected layer %d of chunk %d, "
                 "got layer %u of positions %u..%u", c->peer, x->layer, want_p0, kv->layer, kv->pos0,
                 kv->pos0 + kv->n);
        return -1;
    }
    return 0;
}

static int xfer_store(handoff_client *c, xfer_state *x, const wire_kv *kv, kvcache *cache,
                      char *err, size_t errlen) {
    if (xfer_check(c, x, kv, cache, err, errlen)) return -1;
    char e2[256];
    int rc;
    if (kv->dtype == kv_dtype(cache)) {
        rc = kv_write_span(cache, (int)kv->layer, (int)kv->pos0, (int)kv->n, kv->k, kv->v, e2, sizeof e2);
    } else {
        /* the frame's rows converted to the cache dtype, then stored as they are */
        int dim = kv_dim(cache);
        size_t half = (size_t)kv->n * kv_row_bytes(cache);
        rc = kv_check_range(cache, (int)kv->layer, (int)kv->pos0, (int)kv->n, e2, sizeof e2);
        if (!rc && handoff_grow_conv(c, (size_t)dim, 2 * half)) { snprintf(e2, sizeof e2, "out of memory"); rc = -1; }
        if (!rc) {
            handoff_convert_rows(kv->dtype, kv->k, kv_dtype(cache), c->conv, (int)kv->n, dim, c->tmp);
            handoff_convert_rows(kv->dtype, kv->v, kv_dtype(cache), c->conv + half, (int)kv->n, dim, c->tmp);
            rc = kv_write_span(cache, (int)kv->layer, (int)kv->pos0, (int)kv->n, c->conv, c->conv + half, e2,
                               sizeof e2);
        }
    }
    if (rc) { snprintf(err, errlen, "cannot store KV from prefill node %s: %s", c->peer, e2); return -1; }
    x->kv_bytes += 2ull * kv->n * kv->row_bytes;
    if (x->layer == 0) { x->chunk_p0 = (int)kv->pos0; x->chunk_n = (int)kv->n; }
    if (++x->layer == x->n_layer) { x->next = x->chunk_p0 + x->chunk_n; x->layer = 0; }
    return 0;
}

/* Turns a wire_recv failure into the message users see. */
static void xfer_recv_error(handoff_client *c, const xfer_state *x, const char *why, char *err, size_t errlen) {
    char where[160];
    xfer_where(x, where, sizeof where);
    c->fail_code = c->conn.rx_err;
    if (c->conn.rx_err == WERR_TIMEOUT && gen_now_ms() >= x->deadline)
        snprintf(err, errlen, "prefill node %s did not finish within the handoff deadline of %d ms (%s)", c->peer,
                 x->deadline_ms, where);
    else if (c->conn.rx_err == WERR_AUTH)
        snprintf(err, errlen, "frame from prefill node %s failed authentication, nothing of it was used: %s (%s)",
                 c->peer, why, where);
    else if (strstr(why, "checksum") || strstr(why, "CRC") || strstr(why, "crc"))
        snprintf(err, errlen, "prefill node %s sent a corrupted frame: %s (%s)", c->peer, why, where);
    else if (strstr(why, "timed out") || strstr(why, "timeout"))
        snprintf(err, errlen, "prefill node %s timed out: no frame for %d ms (%s)", c->peer, c->timeout_ms, where);
    else if (strstr(why, "closed") || strstr(why, "reset") || strstr(why, "EOF"))
        snprintf(err, errlen, "prefill node %s closed the connection mid-transfer (%s): %s", c->peer, where, why);
    else
        snprintf(err, errlen, "receiving from prefill node %s failed (%s): %s", c->peer, where, why);
}

static int xfer_send_request(handoff_client *c, uint64_t req, const int32_t *tokens, int n, int start_pos,
                             int end_pos, uint32_t extra_flags, char *err, size_t errlen) {
    wire_request r = { .start_pos = (uint32_t)start_pos, .end_pos = (uint32_t)end_pos,
                       .wire_dtype = c->wire_dtype,
                       .flags = ((c->zstd && (c->caps & WIRE_CAP_ZSTD)) ? 1u : 0u) | extra_flags,
                       .n_tokens = (uint32_t)n };
    wire_buf b = { 0 };
    char e2[256];
    int rc = wire_encode_request(&b, &r, tokens);
    if (rc == 0) rc = wire_send(&c->conn, WIRE_REQUEST, req, 0, b.data, b.len, e2, sizeof e2);
    else snprintf(e2, sizeof e2, "cannot encode the request");
    wire_buf_free(&b);
    if (rc) snprintf(err, errlen, "sending the request to prefill node %s failed: %s", c->peer, e2);
    return rc;
}

/* One frame of the transfer: 1 = DONE received, 0 = keep going, -1 = failed. */
/* The per-frame timeout, cut short by the transfer's deadline; 0 = passed. */
static int xfer_frame_timeout(handoff_client *c, const xfer_state *x) {
    double left = x->deadline - gen_now_ms();
    if (left <= 0) return 0;
    return left < c->timeout_ms ? (int)left + 1 : c->timeout_ms;
}

static int xfer_step(handoff_client *c, uint64_t req, xfer_state *x, kvcache *cache, wire_done *done,
                     char *err, size_t errlen) {
    wire_header h;
    char e2[512];
    if (c->abandoned && c->abandoned(c->abandoned_ud)) {
        snprintf(err, errlen, "handoff from prefill node %s cancelled: the request was abandoned", c->peer);
        return -1;
    }
    c->conn.timeout_ms = xfer_frame_timeout(c, x);
    if (!c->conn.timeout_ms) {
        char where[160];
        xfer_where(x, where, sizeof where);
        snprintf(err, errlen, "prefill node %s did not finish within the handoff deadline of %d ms (%s)", c->peer,
                 x->deadline_ms, where);
        return -1;
    }
    int rr = wire_recv(&c->conn, &h, e2, sizeof e2);
    c->conn.timeout_ms = c->timeout_ms;
    if (rr) { xfer_recv_error(c, x, e2, err, errlen); return -1; }
    const uint8_t *p = c->conn.rx.data;
    size_t n = c->conn.rx.len;
    if (h.type == WIRE_PING) {   /* answered, but it moves no deadline */
        if (wire_send(&c->conn, WIRE_PONG, h.req_id, 0, p, n, e2, sizeof e2)) {
            snprintf(err, errlen, "answering a PING from prefill node %s failed: %s", c->peer, e2);
            return -1;
        }
        return 0;
    }
    if (h.type == WIRE_PONG) return 0;
    c->fail_code = WERR_PROTOCOL;   /* from here on, a failure is the peer's malformed stream */
    if (h.type == WIRE_ERROR) {
        wire_error we = { 0 };
        if (wire_decode_error(p, n, &we, e2, sizeof e2)) snprintf(we.message, sizeof we.message, "(undecodable: %.400s)", e2);
        snprintf(err, errlen, "prefill node %s reported an error (code %u): %s", c->peer, we.code, we.message);
        c->fail_code = 0;
        return -1;
    }
    if (h.req_id != req) {
        snprintf(err, errlen, "prefill node %s sent a frame for request %llu during request %llu", c->peer,
                 (unsigned long long)h.req_id, (unsigned long long)req);
        return -1;
    }
    if (h.type == WIRE_KV) {
        wire_kv kv;
        if (wire_decode_kv(p, n, &kv, e2, sizeof e2)) {
            snprintf(err, errlen, "prefill node %s sent a malformed KV frame: %s", c->peer, e2);
            return -1;
        }
        int r = xfer_store(c, x, &kv, cache, err, errlen);
        if (r == 0) c->fail_code = 0;
        return r;
    }
    if (h.type == WIRE_DONE) {
        if (wire_decode_done(p, n, done, e2, sizeof e2)) {
            snprintf(err, errlen, "prefill node %s sent a malformed DONE frame: %s", c->peer, e2);
            return -1;
        }
        if (x->next != x->end || x->layer != 0 || done->n_positions != (uint32_t)(x->end - x->start)) {
            char where[160];
            xfer_where(x, where, sizeof where);
            snprintf(err, errlen, "prefill node %s finished early: DONE says %u positions, received %s",
                     c->peer, done->n_positions, where);
            return -1;
        }
        c->fail_code = 0;
        return 1;
    }
    snprintf(err, errlen, "prefill node %s sent an unexpected frame of type %u", c->peer, h.type);
    return -1;
}

/* Tells the prefill node why (an ERROR for a bad frame, else a CANCEL; best
 * effort) and gives the connection up. */
static void xfer_abort(handoff_client *c, uint64_t req, const char *why) {
    char e2[128];
    c->conn.timeout_ms = 200;   /* a dead peer must not hold us up */
    if (c->fail_code) wire_send_error(&c->conn, 0, c->fail_code, why);
    else wire_send(&c->conn, WIRE_CANCEL, req, 0, NULL, 0, e2, sizeof e2);
    wire_conn_shutdown(&c->conn);
    c->broken = 1;
}

void handoff_set_log_id(handoff_client *c, uint32_t id) { c->log_id = id; }

int handoff_prefill(handoff_client *c, session *s, const int32_t *tokens, int n, int start_pos,
                    handoff_stats *st, char *err, size_t errlen) {
    memset(st, 0, sizeof *st);
    st->start_pos = start_pos;
    if (c->broken) { snprintf(err, errlen, "the connection to prefill node %s failed earlier", c->peer); return -1; }
    kvcache *cache = session_kv(s);
    int end_pos = n - 1;
    if (start_pos < 0 || start_pos > session_pos(s) || n < 1) {
        snprintf(err, errlen, "bad handoff span: start %d, %d tokens, session holds %d", start_pos, n, session_pos(s));
        return -1;
    }
    session_reset(s, start_pos);
    if (end_pos <= start_pos) return 0;   /* nothing to fetch: the caller computes the last token */
    if (kv_check_range(cache, 0, 0, n, err, errlen)) return -1;
    /* ids increase (the counter in the high half), and the low half carries
     * the request's log id so that the prefill node logs the same one */
    uint64_t req = ++c->next_req << 32 | c->log_id;
    double t0 = gen_now_ms();
    uint64_t in0 = c->conn.bytes_in;
    if (xfer_send_request(c, req, tokens, n, start_pos, end_pos, 0, err, errlen)) { c->broken = 1; return -1; }
    int limit = handoff_deadline_for(c, end_pos - start_pos);
    xfer_state x = { .start = start_pos, .end = end_pos, .next = start_pos, .n_layer = kv_n_layer(cache),
                     .deadline = t0 + limit, .deadline_ms = limit };
    wire_done done;
    int rc;
    c->fail_code = 0;
    while ((rc = xfer_step(c, req, &x, cache, &done, err, errlen)) == 0) {}
    if (rc < 0) {
        xfer_abort(c, req, err);
        session_reset(s, start_pos);
        return -1;
    }
    kv_set_used(cache, end_pos);
    st->total_ms = gen_now_ms() - t0;
    st->n_sent = end_pos - start_pos;
    st->n_computed_remote = (int)done.n_computed;
    st->prefill_ms_remote = done.prefill_ms;
    /* The clocks of the two nodes are not comparable: what the remote
     * compute does not explain is transfer (plus the request's own trip). */
    st->transfer_tail_ms = st->total_ms > done.prefill_ms ? st->total_ms - done.prefill_ms : 0.0;
    st->kv_bytes = x.kv_bytes;
    st->wire_bytes = c->conn.bytes_in - in0;
    return 0;
}

/* ==== For the layer-split chain (chain.c) ==== */

wire_conn *handoff_conn(handoff_client *c) { return &c->conn; }
const char *handoff_peer_desc(const handoff_client *c) { return c->peer_desc; }
uint32_t handoff_caps(const handoff_client *c) { return c->caps; }
uint32_t handoff_wire_dtype(const handoff_client *c) { return c->wire_dtype; }
int handoff_timeout_ms(const handoff_client *c) { return c->timeout_ms; }
int handoff_deadline_for(const handoff_client *c, int n_positions) {
    return c->deadline_ms > 0 ? c->deadline_ms : deadline_prefill_ms(n_positions);
}
int handoff_is_broken(const handoff_client *c) { return c->broken; }
int handoff_poll_abandoned(handoff_client *c) { return c->abandoned && c->abandoned(c->abandoned_ud); }

uint64_t handoff_send_request(handoff_client *c, const int32_t *tokens, int n, int start_pos, int end_pos,
                              uint32_t extra_flags, char *err, size_t errlen) {
    uint64_t req = ++c->next_req << 32 | c->log_id;
    if (xfer_send_request(c, req, tokens, n, start_pos, end_pos, extra_flags, err, errlen)) { c->broken = 1; return 0; }
    return req;
}

void handoff_abort(handoff_client *c, uint64_t req, uint32_t code, const char *why) {
    c->fail_code = code;
    xfer_abort(c, req, why);
}

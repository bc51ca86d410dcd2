/* node_prefill_stream.c - the prefill node's KV streaming: the layer hook
 * queues (layer, pos0, n) descriptors, the sender thread reads those rows
 * straight out of the session's cache and puts them on the wire while
 * later layers compute; the hook also watches the socket for a CANCEL or
 * a vanished decode node. */

#include <errno.h>
#include <poll.h>
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <sys/socket.h>
#include <time.h>

#include "engine/generate.h"
#include "base/log.h"

#include "node/node_prefill_internal.h"

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

void *pn_sender_main(void *arg) {
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
int pn_check_peer(pn_req *r) {
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
void pn_wait_tick(pn_req *r) {
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

int pn_hook(void *ud, int layer, int pos0, int n) {
    pn_req *r = ud;
    r->cur_layer = layer;
    r->cur_pos = pos0;
    if (r->node->o->debug_layer_delay_ms > 0) pn_sleep_ms(r->node->o->debug_layer_delay_ms);   /* tests: a slow node */
    if (pn_stopped(r->node)) { r->stopping = 1; return 1; }
    if (pn_check_peer(r)) return 1;
    int lo = pos0 > r->start ? pos0 : r->start;
    int hi = pos0 + n < r->end ? pos0 + n : r->end;
    if (lo >= hi) return 0;   /* a chunk before start_pos: the decode node has it */
    if (pn_frame_bytes(r, hi - lo) > WIRE_MAX_PAYLOAD) { r->too_big = hi - lo; return 1; }
    return pn_push(r, layer, lo, hi - lo);
}

/* Queues the part of [start, end) the session already holds (prefix reuse). */
int pn_push_cached(pn_req *r, int have) {
    int hi = have < r->end ? have : r->end;
    int span = PN_CACHED_SPAN;
    while (span > 1 && pn_frame_bytes(r, span) > WIRE_MAX_PAYLOAD) span /= 2;
    for (int p = r->start; p < hi; p += span) {
        int n = hi - p < span ? hi - p : span;
        for (int l = wire_layers_kv(r->slice_lo); l < wire_layers_kv(r->slice_hi); l++)
            if (pn_push(r, l, p, n)) return -1;
    }
    return 0;
}

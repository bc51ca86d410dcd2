/* node_prefill_job.c - one REQUEST on the prefill node: checked and
 * admitted, its session and reuse, the compute turn (one evaluation at a
 * time per model), the computation (whole, or a slice of a layer-split
 * chain), DONE or ERROR, and what it adds to the counters. */

#include <errno.h>
#include <poll.h>
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <time.h>

#include "engine/generate.h"
#include "base/log.h"
#include "net/deadline.h"
#include "net/prefill_rate.h"

#include "node/node_prefill_internal.h"

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
    double pinged = gen_now_ms();
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
        if (!give_up && gen_now_ms() - pinged >= PN_QUEUE_PING_MS) {   /* alive, only queued */
            char e2[128];
            (void)wire_send(r->conn, WIRE_PING, r->req_id, 0, NULL, 0, e2, sizeof e2);   /* a failure shows at the next read */
            pinged = gen_now_ms();
        }
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
    if (!r->slice_ends && !r->x_out && !(r->x_out = malloc(sizeof(float) * dim * (size_t)model_get_n_batch(m)))) {
        snprintf(err, errlen, "out of memory for hidden states");
        return -1;
    }
    return model_eval_slice(m, pc->s, r->slice_lo > 0 ? NULL : tokens + p, xin, n,
                            r->slice_ends ? NULL : r->x_out, pn_hook, r, err, errlen);
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
        log_debug(rid, "slice %s chunk %d..%d wait_ms=%.1f compute_ms=%.1f act_send_ms=%.1f", r->slice_txt,
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
        if (!rc && r->sliced && !r->slice_ends) rc = pn_act_out(r, p, n, err, errlen);
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
    session_rows_read(pc->s);   /* the cached rows the sender reads */
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
    r->limit_ms = node->o->request_ms > 0 ? node->o->request_ms : deadline_prefill_ms((long long)q->end_pos - q->start_pos);
    r->deadline = t_req + r->limit_ms;
    r->wire_dtype = q->wire_dtype; r->send_flags = send_flags;
    r->n_layer = n_layer;
    r->sliced = model_get_layers(node->m, NULL, NULL);
    model_get_halves(node->m, &r->slice_lo, &r->slice_hi);
    r->slice_ends = r->slice_hi >= 2 * n_layer;
    wire_layers_format(r->slice_txt, sizeof r->slice_txt, r->slice_lo, r->slice_hi);
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
        log_info(rid, "slice %s chunks=%d rows=%d compute_ms=%.1f act_wait_first_ms=%.1f act_wait_ms=%.1f "
                 "act_send_ms=%.1f", r->slice_txt, r->n_chunks, r->chunk_rows, ms, r->act_first_wait_ms,
                 r->act_wait_ms, r->act_send_ms);
    return keep;
}

/* A request that did not finish: the ERROR that ends its stream (none when
 * the decode node is gone) and its log line. Returns 1 to keep the
 * connection. */
static int pn_request_failed(pn_conn *pc, const pn_req *r, const char *err, const char *rid) {
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
                      r->limit_ms);
        log_warn(rid, "request %llu (conn %u) stopped: past its %d ms deadline (%d frames sent)", seq, pc->id,
                 r->limit_ms, r->frames);
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
    if (node->store && rc == 0 && !r->failed) {
        session_rows_read(pc->s);
        kvstore_put(node->store, pc->prev, session_pos(pc->s), session_kv(pc->s));
    }
    pn_metrics_request(node, r, pn_outcome(r, rc, keep), r->end > have ? r->end - have : 0, ms, gen_now_ms() - t_req,
                       pc->conn.bytes_out - out0);
    pn_req_free(r);
    free(r);
    return keep ? 0 : -1;
}

/* One request, counted in in_req for the drain; a request that arrives
 * while draining is refused (its decode node prefills locally). */
int pn_request(pn_conn *pc, uint64_t req) {
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

/* chain.c - layer-split prefill: the decode side's merge of
 * several slice nodes' KV streams with the relay of their hidden states,
 * and the prefill side's ACT helpers (see chain.h, docs/layer-split.md;
 * the spec is parsed by net/chain_spec.c). */
#include "node/chain.h"

#include <errno.h>
#include <poll.h>
#include <pthread.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "base/log.h"
#include "engine/generate.h"
#include "engine/gguf.h"
#include "net/wire_act.h"

/* ==== Flags ==== */

uint32_t chain_act_dtype_from_flags(uint32_t flags) {
    switch ((flags & CHAIN_REQ_ACT_MASK) >> CHAIN_REQ_ACT_SHIFT) {
    case 0: return GGML_TYPE_F32;
    case 1: return GGML_TYPE_F16;
    case 2: return GGML_TYPE_BF16;
    default: return UINT32_MAX;
    }
}

uint32_t chain_act_flags(uint32_t dtype) {
    uint32_t v = dtype == GGML_TYPE_F16 ? 1u : dtype == GGML_TYPE_BF16 ? 2u : 0u;
    return v << CHAIN_REQ_ACT_SHIFT;
}

/* ==== Prefill side ==== */

int chain_min_rows(int n_expert, int n_used) {
    if (n_expert <= 1 || n_used < 1 || n_used > n_expert) return CHAIN_MIN_ROWS;
    long r = (long)CHAIN_MIN_EXPERT_ROWS * n_expert / n_used;
    return r > CHAIN_MIN_ROWS ? (r > (1 << 20) ? 1 << 20 : (int)r) : CHAIN_MIN_ROWS;
}

int chain_chunk_rows(int n_batch, int span, int min_chunks, int min_rows) {
    int rows = n_batch > 0 ? n_batch : 1;
    while (rows / 2 >= min_rows && (span + rows - 1) / rows < min_chunks) rows /= 2;
    return rows;
}

int chain_act_take(chain_act_in *a, const uint8_t *p, size_t n, char *err, size_t errlen) {
    wire_act x;
    if (wire_decode_act(p, n, &x, err, errlen)) return -1;
    if ((int)x.dim != a->dim) {
        snprintf(err, errlen, "ACT rows of %u elements, this model's are %d", x.dim, a->dim);
        return -1;
    }
    if (!a->started) { a->started = 1; a->p0 = a->end = (int)x.pos0; }
    if ((int)x.pos0 != a->end || (uint64_t)x.pos0 + x.n > (uint64_t)a->limit) {
        snprintf(err, errlen, "ACT positions %u..%llu out of order or range (expected %d.., request ends at %d)",
                 x.pos0, (unsigned long long)x.pos0 + x.n, a->end, a->limit);
        return -1;
    }
    size_t need = (size_t)(a->end - a->p0) + x.n;
    if (need > a->cap_rows) {
        size_t cap = (size_t)(a->limit - a->p0);   /* the request bounds it: end_pos <= n_ctx */
        float *r = realloc(a->rows, cap * (size_t)a->dim * sizeof(float));
        if (!r) { snprintf(err, errlen, "out of memory for %zu rows of hidden states", cap); return -1; }
        a->rows = r;
        a->cap_rows = cap;
    }
    wire_act_rows_f32(&x, a->rows + (size_t)(a->end - a->p0) * (size_t)a->dim);
    a->end += (int)x.n;
    return 0;
}

void chain_act_free(chain_act_in *a) {
    free(a->rows);
    memset(a, 0, sizeof *a);
}

int chain_act_send(wire_conn *c, uint64_t req, uint32_t wire_flags, uint32_t dtype, int pos0, int n, int dim,
                   const float *rows, wire_buf *fb, char *err, size_t errlen) {
    uint32_t per = wire_act_max_rows(dtype, (uint32_t)dim);
    for (int done = 0; done < n;) {
        int k = n - done < (int)per ? n - done : (int)per;
        wire_buf_reset(fb);
        if (wire_encode_act(fb, (uint32_t)(pos0 + done), (uint32_t)k, dtype, (uint32_t)dim,
                            rows + (size_t)done * (size_t)dim)) {
            snprintf(err, errlen, "cannot encode an ACT frame (out of memory?)");
            return -1;
        }
        if (wire_send(c, WIRE_ACT, req, wire_flags, fb->data, fb->len, err, errlen)) return -1;
        done += k;
    }
    return 0;
}

/* ==== Decode side ==== */

/* One slice node's stream: positions [start, next) complete in all its
 * layers; the chunk at chunk_p0 has its layers [lo, lo + layer). */
typedef struct {
    handoff_client *c;
    uint64_t req;
    int lo, hi;                 /* the blocks whose K/V it sends */
    char txt[32];               /* its slice, "A:B" as the spec writes it */
    int next, chunk_p0, chunk_n, layer;
    int act_next;               /* next position of its ACT stream (-1: none yet) */
    int done;
    wire_done d;
    uint64_t in0;
    /* pipeline figures (the chain's log line), ms since the requests went out */
    double t_first, t_done;     /* its first frame, its DONE */
    double busy_ms;             /* reading, opening and storing its frames */
    double relay_ms, relay_max_ms;   /* sending its hidden states on to the next node */
    int relay_frames;
    uint64_t relay_bytes;
} chain_node;

typedef struct {
    chain_node nd[CHAIN_SPEC_MAX];
    int n;
    int start, end, n_layer, n_embd;
    uint32_t act_dtype, wire_dtype;
    int *got;                   /* [n_layer]: positions received per layer */
    uint64_t kv_bytes;
    uint8_t *conv;
    size_t conv_cap;
    float *tmp;
    char failed_node[300];
    uint32_t fail_code;         /* what to tell the node that failed: an ERROR code, 0 = CANCEL */
    double t0;                  /* gen_now_ms() when the requests went out */
} chain_run;

static int chain_check_slices(handoff_client **cs, const chain_spec *spec, int n_layer, chain_run *x,
                              char *err, size_t errlen) {
    int want = 0;
    for (int i = 0; i < spec->n; i++) {
        int lo, hi;
        char ts[32], tn[32];
        wire_layers_format(ts, sizeof ts, spec->lo[i], spec->hi[i]);
        if (!(handoff_caps(cs[i]) & WIRE_CAP_SLICE) || chain_spec_desc_layers(handoff_peer_desc(cs[i]), &lo, &hi)) {
            snprintf(err, errlen, "chain refused: prefill node %s serves no layer slice (start it with --layers %s)",
                     handoff_peer(cs[i]), ts);
            return -1;
        }
        wire_layers_format(tn, sizeof tn, lo, hi);
        if (lo != spec->lo[i] || hi != spec->hi[i]) {
            snprintf(err, errlen, "chain refused: prefill node %s serves layers %s, the chain names it for %s",
                     handoff_peer(cs[i]), tn, ts);
            return -1;
        }
        if (lo != want || hi > 2 * n_layer) {
            char tw[16];
            wire_bound_format(tw, sizeof tw, want);
            snprintf(err, errlen, "chain refused: prefill node %s serves layers %s, but the chain needs layer %s "
                     "next of this %d-layer model", handoff_peer(cs[i]), tn, tw, n_layer);
            return -1;
        }
        want = hi;
        x->nd[i] = (chain_node){ .c = cs[i], .lo = wire_layers_kv(lo), .hi = wire_layers_kv(hi), .act_next = -1 };
        snprintf(x->nd[i].txt, sizeof x->nd[i].txt, "%s", tn);
    }
    if (want != 2 * n_layer) {
        char tw[16];
        wire_bound_format(tw, sizeof tw, want);
        snprintf(err, errlen, "chain refused: its slices end at layer %s, the model has %d layers", tw, n_layer);
        return -1;
    }
    x->n = spec->n;
    return 0;
}

static int chain_fail(chain_run *x, int i, uint32_t code, char *err, size_t errlen, const char *fmt, ...)
    __attribute__((format(printf, 6, 7)));
static int chain_fail(chain_run *x, int i, uint32_t code, char *err, size_t errlen, const char *fmt, ...) {
    char msg[400];
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(msg, sizeof msg, fmt, ap);
    va_end(ap);
    snprintf(err, errlen, "chain node %d of %d, prefill node %s (layers %s): %s", i + 1, x->n,
             handoff_peer(x->nd[i].c), x->nd[i].txt, msg);
    x->fail_code = code;
    snprintf(x->failed_node, sizeof x->failed_node, "%s", handoff_peer(x->nd[i].c));
    return -1;
}

/* One KV frame of node i: its layers, its order, stored in the cache. */
static int chain_kv(chain_run *x, int i, const wire_kv *kv, kvcache *cache, char *err, size_t errlen) {
    chain_node *nd = &x->nd[i];
    int dim = kv_dim(cache);
    if (kv->dtype != x->wire_dtype || kv->row_bytes != gguf_row_bytes(kv->dtype, (uint64_t)dim))
        return chain_fail(x, i, WERR_DTYPE, err, errlen, "KV rows of type %s, %u bytes; expected %s", gguf_type_name(kv->dtype),
                          kv->row_bytes, gguf_type_name(x->wire_dtype));
    if (kv->pos0 < (uint32_t)x->start || (uint64_t)kv->pos0 + kv->n > (uint64_t)x->end)
        return chain_fail(x, i, WERR_RANGE, err, errlen, "positions %u..%llu outside the requested span %d..%d", kv->pos0,
                          (unsigned long long)kv->pos0 + kv->n, x->start, x->end);
    int want_p0 = nd->layer ? nd->chunk_p0 : nd->next;
    if ((int)kv->layer != nd->lo + nd->layer || (int)kv->pos0 != want_p0 || (nd->layer && (int)kv->n != nd->chunk_n))
        return chain_fail(x, i, WERR_PROTOCOL, err, errlen, "frame out of order: expected layer %d of chunk %d, got layer %u of %u..%u",
                          nd->lo + nd->layer, want_p0, kv->layer, kv->pos0, kv->pos0 + kv->n);
    char e2[256];
    int rc;
    if (kv->dtype == kv_dtype(cache)) {
        rc = kv_write_span(cache, (int)kv->layer, (int)kv->pos0, (int)kv->n, kv->k, kv->v, e2, sizeof e2);
    } else {
        size_t half = (size_t)kv->n * kv_row_bytes(cache);
        rc = kv_check_range(cache, (int)kv->layer, (int)kv->pos0, (int)kv->n, e2, sizeof e2);
        if (!rc && 2 * half > x->conv_cap) {
            uint8_t *p = realloc(x->conv, 2 * half);
            if (!p) { snprintf(e2, sizeof e2, "out of memory"); rc = -1; }
            else { x->conv = p; x->conv_cap = 2 * half; }
        }
        if (!rc && !x->tmp && !(x->tmp = malloc(sizeof(float) * (size_t)dim))) { snprintf(e2, sizeof e2, "out of memory"); rc = -1; }
        if (!rc) {
            handoff_convert_rows(kv->dtype, kv->k, kv_dtype(cache), x->conv, (int)kv->n, dim, x->tmp);
            handoff_convert_rows(kv->dtype, kv->v, kv_dtype(cache), x->conv + half, (int)kv->n, dim, x->tmp);
            rc = kv_write_span(cache, (int)kv->layer, (int)kv->pos0, (int)kv->n, x->conv, x->conv + half, e2, sizeof e2);
        }
    }
    if (rc) return chain_fail(x, i, WERR_INTERNAL, err, errlen, "cannot store KV: %s", e2);
    x->got[kv->layer] += (int)kv->n;
    x->kv_bytes += 2ull * kv->n * kv->row_bytes;
    if (nd->layer == 0) { nd->chunk_p0 = (int)kv->pos0; nd->chunk_n = (int)kv->n; }
    if (nd->lo + ++nd->layer == nd->hi) { nd->next = nd->chunk_p0 + nd->chunk_n; nd->layer = 0; }
    return 0;
}

/* Node i's hidden states, checked and relayed to node i + 1. */
static int chain_act(chain_run *x, int i, const uint8_t *p, size_t n, int dim, uint32_t send_flags,
                     char *err, size_t errlen) {
    wire_act a;
    char e2[300];
    if (i + 1 >= x->n) return chain_fail(x, i, WERR_PROTOCOL, err, errlen, "sent hidden states but ends the model");
    if (wire_decode_act(p, n, &a, e2, sizeof e2)) return chain_fail(x, i, WERR_PROTOCOL, err, errlen, "malformed ACT frame: %s", e2);
    chain_node *nd = &x->nd[i];
    if ((int)a.dim != dim || a.dtype != x->act_dtype)
        return chain_fail(x, i, WERR_PROTOCOL, err, errlen, "ACT rows of %u x %s, expected %d x %s", a.dim,
                          gguf_type_name(a.dtype), dim, gguf_type_name(x->act_dtype));
    if ((nd->act_next >= 0 && (int)a.pos0 != nd->act_next) || (uint64_t)a.pos0 + a.n > (uint64_t)x->end)
        return chain_fail(x, i, WERR_RANGE, err, errlen, "ACT positions %u..%llu out of order or beyond %d", a.pos0,
                          (unsigned long long)a.pos0 + a.n, x->end);
    nd->act_next = (int)(a.pos0 + a.n);
    chain_node *to = &x->nd[i + 1];
    /* a next node that held the whole span already finished without them */
    if (to->done) return 0;
    double t = gen_now_ms();
    if (wire_send(handoff_conn(to->c), WIRE_ACT, to->req, send_flags, p, n, e2, sizeof e2))
        return chain_fail(x, i + 1, 0, err, errlen, "relaying hidden states failed: %s", e2);
    t = gen_now_ms() - t;
    nd->relay_ms += t;
    if (t > nd->relay_max_ms) nd->relay_max_ms = t;
    nd->relay_frames++;
    nd->relay_bytes += n;
    return 0;
}

/* One frame from node i: 1 = its DONE, 0 = more, -1 = failed. */
static int chain_frame(chain_run *x, int i, kvcache *cache, char *err, size_t errlen) {
    chain_node *nd = &x->nd[i];
    wire_conn *c = handoff_conn(nd->c);
    wire_header h;
    char e2[512];
    if (wire_recv(c, &h, e2, sizeof e2))
        return chain_fail(x, i, c->rx_err, err, errlen, "%s (%d of %d positions complete)", e2, nd->next - x->start,
                          x->end - x->start);
    const uint8_t *p = c->rx.data;
    size_t n = c->rx.len;
    if (h.type == WIRE_PING) return wire_send(c, WIRE_PONG, h.req_id, 0, p, n, e2, sizeof e2) ? chain_fail(x, i, 0, err, errlen, "%s", e2) : 0;
    if (h.type == WIRE_PONG) return 0;
    if (h.type == WIRE_ERROR) {
        wire_error we = { 0 };
        if (wire_decode_error(p, n, &we, e2, sizeof e2)) snprintf(we.message, sizeof we.message, "(undecodable)");
        chain_fail(x, i, 0, err, errlen, "reported an error (code %u): %s", we.code, we.message);
        x->fail_code = UINT32_MAX;   /* it ended the request itself: nothing to tell it */
        return -1;
    }
    if (h.req_id != nd->req)
        return chain_fail(x, i, WERR_PROTOCOL, err, errlen, "frame for request %llu during request %llu",
                          (unsigned long long)h.req_id, (unsigned long long)nd->req);
    if (h.type == WIRE_KV) {
        wire_kv kv;
        if (wire_decode_kv(p, n, &kv, e2, sizeof e2)) return chain_fail(x, i, WERR_PROTOCOL, err, errlen, "malformed KV frame: %s", e2);
        if ((int)kv.layer < nd->lo || (int)kv.layer >= nd->hi)
            return chain_fail(x, i, WERR_RANGE, err, errlen, "sent KV for layer %u, outside its slice", kv.layer);
        return chain_kv(x, i, &kv, cache, err, errlen);
    }
    if (h.type == WIRE_ACT) return chain_act(x, i, p, n, x->n_embd, h.flags & WIRE_FLAG_ZSTD ? WIRE_FLAG_ZSTD : 0, err, errlen);
    if (h.type == WIRE_DONE) {
        if (wire_decode_done(p, n, &nd->d, e2, sizeof e2)) return chain_fail(x, i, WERR_PROTOCOL, err, errlen, "malformed DONE: %s", e2);
        if (nd->next != x->end || nd->layer != 0 || nd->d.n_positions != (uint32_t)(x->end - x->start))
            return chain_fail(x, i, WERR_PROTOCOL, err, errlen, "finished early: %d of %d positions received",
                              nd->next - x->start, x->end - x->start);
        nd->done = 1;
        return 1;
    }
    return chain_fail(x, i, WERR_PROTOCOL, err, errlen, "unexpected %s frame", wire_type_name(h.type));
}

/* Waits for frames from every node not done until all are, the deadline
 * passes, or one fails; a node silent for its per-frame timeout fails. */
static int chain_loop(chain_run *x, kvcache *cache, double deadline, int timeout_ms, char *err, size_t errlen) {
    double last[CHAIN_SPEC_MAX];
    double now = gen_now_ms();
    for (int i = 0; i < x->n; i++) last[i] = now;
    for (int left = x->n; left > 0;) {
        struct pollfd pf[CHAIN_SPEC_MAX];
        int who[CHAIN_SPEC_MAX], np = 0;
        for (int i = 0; i < x->n; i++)
            if (!x->nd[i].done) { pf[np] = (struct pollfd){ .fd = handoff_conn(x->nd[i].c)->fd, .events = POLLIN }; who[np++] = i; }
        if (handoff_poll_abandoned(x->nd[0].c)) { snprintf(err, errlen, "chain prefill cancelled: the request was abandoned"); x->fail_code = 0; return -1; }
        now = gen_now_ms();
        if (now >= deadline) {
            snprintf(err, errlen, "the chain did not finish within the handoff deadline");
            x->fail_code = WERR_TIMEOUT;
            return -1;
        }
        for (int k = 0; k < np; k++)
            if (now - last[who[k]] >= timeout_ms)
                return chain_fail(x, who[k], WERR_TIMEOUT, err, errlen, "timed out: no frame for %d ms (%d of %d positions complete)",
                                  timeout_ms, x->nd[who[k]].next - x->start, x->end - x->start);
        int r = poll(pf, (nfds_t)np, 100);   /* a tick: the abandon flag and the timeouts are looked at between */
        if (r < 0 && errno != EINTR) { snprintf(err, errlen, "poll: %s", strerror(errno)); return -1; }
        for (int k = 0; k < np && r > 0; k++) {
            if (!(pf[k].revents & (POLLIN | POLLHUP | POLLERR))) continue;
            int i = who[k];
            last[i] = gen_now_ms();
            if (!x->nd[i].t_first) x->nd[i].t_first = last[i] - x->t0;
            int rc = chain_frame(x, i, cache, err, errlen);
            double t1 = gen_now_ms();
            x->nd[i].busy_ms += t1 - last[i];
            if (rc == 1) x->nd[i].t_done = t1 - x->t0;
            if (rc < 0) return -1;
            if (rc == 1) left--;
        }
    }
    return 0;
}

/* Where a chain prefill's time went, one line per node: when its first
 * frame and its DONE came, the decode side's time on its frames, and the
 * relay of its hidden states to the next node. */
static void chain_log_run(const chain_run *x, const handoff_stats *st) {
    log_info(NULL, "chain prefill: %d positions over %d nodes in %.1f ms, KV %llu bytes", st->n_sent, x->n, st->total_ms,
             (unsigned long long)st->kv_bytes);
    for (int i = 0; i < x->n; i++) {
        const chain_node *nd = &x->nd[i];
        log_info(NULL, "chain node %d (layers %s): first frame %.1f ms, done %.1f ms (its compute %.1f ms), "
                 "frames read in %.1f ms, hidden states relayed %d frames %llu bytes in %.1f ms (max %.1f ms)",
                 i + 1, nd->txt, nd->t_first, nd->t_done, nd->d.prefill_ms, nd->busy_ms, nd->relay_frames,
                 (unsigned long long)nd->relay_bytes, nd->relay_ms, nd->relay_max_ms);
    }
}

static void chain_end_all(chain_run *x, const char *why) {
    for (int i = 0; i < x->n; i++) {
        chain_node *nd = &x->nd[i];
        if (!nd->c || !nd->req || handoff_is_broken(nd->c)) continue;
        uint32_t code = x->fail_code == UINT32_MAX ? 0 : (!strncmp(x->failed_node, handoff_peer(nd->c), sizeof x->failed_node) ? x->fail_code : 0);
        handoff_abort(nd->c, nd->req, code, why);
    }
}

int chain_prefill(handoff_client **cs, const chain_spec *spec, const chain_opts *o, session *s,
                  const int32_t *tokens, int n_tok, int start_pos, handoff_stats *st, char *err, size_t errlen) {
    memset(st, 0, sizeof *st);
    st->start_pos = start_pos;
    kvcache *cache = session_kv(s);
    chain_run *x = calloc(1, sizeof *x);
    if (!x) { snprintf(err, errlen, "out of memory"); return -1; }
    x->n_layer = kv_n_layer(cache);
    x->n_embd = model_get_hparams(session_model(s))->n_embd;
    x->start = start_pos;
    x->end = n_tok - 1;
    x->act_dtype = o && o->act_dtype ? o->act_dtype : GGML_TYPE_F32;
    int rc = -1;
    if (chain_check_slices(cs, spec, x->n_layer, x, err, errlen)) goto out;
    x->wire_dtype = handoff_wire_dtype(cs[0]);
    for (int i = 1; i < x->n; i++)
        if (handoff_wire_dtype(cs[i]) != x->wire_dtype) { snprintf(err, errlen, "chain nodes disagree on the KV wire type"); goto out; }
    if (start_pos < 0 || start_pos > session_pos(s) || n_tok < 1) {
        snprintf(err, errlen, "bad chain span: start %d, %d tokens, session holds %d", start_pos, n_tok, session_pos(s));
        goto out;
    }
    session_reset(s, start_pos);
    if (x->end <= start_pos) { rc = 0; goto out; }
    if (kv_check_range(cache, 0, 0, n_tok, err, errlen)) goto out;
    if (!(x->got = calloc((size_t)x->n_layer, sizeof *x->got))) { snprintf(err, errlen, "out of memory"); goto out; }
    double t0 = x->t0 = gen_now_ms();
    int timeout_ms = handoff_timeout_ms(cs[0]);
    double deadline = t0 + handoff_deadline_for(cs[0], x->end - start_pos);
    for (int i = 0; i < x->n; i++) {
        x->nd[i].in0 = handoff_conn(cs[i])->bytes_in;
        x->nd[i].next = start_pos;
        /* later nodes first: each is waiting for hidden states when node 1 starts */
    }
    for (int i = x->n - 1; i >= 0; i--) {
        x->nd[i].req = handoff_send_request(cs[i], tokens, n_tok, start_pos, x->end, chain_act_flags(x->act_dtype), err, errlen);
        if (!x->nd[i].req) { x->fail_code = UINT32_MAX; goto fail; }
    }
    if (chain_loop(x, cache, deadline, timeout_ms, err, errlen)) goto fail;
    for (int l = 0; l < x->n_layer; l++)
        if (x->got[l] != x->end - x->start) {
            snprintf(err, errlen, "chain merge: layer %d has %d of %d positions", l, x->got[l], x->end - x->start);
            goto fail;
        }
    kv_set_used(cache, x->end);
    st->total_ms = gen_now_ms() - t0;
    st->n_sent = x->end - start_pos;
    for (int i = 0; i < x->n; i++) {
        const wire_done *d = &x->nd[i].d;
        if ((int)d->n_computed > st->n_computed_remote) st->n_computed_remote = (int)d->n_computed;
        st->wire_bytes += handoff_conn(cs[i])->bytes_in - x->nd[i].in0;
    }
    /* A chain's compute time is its pipeline's, end to end (each node's own
     * figure leaves out its waits for hidden states): the rate a router
     * learns from it (computed / prefill_ms) is the chain's measured rate. */
    st->prefill_ms_remote = st->total_ms;
    st->transfer_tail_ms = 0.0;
    st->kv_bytes = x->kv_bytes;
    chain_log_run(x, st);
    rc = 0;
    goto out;
fail:
    chain_end_all(x, err);
    session_reset(s, start_pos);
out:
    free(x->got);
    free(x->conv);
    free(x->tmp);
    free(x);
    return rc;
}

/* ==== Connection sets ==== */

/* Idle connection sets kept per spec: a chain's nodes keep their sessions
 * (their prefix caches) between requests as long as they are used together. */
#define CHAIN_POOL_SETS 8

typedef struct {
    char spec[256];
    chain_spec sp;
    handoff_client *c[CHAIN_SPEC_MAX];
    int in_use;
    uint64_t last_used;
} chain_set;

struct chain_pool {
    pthread_mutex_t mu;
    chain_set sets[CHAIN_POOL_SETS];
    uint64_t tick;
};

chain_pool *chain_pool_new(void) {
    chain_pool *p = calloc(1, sizeof *p);
    if (p) pthread_mutex_init(&p->mu, NULL);
    return p;
}

static void chain_set_close(chain_set *cs) {
    for (int i = 0; i < CHAIN_SPEC_MAX; i++) { handoff_close(cs->c[i]); cs->c[i] = NULL; }
}

void chain_pool_free(chain_pool *p) {
    if (!p) return;
    for (int i = 0; i < CHAIN_POOL_SETS; i++) chain_set_close(&p->sets[i]);
    pthread_mutex_destroy(&p->mu);
    free(p);
}

static chain_set *chain_pool_take(chain_pool *p, const char *spec) {
    chain_set *s = NULL, *empty = NULL, *lru = NULL;
    pthread_mutex_lock(&p->mu);
    for (int i = 0; i < CHAIN_POOL_SETS && !s; i++) {
        chain_set *q = &p->sets[i];
        if (q->in_use) continue;
        if (q->spec[0] && !strcmp(q->spec, spec)) s = q;
        else if (!q->spec[0]) { if (!empty) empty = q; }
        else if (!lru || q->last_used < lru->last_used) lru = q;
    }
    if (!s && (s = empty ? empty : lru)) {
        chain_set_close(s);
        memset(s, 0, sizeof *s);
        snprintf(s->spec, sizeof s->spec, "%s", spec);
    }
    if (s) { s->in_use = 1; s->last_used = ++p->tick; }
    pthread_mutex_unlock(&p->mu);
    return s;
}

int chain_pool_prefill(chain_pool *p, const char *spec, model *m, uint32_t kv_dtype, const handoff_opts *ho,
                       const chain_opts *co, uint32_t log_id, session *s, const int32_t *tokens, int n_tok,
                       int start_pos, handoff_stats *st, char *err, size_t errlen) {
    chain_spec sp;
    if (chain_spec_parse(spec, &sp, err, errlen)) return -1;
    chain_set *cs = chain_pool_take(p, spec);
    if (!cs) { snprintf(err, errlen, "every chain connection set is in use"); return -1; }
    cs->sp = sp;
    int rc = -1;
    /* A reused set may hold a connection the node has dropped, or nodes
     * whose sessions disagree after a failure: one more try, all fresh. */
    for (int attempt = 0; attempt < 2 && rc; attempt++) {
        int reused = 0;
        for (int i = 0; i < sp.n; i++) {
            if (cs->c[i]) { reused = 1; continue; }
            if (handoff_connect(&cs->c[i], sp.addr[i], m, kv_dtype, ho, err, errlen)) { cs->c[i] = NULL; goto out; }
        }
        for (int i = 0; i < sp.n; i++) handoff_set_log_id(cs->c[i], log_id);
        rc = chain_prefill(cs->c, &sp, co, s, tokens, n_tok, start_pos, st, err, errlen);
        if (rc) { chain_set_close(cs); session_reset(s, start_pos); }
        if (!reused || strstr(err, "chain refused")) break;
    }
out:
    if (rc) chain_set_close(cs);
    pthread_mutex_lock(&p->mu);
    cs->in_use = 0;
    pthread_mutex_unlock(&p->mu);
    return rc;
}

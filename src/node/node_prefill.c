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
 *
 * This file starts the node (metrics listener, calibration, draft server),
 * runs the accept loop and counts what requests did; a connection is in
 * node_prefill_conn.c, a request in node_prefill_job.c, the KV streaming in
 * node_prefill_stream.c (node_prefill_internal.h between them).
 */

#include <errno.h>
#include <pthread.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <time.h>
#include <unistd.h>

#include "base/log.h"
#include "net/prefill_rate.h"

#include "node/node_prefill_internal.h"

/* A request's id in the log (log.h): the low half of its wire id, where
 * tandem's decode node puts the router's request id. */
void pn_rid(uint64_t req, char *out) { log_id_format((uint32_t)req, out); }

/* The hard stop: the drain is over (prefill_node_run). */
int pn_stopped(const pnode *n) { return n->cut; }

void pn_sleep_ms(int ms) {
    struct timespec ts = { ms / 1000, (long)(ms % 1000) * 1000000L };
    while (nanosleep(&ts, &ts) && errno == EINTR) {}
}

void pn_send_error(wire_conn *c, uint64_t req, uint32_t code, const char *fmt, ...) {
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

void pn_metrics_outcome(pnode *node, const char *outcome) {
    metrics_add(node->mt.requests, (const char *[]){node->mt.model, outcome}, 1);
}

const char *pn_outcome(const pn_req *r, int rc, int keep) {
    if (rc == 0 && !r->failed) return keep ? "ok" : "error";
    if (r->cancelled || r->stopping) return "cancelled";
    if (r->too_big) return "error";
    if (r->expired) return "timeout";
    if (r->failed || r->peer_gone) return "peer_gone";
    return "error";
}

/* A request that ran: when it succeeded, its figures; then its outcome
 * (last, so a scrape that sees the count sees the rest). */
void pn_metrics_request(pnode *node, const pn_req *r, const char *outcome, int computed, double compute_ms,
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
    if (oo.request_ms < 0) oo.request_ms = 0;   /* 0: each request's limit grows with it (net/deadline.h) */
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
    if (model_get_layers(m, NULL, NULL)) {   /* a slice names its layers (chain.h reads them) */
        char lt[32];
        model_get_halves(m, &lo, &hi);
        wire_layers_format(lt, sizeof lt, lo, hi);
        snprintf(node.base_desc, sizeof node.base_desc, "%.220s; layers %.16s", node.hello.model_desc, lt);
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

/* node_decode.c - the decode node's HTTP server (see node_decode.h; its command
 * line is node_decode_cli.c).
 *
 * Threading: libmicrohttpd runs one thread per connection. Requests are
 * parsed and tokenized on their own thread, then wait for the generation
 * slot (one generation at a time: the model's scratch and thread pool are
 * shared). Whoever holds the slot owns the sessions, the prefill-node
 * connections and the logits buffer. A streamed response keeps the slot
 * until MHD destroys the response (end of stream or client gone): the
 * content reader produces one token per call, so a client that disconnects
 * stops its generation at the next token.
 *
 * This file starts, listens and runs the node and lends its prefill-node
 * connections; the rest of the node is in node_decode_request.c,
 * node_decode_job.c, node_decode_http.c and node_decode_stats.c (what each
 * owns: node_decode_internal.h).
 */

#include "node/node_decode.h"

#include <errno.h>
#include <netdb.h>
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <time.h>
#include <unistd.h>

#include <jansson.h>

#include "engine/fingerprint.h"
#include "node/node_drain.h"
#include "base/prefix_hash.h"
#include "base/platform.h"
#include "net/prefill_rate.h"
#include "base/unicode.h"

#include "node/node_decode_internal.h"

/* ==== Small helpers ==== */

/* A JSON string of arbitrary bytes: invalid UTF-8 becomes U+FFFD (a token
 * can end in the middle of a character; JSON cannot carry raw bytes). */
json_t *dn_json_text(const char *s, size_t n) {
    json_t *j = json_stringn(s, n);
    if (j) return j;
    strbuf t = { 0 };
    for (size_t i = 0; i < n;) {
        uint32_t cp;
        size_t l = unicode_strict_seq((const unsigned char *)s + i, n - i, &cp);
        if (l) { strbuf_put(&t, s + i, l); i += l; }
        else { strbuf_put(&t, "\xEF\xBF\xBD", 3); i++; }
    }
    j = json_stringn(t.p ? t.p : "", t.len);
    free(t.p);
    return j;
}

/* ==== Prefill-node connections ==== */

/* Lends a connection to addr: an idle one if there is one, else a new
 * entry (an unused one, else the least recently used idle one). NULL when
 * every entry is lent. */
dn_peer *dn_peer_take(dnode *n, const char *addr, const prefix_held *want) {
    dn_peer *p = NULL, *empty = NULL, *lru = NULL;
    int best = -1;
    pthread_mutex_lock(&n->pmu);
    for (int i = 0; i < DN_MAX_PEERS; i++) {
        dn_peer *q = &n->peers[i];
        if (q->in_use) continue;
        /* of the idle connections to addr, the one whose session holds the
         * most of this prompt: the prefill node computes only past it */
        if (q->addr[0] && q->c && !strcmp(q->addr, addr)) {
            int m = prefix_held_match(&q->held, want->h, want->n);
            if (m > best) { best = m; p = q; }
        }
        else if (!q->addr[0]) { if (!empty) empty = q; }
        else if (!lru || q->last_used < lru->last_used) lru = q;
    }
    if (!p && (p = empty ? empty : lru)) {
        handoff_close(p->c);
        prefix_held_clear(&p->held);
        memset(p, 0, sizeof *p);
        snprintf(p->addr, sizeof p->addr, "%s", addr);
    }
    if (p) { p->in_use = 1; p->last_used = ++n->tick; }
    pthread_mutex_unlock(&n->pmu);
    return p;
}

/* held: what the connection's session holds now (taken; empty when the
 * connection was given up). */
void dn_peer_give(dnode *n, dn_peer *p, prefix_held *held) {
    pthread_mutex_lock(&n->pmu);
    prefix_held_clear(&p->held);
    p->held = p->c ? *held : (prefix_held){0};
    if (!p->c) prefix_held_clear(held);
    p->in_use = 0;
    pthread_mutex_unlock(&n->pmu);
}

static void dn_peers_close(dnode *n) {
    for (int i = 0; i < DN_MAX_PEERS; i++) {
        handoff_close(n->peers[i].c);
        n->peers[i].c = NULL;
        prefix_held_clear(&n->peers[i].held);
    }
}

/* GET /v1/stats "prefix": the slots' prefixes, the KV store's and each
 * prefill-node connection's (prefix_report.h). */
json_t *dn_prefix_json(dnode *n) {
    prefix_report *r = prefix_report_new(n->prefix_seed);
    uint64_t *h = malloc(sizeof *h * PREFIX_REPORT_MAX);
    if (r && h) prefix_report_add(r, "slots", h, sched_prefix_hashes(n->sc, n->prefix_seed, h, PREFIX_REPORT_MAX));
    /* the KV store's tiers (memory first, then disk), keyed with the same seed */
    if (r && h && n->store) prefix_report_add(r, "store", h, kvstore_list_hashes(n->store, h, PREFIX_REPORT_MAX));
    pthread_mutex_lock(&n->pmu);
    for (int i = 0; r && i < DN_MAX_PEERS; i++)
        if (n->peers[i].c) prefix_report_add_peer(r, n->peers[i].addr, n->peers[i].held.h, n->peers[i].held.n);
    pthread_mutex_unlock(&n->pmu);
    json_t *o = prefix_report_json(r);
    prefix_report_free(r);
    free(h);
    return o;
}

/* ==== Listening ==== */

/* Splits "host:port" ("[v6]:port", ":port", "port"); host defaults to 127.0.0.1. */
static int dn_split_hostport(const char *hp, char *host, size_t hl, char *port, size_t pl) {
    const char *colon = strrchr(hp, ':');
    const char *h = hp, *p = colon ? colon + 1 : hp;
    size_t n = colon ? (size_t)(colon - hp) : 0;
    if (n >= 2 && h[0] == '[' && h[n - 1] == ']') { h++; n -= 2; }
    if (n >= hl || strlen(p) >= pl || !*p) return -1;
    if (n == 0) snprintf(host, hl, "127.0.0.1");
    else { memcpy(host, h, n); host[n] = 0; }
    snprintf(port, pl, "%s", p);
    return 0;
}

static int dn_listen(const char *hp, int *port_out, int *family, char *err, size_t errlen) {
    char host[256], port[32];
    if (dn_split_hostport(hp, host, sizeof host, port, sizeof port)) {
        snprintf(err, errlen, "bad listen address '%s' (want host:port)", hp);
        return -1;
    }
    struct addrinfo hints = { .ai_family = AF_UNSPEC, .ai_socktype = SOCK_STREAM, .ai_flags = AI_PASSIVE }, *ai = NULL;
    int g = getaddrinfo(host, port, &hints, &ai);
    if (g) { snprintf(err, errlen, "cannot resolve %s: %s", hp, gai_strerror(g)); return -1; }
    int fd = -1;
    for (struct addrinfo *a = ai; a; a = a->ai_next) {
        fd = plat_socket(a->ai_family, a->ai_socktype, a->ai_protocol, 0);
        if (fd < 0) continue;
        int one = 1;
        setsockopt(fd, SOL_SOCKET, SO_REUSEADDR, &one, sizeof one);
        if (!bind(fd, a->ai_addr, a->ai_addrlen) && !listen(fd, 64)) { *family = a->ai_family; break; }
        snprintf(err, errlen, "cannot listen on %s: %s", hp, strerror(errno));
        close(fd);
        fd = -1;
    }
    freeaddrinfo(ai);
    if (fd < 0) return -1;
    struct sockaddr_storage ss;
    socklen_t sl = sizeof ss;
    getsockname(fd, (struct sockaddr *)&ss, &sl);
    *port_out = ss.ss_family == AF_INET6 ? ntohs(((struct sockaddr_in6 *)&ss)->sin6_port)
                                         : ntohs(((struct sockaddr_in *)&ss)->sin_port);
    return fd;
}

/* Written to a temporary name and renamed, so a reader never sees half a number. */
static int dn_write_port_file(const char *path, int port, char *err, size_t errlen) {
    char tmp[4096];
    snprintf(tmp, sizeof tmp, "%s.tmp%d", path, (int)getpid());
    FILE *f = fopen(tmp, "w");
    if (!f || fprintf(f, "%d\n", port) < 0 || fclose(f) || rename(tmp, path)) {
        snprintf(err, errlen, "cannot write port file %s: %s", path, strerror(errno));
        if (f) unlink(tmp);
        return -1;
    }
    return 0;
}

/* ==== Run ==== */

/* Default slot count: what half of the available memory holds of full
 * caches, at most DN_MAX_DEFAULT_SLOTS (a 2-core CPU gains little beyond
 * that) and at least 1. */
static int dn_default_slots(model *m, int n_ctx, uint32_t kv_dtype) {
    const model_hparams *hp = model_get_hparams(m);
    uint64_t row = gguf_row_bytes(kv_dtype, (uint64_t)hp->n_head_kv * (uint64_t)hp->head_dim_k);
    uint64_t per_slot = 2 * row * (uint64_t)hp->n_layer * (uint64_t)n_ctx;
    uint64_t avail = plat_mem_available();
    if (avail == 0 || per_slot == 0) return 4;
    uint64_t fit = avail / 2 / per_slot;
    return fit < 1 ? 1 : fit > DN_MAX_DEFAULT_SLOTS ? DN_MAX_DEFAULT_SLOTS : (int)fit;
}

/* HTTP limits (httpd.h): the router keeps at most the slots' and the
 * queue's worth of requests plus probes on one node, so that much is
 * reserved for trusted peers (the router, once a signed request came from
 * its address); four such clients and spare room for /health make the
 * total. Strangers share the rest: one address a sixteenth of it (at
 * least 4), one /24 or /64 block a quarter, so 100 addresses or 4 blocks
 * are needed to fill it, and then the slowest go first. */
#define DN_STRANGER_IP_DIV 16
#define DN_STRANGER_BLOCK_DIV 4
static httpd_limits dn_http_limits(const dnode *n) {
    const decode_node_opts *o = n->o;
    httpd_limits l = { .idle_timeout_s = 300 };
    unsigned router = (unsigned)(n->queue_max + n->n_slots + 32);
    l.max_conns = (unsigned)(o->max_conns > 0 ? o->max_conns : 4 * (int)router + 64);
    l.reserved_conns = n->auth ? (router < l.max_conns / 2 ? router : l.max_conns / 2) : 0;
    unsigned strangers = l.max_conns - l.reserved_conns, ip = strangers / DN_STRANGER_IP_DIV;
    l.max_conns_per_ip = (unsigned)(o->max_conns_per_ip > 0 ? (unsigned)o->max_conns_per_ip : ip < 4 ? 4 : ip);
    l.max_conns_per_block = strangers / DN_STRANGER_BLOCK_DIV;
    l.request_deadline_ms = o->request_deadline_ms > 0 ? o->request_deadline_ms : 10000;
    return l;
}

static int dn_init(dnode *n, model *m, const decode_node_opts *o, char *err, size_t errlen) {
    const model_hparams *hp = model_get_hparams(m);
    n->m = m;
    n->o = o;
    n->tok = model_get_tokenizer(m);
    n->n_vocab = hp->n_vocab;
    n->n_ctx = o->n_ctx > 0 ? o->n_ctx : (hp->n_ctx_train > 0 && hp->n_ctx_train < 4096 ? hp->n_ctx_train : 4096);
    n->n_slots = o->n_sessions > 0 ? o->n_sessions : dn_default_slots(m, n->n_ctx, o->kv_dtype ? o->kv_dtype : GGML_TYPE_F16);
    n->queue_max = o->queue_max > 0 ? o->queue_max : 16;
    n->min_split = o->min_split_tokens > 0 ? o->min_split_tokens : 32;
    n->timeout_ms = o->timeout_ms > 0 ? o->timeout_ms : 10000;
    n->kv_dtype = o->kv_dtype ? o->kv_dtype : GGML_TYPE_F16;
    n->wire_dtype = o->wire_dtype ? o->wire_dtype : n->kv_dtype;
    uint8_t fp[32];
    char fpe[256];
    /* without a fingerprint the node reports no prefixes (the router then
     * routes it by capacity alone); handoffs would fail on it anyway */
    if (model_fingerprint(m, fp, fpe, sizeof fpe)) log_warn(NULL, "no prefix report: %s", fpe);
    else { n->prefix_seed = prefix_hash_seed(fp); n->prefix_ok = 1; }
    n->role = o->local_only ? "local" : "decode";
    const char *path = o->model_path ? o->model_path : "model";
    const char *base = strrchr(path, '/');
    snprintf(n->desc, sizeof n->desc, "%s (%s, %d layers, n_embd %d, %s)", base ? base + 1 : path,
             hp->arch_name ? hp->arch_name : "?", hp->n_layer, hp->n_embd, model_type_summary(m));
    pthread_mutex_init(&n->pmu, NULL);
    n->chains = chain_pool_new();
    pthread_mutex_init(&n->smu, NULL);
    pthread_mutex_init(&n->gmu, NULL);
    pthread_mutex_init(&n->cmu, NULL);
    int share = o->client_share > 0 ? o->client_share : DN_DEFAULT_CLIENT_SHARE;
    int cap = share * (n->n_slots + n->queue_max) / 100;
    n->client_cap = share >= 100 ? 0 : cap < 1 ? 1 : cap;   /* 0: no share */
    if (dn_metrics_init(&n->mt, o, err, errlen)) return -1;
    n->auth = o->secret && o->secret_len;
    if (n->auth) {
        node_auth_derive(&n->key, o->secret, o->secret_len, NODE_AUTH_LABEL_DECODE_API);
        if (!(n->replay = node_auth_replay_new(0))) { snprintf(err, errlen, "out of memory"); return -1; }
    }
    return 0;
}

/* The local prefill rate GET /v1/stats reports before any request ran
 * (prefill_tps_local): one pass on the loaded model, before the scheduler
 * owns it. A failure only leaves the rate unknown until the first prompt. */
static void dn_calibrate(dnode *n) {
    char err[256];
    int k = n->n_ctx < PREFILL_RATE_CALIB_TOKENS ? n->n_ctx : PREFILL_RATE_CALIB_TOKENS;
    double tps = 0;
    if (prefill_rate_calibrate(n->m, k, n->kv_dtype, &tps, err, sizeof err)) {
        log_warn(NULL, "calibration failed (no prefill rate until the first prompt): %s", err);
        return;
    }
    n->st.prefill_tps_local = tps;
    log_info(NULL, "calibration: %d positions at %.0f t/s", k, tps);
}

/* Starts the scheduler (the node's generation slots). */
static int dn_start(dnode *n, char *err, size_t errlen) {
    const decode_node_opts *o = n->o;
    if (o->kv_cache_ram || o->kv_cache_dir) {
        kvstore_opts ko = { .ram_bytes = o->kv_cache_ram, .dir = o->kv_cache_dir, .disk_bytes = o->kv_cache_disk };
        if (kvstore_open(&n->store, n->m, n->kv_dtype, n->n_ctx, &ko, err, errlen) ||
            kvstore_metrics_init(&n->mt.store, n->mt.reg, "tandem_decode", err, errlen))
            return -1;
        log_info(NULL, "kv store: %llu bytes of memory%s%s", (unsigned long long)o->kv_cache_ram,
                 o->kv_cache_dir ? ", directory " : "", o->kv_cache_dir ? o->kv_cache_dir : "");
    }
    draft_opts dro = { .lookup = n->o->lookup, .dm = n->o->draft_model, .draft_max = n->o->draft_max,
                       .n_slots = n->n_slots, .n_ctx = n->n_ctx, .kv_dtype = n->kv_dtype, .fixed = n->o->draft_fixed,
                       .node = n->o->draft_node, .secret = n->o->secret, .secret_len = n->o->secret_len,
                       .node_id = n->o->node_id, .node_timeout_ms = n->o->draft_timeout_ms };
    if (draft_create(&n->draft, n->m, &dro, err, errlen)) return -1;
    sched_opts so = { .n_slots = n->n_slots, .queue_max = n->queue_max, .n_ctx = n->n_ctx,
                      .kv_dtype = n->kv_dtype, .prefill_budget = n->o->prefill_budget,
                      .min_reuse = DN_MIN_REUSE, .store = n->store, .draft = n->draft };
    return sched_create(&n->sc, n->m, &so, err, errlen);
}

static void dn_cleanup(dnode *n) {
    sched_destroy(n->sc);
    n->sc = NULL;
    kvstore_close(n->store);     /* after the scheduler: its last jobs put their blocks */
    n->store = NULL;
    draft_free(n->draft);
    n->draft = NULL;
    dn_peers_close(n);
    chain_pool_free(n->chains);
    n->chains = NULL;
    pthread_mutex_destroy(&n->pmu);
    pthread_mutex_destroy(&n->smu);
    pthread_mutex_destroy(&n->cmu);
    pthread_mutex_destroy(&n->gmu);
    grammar_vocab_free(n->gvocab);
    metrics_free(n->mt.reg);
    node_auth_replay_free(n->replay);
    node_auth_wipe(&n->key);
}

int decode_node_check_request(model *m, const decode_node_opts *o, const char *body, size_t len,
                              char *err, size_t errlen) {
    dnode n;
    memset(&n, 0, sizeof n);
    if (dn_init(&n, m, o, err, errlen)) { dn_cleanup(&n); return -1; }
    dn_req r;
    int rc = dn_parse_request(&n, body, len, &r, err, errlen);
    if (rc == 0) dn_req_free(&r);
    dn_cleanup(&n);
    return rc;
}

int decode_node_run(model *m, const decode_node_opts *o, char *err, size_t errlen) {
    static volatile int never = 0;
    volatile int *stop = o->stop ? o->stop : &never;
    decode_node_opts def = *o;
    if (def.max_body_bytes <= 0) def.max_body_bytes = 8 << 20;   /* a 4096-token id list is ~40 KB; text prompts similar */
    dnode n;
    memset(&n, 0, sizeof n);
    int rc = -1, port = 0, family = AF_INET, left = 0;
    if (dn_init(&n, m, &def, err, errlen)) { dn_cleanup(&n); return -1; }
    dn_calibrate(&n);
    if (dn_start(&n, err, errlen)) { dn_cleanup(&n); return -1; }
    int fd = dn_listen(o->listen ? o->listen : "127.0.0.1:8080", &port, &family, err, errlen);
    if (fd < 0) { dn_cleanup(&n); return -1; }
    (void)family;
    httpd *d = NULL;
    httpd_limits lim = dn_http_limits(&n);
    if (httpd_start(&d, &lim, fd, dn_on_request, &n, dn_on_completed, &n, err, errlen)) {
        dn_cleanup(&n);
        return -1;
    }
    log_info(NULL, "listening on %s (port %d), role %s, model %s, n_ctx %d, %d parallel slots, %d prefill node(s), "
             "drafts: %s; HTTP: %u connections (%u reserved for the router), %u per other address, %u per /24 or /64, "
             "%d ms to send a request",
             o->listen ? o->listen : "127.0.0.1:8080", port, n.role, n.desc, n.n_ctx, n.n_slots, o->n_prefill_nodes,
             draft_kind(n.draft),
             lim.max_conns, lim.reserved_conns, lim.max_conns_per_ip, lim.max_conns_per_block, lim.request_deadline_ms);
    if (!n.auth)
        log_warn(NULL, "no shared secret: POST /v1/generate is open to anyone who can connect "
                 "(give --secret-file so that only the router is served)");
    if (o->port_file && dn_write_port_file(o->port_file, port, err, errlen)) goto stop;
    if (o->port_out) *o->port_out = port;
    while (!*stop) {
        struct timespec ts = { 0, 50 * 1000000L };
        nanosleep(&ts, NULL);
    }
    log_info(NULL, "shutting down: draining (up to %d ms)", o->drain_timeout_ms);
    left = node_drain_http(d, o->reg, o->drain_timeout_ms);
    rc = 0;
stop:
    n.stopping = 1;
    sched_stop(n.sc);     /* ends running jobs: their streams finish with an error line */
    if (left > 0) httpd_wait_idle(d, NODE_DRAIN_GRACE_MS);   /* ... which gets written before the sockets close */
    httpd_stop(d);        /* joins every connection thread; closes the listening socket */
    dn_cleanup(&n);
    return rc;
}

/* router_nodes.c - the node table's health and picking: the split-or-local
 * cost model (router_decide), node selection, the health-check thread and
 * its probes, and the small HTTP GET/POST the probes and token counts use.
 *
 * The rule of every router file: the registry, the measured rates and the
 * metrics live under one mutex (router.mu); no lock is held across I/O.
 */
#include "router/router_chain.h"
#include "router/router_internal.h"
#include "router/router_nodes.h"
#include "router/router_cache.h"

/* ==== Cost model ==== */

void router_decide(const router_cost_in *in, router_decision *d) {
    memset(d, 0, sizeof *d);
    int n = in->n_prompt > 0 ? in->n_prompt : 1;
    const char *cnt = in->count_note && *in->count_note ? in->count_note : "tokenizer";
    double dtps = in->decode_prefill_tps > 0 ? in->decode_prefill_tps : 1;
    double ptps = in->prefill_prefill_tps > 0 ? in->prefill_prefill_tps : 1;
    /* held positions: the decode node computes and receives only past
     * cached_decode; the prefill node computes past its own cached_prefill
     * (it needs the rows before to attend to) and sends past cached_decode */
    int cd = in->cached_decode > 0 ? (in->cached_decode < n ? in->cached_decode : n - 1) : 0;
    int cp = in->cached_prefill > 0 ? (in->cached_prefill < n ? in->cached_prefill : n - 1) : 0;
    d->est_local_ms = (n - cd) / dtps * 1e3;
    double compute = (n - cp) / ptps * 1e3;
    double transfer = in->kv_bytes_per_token > 0 && in->link_bytes_per_s > 0
                    ? (n - cd) * in->kv_bytes_per_token / in->link_bytes_per_s * 1e3 : 0;
    /* Frames go out while later layers compute: only the part of the
     * transfer that outlasts the compute is exposed, plus the measured fixed
     * cost; requests queued on the prefill node are served before ours. */
    double exposed = (transfer > compute ? transfer - compute : 0) + in->handoff_overhead_ms;
    d->est_split_ms = compute * (1 + in->prefill_queue) + exposed;
    /* a decode node that holds the whole prompt computes its last position
     * and asks the prefill node for nothing (outcome "cached"): a split plan
     * costs it what the local one does, not the prefill node's queue */
    if (cd >= n - 1 && n > 1) d->est_split_ms = d->est_local_ms;
    if (in->policy == ROUTER_SPLIT_NEVER) {
        d->key = "policy";
        snprintf(d->reason, sizeof d->reason, "local: split policy is \"never\"");
        return;
    }
    if (!in->have_prefill && in->prefill_too_short) {
        d->key = "prefill_context";
        snprintf(d->reason, sizeof d->reason, "local: prompt %d tokens (%s) is longer than every healthy prefill "
                 "node's context", n, cnt);
        return;
    }
    if (!in->have_prefill) {
        d->key = "no_prefill_node";
        snprintf(d->reason, sizeof d->reason, "local: no healthy prefill node serves this model");
        return;
    }
    if (in->policy == ROUTER_SPLIT_ALWAYS) {
        d->split = 1;
        d->key = "policy";
        snprintf(d->reason, sizeof d->reason, "split: split policy is \"always\"");
        return;
    }
    if (n < in->min_split_tokens) {
        d->key = "short_prompt";
        snprintf(d->reason, sizeof d->reason, "local: prompt %d tokens (%s) < min_split_tokens %d", n, cnt,
                 in->min_split_tokens);
        return;
    }
    /* A busy decode node gains from giving its prefill away: prefer the
     * split on near-ties (within 10%) when requests wait on it. */
    double bias = in->decode_queue > 0 ? 1.1 : 1.0;
    d->key = "cost";
    d->split = d->est_split_ms < d->est_local_ms * bias;
    char held[64] = "";
    if (cd || cp) snprintf(held, sizeof held, ", held %d on decode / %d on prefill", cd, cp);
    snprintf(d->reason, sizeof d->reason,
             "%s: est split %.1f ms (prefill node %.0f t/s %s, queue %d, exposed %.1f ms) %s local %.1f ms "
             "(decode node %.0f t/s %s, queue %d); prompt %d tokens (%s)%s",
             d->split ? "split" : "local", d->est_split_ms, ptps, in->prefill_tps_assumed ? "assumed" : "measured",
             in->prefill_queue, exposed, d->split ? "<" : ">=", d->est_local_ms, dtps,
             in->decode_tps_assumed ? "assumed" : "measured", in->decode_queue, n, cnt, held);
}

/* ==== Node selection ==== */

/* Requests on a node, running and waiting: this router's own in-flight
 * count is exact and current; the node's report also covers other clients
 * but is up to one health interval old. */
int rt_node_load(const rt_node *n) {
    return n->inflight > n->queue_depth ? n->inflight : n->queue_depth;
}

int rt_node_slots(const rt_node *n) { return n->slots > 0 ? n->slots : 1; }

/* Free slots when positive; otherwise minus the length of its queue. */
static int rt_node_free(const rt_node *n) { return rt_node_slots(n) - rt_node_load(n); }

/* Every slot busy and the queue full. by_own: judged on this router's own
 * requests alone (certain) rather than on the node's last report. */
int rt_node_full(const rt_node *n, int by_own) {
    if (!n->queue_known) return 0;
    return (by_own ? n->inflight : rt_node_load(n)) >= rt_node_slots(n) + n->queue_max;
}

int rt_model_known(router *r, const char *model) {
    int found = 0;
    pthread_mutex_lock(&r->mu);
    for (int i = 0; i < r->n_nodes; i++)
        if (r->nodes[i].cfg.role == ROUTER_NODE_DECODE && !strcmp(r->nodes[i].cfg.model, model)) found = 1;
    pthread_mutex_unlock(&r->mu);
    return found;
}

/* Is node a a better pick than node b? Not full first, then the most free
 * slots (or, with none free, the shortest queue), then fewer requests so far. */
int rt_node_better(const rt_node *a, const rt_node *b) {
    int fa = rt_node_full(a, 0), fb = rt_node_full(b, 0);
    if (fa != fb) return fb;
    if (rt_node_free(a) != rt_node_free(b)) return rt_node_free(a) > rt_node_free(b);
    return a->requests < b->requests;
}

/* Best healthy node of a role for a model, skipping tried[]; -1 if none.
 * A node whose last report says full is still picked when nothing better
 * is left (the report may be stale; a full node answers 503 at once).
 * Caller holds mu. */
int rt_pick_locked(router *r, int role, const char *model, const int *tried) {
    int best = -1;
    for (int i = 0; i < r->n_nodes; i++) {
        rt_node *n = &r->nodes[i];
        if (n->cfg.role != role || !n->up || strcmp(n->cfg.model, model) || (tried && tried[i])) continue;
        if (best < 0 || rt_node_better(n, &r->nodes[best])) best = i;
    }
    return best;
}

/* ==== Health checks ==== */

const node_auth_key *rt_node_key(const router *r) {
    return r->have_secret ? &r->api_key : NULL;
}

/* A node's reply, bounded by what its endpoint can legitimately return
 * (cap): a health or stats reply is tiny (RT_REPLY_SMALL); a token endpoint's
 * reply is large (RT_REPLY_TOKENS). */
typedef struct {
    strbuf *b;
    size_t cap;
} rt_reply;

static size_t rt_sink(char *p, size_t sz, size_t nm, void *ud) {
    rt_reply *r = ud;
    size_t n = sz * nm;
    if (r->b->len + n > r->cap) return 0;
    return strbuf_put(r->b, p, n) ? 0 : n;
}

/* key (NULL: unsigned): signs method, path and body for a decode node
 * that authenticates (node_auth.h), as rt_up_open signs /v1/generate; the
 * node wants it on every endpoint that does work or reports more than a
 * liveness bit (/v1/tokenize, /v1/detokenize, /v1/stats). */
static struct curl_slist *rt_sign(struct curl_slist *hd, const node_auth_key *key, const char *method,
                                  const char *path, const char *body, size_t len) {
    if (!key || !hd) return hd;
    struct curl_slist *out = node_auth_curl_sign(hd, key, method, path, body ? body : "", len);
    if (!out) curl_slist_free_all(hd);
    return out;
}

/* err (NULL: not wanted): libcurl's reason when no reply came. */
long rt_http_get(const char *addr, const char *path, const node_auth_key *key, int timeout_ms, strbuf *out,
                        char *err, size_t errlen) {
    char url[256], cerr[CURL_ERROR_SIZE] = "";
    snprintf(url, sizeof url, "http://%s%s", addr, path);
    CURL *h = curl_easy_init();
    struct curl_slist *hd = key ? rt_sign(curl_slist_append(NULL, "Accept: application/json"), key, "GET", path, "", 0) : NULL;
    if (!h || (key && !hd)) {
        if (err) snprintf(err, errlen, "out of memory");
        if (h) curl_easy_cleanup(h);
        curl_slist_free_all(hd);
        return -1;
    }
    rt_reply rep = { out, RT_REPLY_SMALL };
    curl_easy_setopt(h, CURLOPT_ERRORBUFFER, cerr);
    curl_easy_setopt(h, CURLOPT_URL, url);
    if (hd) curl_easy_setopt(h, CURLOPT_HTTPHEADER, hd);
    curl_easy_setopt(h, CURLOPT_WRITEFUNCTION, rt_sink);
    curl_easy_setopt(h, CURLOPT_WRITEDATA, &rep);
    curl_easy_setopt(h, CURLOPT_NOSIGNAL, 1L);
    curl_easy_setopt(h, CURLOPT_TIMEOUT_MS, (long)timeout_ms);
    curl_easy_setopt(h, CURLOPT_PROXY, "");
    long code = -1;
    CURLcode rc = curl_easy_perform(h);
    if (rc == CURLE_OK) curl_easy_getinfo(h, CURLINFO_RESPONSE_CODE, &code);
    else if (err) snprintf(err, errlen, "%s", cerr[0] ? cerr : curl_easy_strerror(rc));
    curl_easy_cleanup(h);
    curl_slist_free_all(hd);
    return code;
}

long rt_http_post(const char *addr, const char *path, const char *body, size_t len, const node_auth_key *key,
                  size_t cap, int timeout_ms, strbuf *out) {
    char url[256];
    snprintf(url, sizeof url, "http://%s%s", addr, path);
    CURL *h = curl_easy_init();
    struct curl_slist *hd = rt_sign(curl_slist_append(NULL, "Content-Type: application/json"), key, "POST", path, body, len);
    rt_reply rep = { out, cap };
    long code = -1;
    if (h && hd) {
        curl_easy_setopt(h, CURLOPT_URL, url);
        curl_easy_setopt(h, CURLOPT_POSTFIELDS, body ? body : "");
        curl_easy_setopt(h, CURLOPT_POSTFIELDSIZE, (long)len);
        curl_easy_setopt(h, CURLOPT_HTTPHEADER, hd);
        curl_easy_setopt(h, CURLOPT_WRITEFUNCTION, rt_sink);
        curl_easy_setopt(h, CURLOPT_WRITEDATA, &rep);
        curl_easy_setopt(h, CURLOPT_NOSIGNAL, 1L);
        curl_easy_setopt(h, CURLOPT_TIMEOUT_MS, (long)timeout_ms);
        curl_easy_setopt(h, CURLOPT_PROXY, "");
        if (curl_easy_perform(h) == CURLE_OK) curl_easy_getinfo(h, CURLINFO_RESPONSE_CODE, &code);
    }
    curl_slist_free_all(hd);
    if (h) curl_easy_cleanup(h);
    return code;
}

/* Tokens of req's prompt on the decode node at addr (POST /v1/tokenize
 * with the prompt as POST /v1/generate takes it: the chat template
 * applied); -1 with a short reason. */
int rt_count_tokens(router *r, const char *addr, const api_request *req, int32_t **ids, char *err, size_t errlen) {
    char *body = api_upstream_body(req, "local", NULL);
    if (!body) { rt_errf(err, errlen, "out of memory"); return -1; }
    strbuf b = {0};
    double t0 = rt_now_ms();
    long st = rt_http_post(addr, "/v1/tokenize", body, strlen(body), rt_node_key(r), RT_REPLY_TOKENS,
                           r->cfg.tokenize_timeout_ms, &b);
    free(body);
    json_t *o = st == 200 && b.p ? json_loadb(b.p, b.len, 0, NULL) : NULL;
    json_t *a = json_object_get(o, "tokens");
    int n = json_is_array(a) && json_array_size(a) > 0 && json_array_size(a) < (1u << 24) ? (int)json_array_size(a) : -1;
    if (n < 0) {
        if (st <= 0 && rt_now_ms() - t0 >= r->cfg.tokenize_timeout_ms)
            rt_errf(err, errlen, "decode node's /v1/tokenize took over %d ms", r->cfg.tokenize_timeout_ms);
        else if (st <= 0) rt_errf(err, errlen, "decode node's /v1/tokenize did not answer");
        else rt_errf(err, errlen, "decode node's /v1/tokenize answered HTTP %ld", st);
    }
    if (n > 0 && ids && (*ids = malloc(sizeof **ids * (size_t)n))) {
        for (int i = 0; i < n && *ids; i++) {
            json_t *v = json_array_get(a, (size_t)i);
            json_int_t x = json_is_integer(v) ? json_integer_value(v) : -1;
            if (x < 0 || x > INT32_MAX) { free(*ids); *ids = NULL; }   /* not ids: counted, not hashed */
            else (*ids)[i] = (int32_t)x;
        }
    }
    json_decref(o);
    free(b.p);
    return n;
}

/* First number among keys (the stats format names may vary by version). */
static double rt_json_num(json_t *o, const char *const *keys) {
    for (; *keys; keys++) {
        json_t *v = json_object_get(o, *keys);
        if (json_is_number(v)) return json_number_value(v);
    }
    return -1;
}

typedef struct {
    int ok;
    char desc[400];
    int queue, slots, queue_max, n_ctx;
    double prefill_tps, decode_tps;
    char chat_format[16];
    char err[256];               /* why the probe failed */
    rc_report *rep;              /* what a decode node holds (its /v1/stats "prefix"), or NULL */
} rt_probe;

static void rt_probe_decode(const char *addr, const node_auth_key *key, int timeout_ms, rt_probe *p) {
    strbuf b = {0};
    long code = rt_http_get(addr, "/health", NULL, timeout_ms, &b, p->err, sizeof p->err);
    json_t *o = b.p ? json_loadb(b.p, b.len, 0, NULL) : NULL;
    p->ok = code == 200 && json_is_object(o);
    if (!p->ok && code >= 0) snprintf(p->err, sizeof p->err, "GET /health answered HTTP %ld%s", code, code == 200 ? " without a JSON object" : "");
    const char *model = json_string_value(json_object_get(o, "model"));
    if (model) snprintf(p->desc, sizeof p->desc, "%s", model);
    const char *cf = json_string_value(json_object_get(o, "chat_format"));
    snprintf(p->chat_format, sizeof p->chat_format, "%s", cf ? cf : "");
    json_t *nc = json_object_get(o, "n_ctx");   /* bounds /tokenize bodies; a broken report is ignored */
    p->n_ctx = json_is_integer(nc) && json_integer_value(nc) > 0 && json_integer_value(nc) <= (1 << 24)
             ? (int)json_integer_value(nc) : 0;
    json_decref(o);
    free(b.p);
    p->queue = -1;
    p->prefill_tps = p->decode_tps = -1;
    if (!p->ok) return;
    strbuf s = {0};
    if (rt_http_get(addr, "/v1/stats", key, timeout_ms, &s, NULL, 0) == 200 && s.p) {
        json_t *st = json_loadb(s.p, s.len, 0, NULL);
        static const char *const qk[] = {"queued", "queue_depth", "waiting", NULL};
        static const char *const pk[] = {"prefill_tps_local", "prefill_tps", NULL};
        static const char *const dk[] = {"decode_tps", "decode_tokens_per_s", "decode_tok_s", NULL};
        static const char *const bk[] = {"slots_busy", "busy", NULL};
        static const char *const sk[] = {"slots", NULL};
        static const char *const mk[] = {"queue_max", NULL};
        /* Nodes without "slots" run one generation at a time; bound what a
         * broken report can make the router believe. */
        double qd = rt_json_num(st, qk), busy = rt_json_num(st, bk), slots = rt_json_num(st, sk), qmax = rt_json_num(st, mk);
        p->queue = qd >= 0 && qd < 1e6 ? (int)qd + (busy > 0 && busy < 1e6 ? (int)busy : 0) : -1;
        p->slots = slots >= 1 && slots < 1e6 ? (int)slots : 1;
        p->queue_max = qmax >= 0 && qmax < 1e6 ? (int)qmax : -1;
        p->prefill_tps = rt_json_num(st, pk);
        p->decode_tps = rt_json_num(st, dk);
        p->rep = rc_report_parse(json_object_get(st, "prefix"));
        json_decref(st);
    }
    free(s.p);
}

/* A prefill node speaks only the wire protocol: connect and read its HELLO
 * (the first frame it sends), which proves a live node of the right role and
 * names its model, without the router knowing any model fingerprint. */
static void rt_probe_prefill(const char *addr, int timeout_ms, rt_probe *p) {
    char *err = p->err;
    size_t errlen = sizeof p->err;
    if (chain_spec_is(addr)) {   /* a layer-split chain: every member, its slice (router_chain.h) */
        p->ok = rt_chain_probe(addr, timeout_ms, p->desc, sizeof p->desc, err, errlen) == 0;
        p->prefill_tps = -1;   /* slices report no rate: the configured default stands in */
        return;
    }
    int fd = wire_connect(addr, timeout_ms, err, errlen);
    p->ok = 0;
    if (fd < 0) return;
    wire_conn wc;
    wire_conn_init(&wc, fd, timeout_ms);
    wire_header h;
    wire_hello hello;
    if (wire_recv(&wc, &h, err, errlen) == 0) {
        if (h.type != WIRE_HELLO) {
            snprintf(err, errlen, "no HELLO from a prefill node (got a %s frame)", wire_type_name(h.type));
        } else if (wire_decode_hello(wc.rx.data, wc.rx.len, &hello, err, errlen) == 0) {
            p->ok = hello.role == WIRE_ROLE_PREFILL;
            if (p->ok) {
                snprintf(p->desc, sizeof p->desc, "%s: %s", hello.node_id, hello.model_desc);
                p->prefill_tps = prefill_rate_parse(hello.model_desc);   /* its measured rate (prefill_rate.h) */
                p->n_ctx = prefill_ctx_parse(hello.model_desc);          /* its context: no longer split goes there */
            }
            else snprintf(err, errlen, "a %s node, not a prefill node", wire_role_name(hello.role));
        }
    }
    wire_conn_close(&wc);
}

/* Frees entry i of the table: its role 0 marks it free (every loop over
 * the table skips it, rt_node_upsert_locked reuses it); the table shrinks
 * when it was the last. Caller holds mu. */
void rt_node_forget_locked(router *r, int i) {
    rc_node_free_locked(&r->nodes[i]);
    memset(&r->nodes[i], 0, sizeof r->nodes[i]);
    while (r->n_nodes > 0 && !r->nodes[r->n_nodes - 1].cfg.role) r->n_nodes--;
}

/* One probe of every node. startup: the round before the router serves,
 * which logs every configured node as reachable or not (with the reason);
 * later rounds log only changes. */
void rt_health_round(router *r, int startup) {
    int n;
    router_node_cfg cfgs[ROUTER_MAX_NODES];
    pthread_mutex_lock(&r->mu);
    n = r->n_nodes;
    for (int i = 0; i < n; i++) cfgs[i] = r->nodes[i].cfg;
    pthread_mutex_unlock(&r->mu);
    double lat[ROUTER_MAX_NODES];
    pthread_mutex_lock(&r->mu);
    for (int i = 0; i < n; i++) lat[i] = r->nodes[i].probe_ms;
    pthread_mutex_unlock(&r->mu);
    for (int i = 0; i < n && !r->stopping; i++) {
        rt_probe p;
        memset(&p, 0, sizeof p);
        if (!cfgs[i].role) continue;   /* a free entry (rt_node_forget_locked) */
        int timeout = router_probe_timeout_ms(r->cfg.health_interval_ms, lat[i]);
        double asked = rt_now_ms();
        if (cfgs[i].role == ROUTER_NODE_DECODE) rt_probe_decode(cfgs[i].addr, rt_node_key(r), timeout, &p);
        else rt_probe_prefill(cfgs[i].addr, timeout, &p);
        double took = rt_now_ms() - asked;
        pthread_mutex_lock(&r->mu);
        rt_node *nd = &r->nodes[i];
        if (nd->cfg.role != cfgs[i].role || strcmp(nd->cfg.addr, cfgs[i].addr)) {   /* forgotten and reused meanwhile */
            pthread_mutex_unlock(&r->mu);
            rc_report_free(p.rep);
            continue;
        }
        double now = rt_now_ms();
        int expired = nd->registered && now - nd->last_heartbeat_ms > r->cfg.heartbeat_ttl_ms;
        if (expired && nd->inflight == 0) {
            /* Removed at heartbeat expiry, so that a table filled by churn
             * or a signed flood empties itself (issue 39 item 5). One with
             * requests in flight waits for them: they hold its index. */
            log_warn(NULL, "%s node %s (model %s) removed: no heartbeat for %d ms",
                     cfgs[i].role == ROUTER_NODE_DECODE ? "decode" : "prefill", cfgs[i].addr, cfgs[i].model,
                     r->cfg.heartbeat_ttl_ms);
            rt_node_forget_locked(r, i);
            pthread_mutex_unlock(&r->mu);
            continue;
        }
        if (p.ok && !expired) {
            if (!nd->up) log_info(NULL, "%s node %s (model %s) %s: %s", cfgs[i].role == ROUTER_NODE_DECODE ? "decode" : "prefill",
                                  cfgs[i].addr, cfgs[i].model, startup ? "reachable at start-up" : "is up", p.desc);
            nd->up = 1;
            nd->fails = 0;
            snprintf(nd->desc, sizeof nd->desc, "%s", p.desc);
            snprintf(nd->chat_format, sizeof nd->chat_format, "%s", p.chat_format);
            if (p.n_ctx > 0) nd->n_ctx = p.n_ctx;
            if (p.queue >= 0) { nd->queue_depth = p.queue; nd->inflight_at_report = nd->inflight; }
            if (cfgs[i].role == ROUTER_NODE_DECODE) {
                nd->slots = p.slots;
                nd->queue_max = p.queue_max;
                nd->queue_known = p.queue_max >= 0;
            }
            if (p.prefill_tps > 0) nd->prefill_tps = p.prefill_tps;
            if (p.decode_tps > 0) nd->decode_tps = p.decode_tps;
            rt_ewma(&nd->probe_ms, took > 0.1 ? took : 0.1);
            /* no report this time (/v1/stats slow or refused): the last one
             * stands until it is stale (router_cache.h) */
            if (cfgs[i].role == ROUTER_NODE_DECODE && p.rep) { rc_report_apply_locked(r, i, p.rep, asked); p.rep = NULL; }
        } else {
            nd->fails++;
            nd->checks_failed++;
            nd->failures++;   /* tandem_node_failures_total counts failed checks too (its help says so) */
            if (startup)
                log_warn(NULL, "%s node %s (model %s) unreachable at start-up: %s",
                         cfgs[i].role == ROUTER_NODE_DECODE ? "decode" : "prefill", cfgs[i].addr, cfgs[i].model,
                         p.ok ? "no heartbeat" : p.err[0] ? p.err : "no answer");
            if (nd->up && (nd->fails >= r->cfg.down_after || expired)) {
                nd->up = 0;
                log_warn(NULL, "%s node %s marked down (%s%s%s)", cfgs[i].role == ROUTER_NODE_DECODE ? "decode" : "prefill",
                         cfgs[i].addr, expired ? "no heartbeat" : "health check failed", expired ? "" : ": ",
                         expired ? "" : p.err[0] ? p.err : "no answer");
            }
        }
        pthread_mutex_unlock(&r->mu);
        rc_report_free(p.rep);
    }
}

/* A probe's timeout: the health interval (at least 1 s), or RT_PROBE_SLACK
 * times the node's usual round trip when that is longer, so that a host
 * under heavy load (every answer slow) does not see its nodes as dead; at
 * most RT_PROBE_MAX_MS, so a hung node is still found. */
#define RT_PROBE_SLACK 8.0
#define RT_PROBE_MIN_MS 1000
#define RT_PROBE_MAX_MS 30000

int router_probe_timeout_ms(int interval_ms, double probe_ms) {
    double t = interval_ms > RT_PROBE_MIN_MS ? interval_ms : RT_PROBE_MIN_MS;
    if (probe_ms > 0 && isfinite(probe_ms) && probe_ms * RT_PROBE_SLACK > t) t = probe_ms * RT_PROBE_SLACK;
    return t < RT_PROBE_MAX_MS ? (int)t : RT_PROBE_MAX_MS;
}

void *rt_health_main(void *arg) {
    router *r = arg;
    while (!r->stopping) {
        rt_health_round(r, 0);
        pthread_mutex_lock(&r->mu);
        struct timespec ts;
        clock_gettime(CLOCK_REALTIME, &ts);
        long long ns = ts.tv_nsec + (long long)r->cfg.health_interval_ms * 1000000LL;
        ts.tv_sec += ns / 1000000000LL;
        ts.tv_nsec = ns % 1000000000LL;
        if (!r->stopping) pthread_cond_timedwait(&r->cv, &r->mu, &ts);
        pthread_mutex_unlock(&r->mu);
    }
    return NULL;
}

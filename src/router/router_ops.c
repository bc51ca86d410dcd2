/* router_ops.c - what an operator meets around the router's requests:
 * configuration mistakes found at start-up (a secret the decode nodes do
 * not share, an open router on every interface) and the graceful drain on
 * SIGTERM/SIGINT (docs/router.md, Shutdown).
 *
 * The rule of every router file: the registry, the measured rates and the
 * metrics live under one mutex (router.mu); no lock is held across I/O.
 */
#include "router/router_internal.h"
#include "router/router_nodes.h"

/* ==== Start-up checks ==== */

/* How long the start-up signature probe waits for one node: it already
 * answered the health probe a moment ago. */
#define RT_OPS_PROBE_MS 2000

int rt_ops_check_secret(router *r, char *err, size_t errlen) {
    router_node_cfg cfgs[ROUTER_MAX_NODES];
    int up[ROUTER_MAX_NODES], n;
    pthread_mutex_lock(&r->mu);
    n = r->n_nodes;
    for (int i = 0; i < n; i++) {
        cfgs[i] = r->nodes[i].cfg;
        up[i] = r->nodes[i].up && !r->nodes[i].registered;
    }
    pthread_mutex_unlock(&r->mu);
    char bad[600] = "";
    size_t used = 0;
    int n_bad = 0;
    for (int i = 0; i < n; i++) {
        if (cfgs[i].role != ROUTER_NODE_DECODE || !up[i]) continue;   /* unreachable: logged by the health round */
        strbuf b = {0};
        char why[200] = "";
        /* GET /v1/stats is signed when the node has a secret: a 401 is a
         * secret the two do not share, found before any request */
        long code = rt_http_get(cfgs[i].addr, "/v1/stats", r->have_secret ? &r->api_key : NULL, RT_OPS_PROBE_MS, &b,
                                why, sizeof why);
        free(b.p);
        if (code != 401) continue;
        n_bad++;
        if (used < sizeof bad)
            used += (size_t)snprintf(bad + used, sizeof bad - used, "%s%s", n_bad > 1 ? ", " : "", cfgs[i].addr);
    }
    if (!n_bad) return 0;
    rt_errf(err, errlen,
            "decode node%s %s refused the router's %s request (HTTP 401): %s; give the router and every node the "
            "same --secret-file (or TANDEM_SECRET)",
            n_bad > 1 ? "s" : "", bad, r->have_secret ? "signed" : "unsigned",
            r->have_secret ? "the router and the node do not share the secret" : "the node has a secret and the router none");
    return -1;
}

/* 1 when HOST of HOST:PORT means every interface. */
static int rt_ops_wildcard(const char *listen) {
    const char *colon = strrchr(listen, ':');
    size_t n = colon ? (size_t)(colon - listen) : strlen(listen);
    static const char *const any[] = {"0.0.0.0", "[::]", "::", "*", "[::0]", NULL};
    for (int i = 0; any[i]; i++)
        if (strlen(any[i]) == n && !strncmp(listen, any[i], n)) return 1;
    return 0;
}

void rt_ops_warn_open(const router_config *c) {
    if (c->api_key[0] || !rt_ops_wildcard(c->listen)) return;
    /* loud: three lines that say the same, hard to miss in a start-up log */
    log_warn(NULL, "*** the router listens on every interface (%s) without an API key ***", c->listen);
    log_warn(NULL, "*** anyone who can reach this port can use every model it routes to ***");
    log_warn(NULL, "*** give --api-key-file FILE (or TANDEM_API_KEY), or listen on 127.0.0.1 ***");
}

/* ==== Nodes that leave ==== */

void rt_ops_node_leaves_locked(router *r, int i) {
    rt_node *n = &r->nodes[i];
    log_info(NULL, "%s node %s (model %s) deregistered: it is shutting down (%d request(s) of ours in flight)",
             n->cfg.role == ROUTER_NODE_DECODE ? "decode" : "prefill", n->cfg.addr, n->cfg.model, n->inflight);
    if (n->inflight == 0) { rt_node_forget_locked(r, i); return; }
    n->up = 0;
    n->last_heartbeat_ms = -1e18;   /* expired: rt_health_round removes it when inflight reaches 0 */
}

/* ==== Drain ==== */

/* After the drain timeout, how long the cut streams get to write their
 * error event and [DONE] (each notices the cut within 100 ms: rt_up_line's
 * poll slice). */
#define RT_OPS_CUT_GRACE_MS 2000

void rt_ops_cut_error(api_error *e, int n_tokens) {
    if (n_tokens > 0)
        api_error_set(e, 503, "server_error", "shutting_down", NULL,
                      "The router is shutting down: the answer was cut after %d tokens (drain timeout); retry the request.",
                      n_tokens);
    else
        api_error_set(e, 503, "server_error", "shutting_down", NULL,
                      "The router is shutting down (drain timeout); retry the request.");
}

void router_drain(router *r) {
    if (!r) return;
    r->draining = 1;
    httpd_quiesce(r->http);
    double t0 = rt_now_ms();
    int left = httpd_wait_idle(r->http, r->cfg.drain_timeout_ms);
    if (left > 0) {
        log_warn(NULL, "drain timeout (%d ms): cutting %d request(s) in flight with an error", r->cfg.drain_timeout_ms, left);
        atomic_store(&r->cut, 1);
        left = httpd_wait_idle(r->http, RT_OPS_CUT_GRACE_MS);
    }
    log_info(NULL, "drained in %.0f ms%s", rt_now_ms() - t0, left > 0 ? " (some connections are closed unfinished)" : "");
}

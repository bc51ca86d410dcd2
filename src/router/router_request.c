/* router_request.c - one generation request's life: its choices, the
 * split-or-local plan (count the prompt, choose the nodes), an attempt and
 * its retries, learning the nodes' rates from the outcome, its log line.
 *
 * The rule of every router file: the registry, the measured rates and the
 * metrics live under one mutex (router.mu); no lock is held across I/O.
 */
#include "router/router_internal.h"
#include "router/router_cache.h"
#include "router/router_nodes.h"
#include "router/router_stream.h"
#include "net/deadline.h"

/* ==== A generation request: choices, the plan ==== */

int rt_text_add(rt_choice *c, const char *s) {
    size_t n = s ? strlen(s) : 0;
    if (c->text_len + n + 1 > c->text_cap) {
        size_t cap = c->text_cap ? c->text_cap * 2 : 256;
        while (cap < c->text_len + n + 1) cap *= 2;
        char *t = realloc(c->text, cap);
        if (!t) return -1;
        c->text = t;
        c->text_cap = cap;
    }
    if (n) memcpy(c->text + c->text_len, s, n);
    c->text_len += n;
    c->text[c->text_len] = 0;
    return 0;
}

/* Keeps a token's logprob entry for the non-stream reply (takes it from u). */
void rt_lp_add(rt_choice *c, api_upstream_line *u) {
    if (c->n_lps == c->cap_lps) {
        int cap = c->cap_lps ? c->cap_lps * 2 : 64;
        char **p = realloc(c->lps, sizeof *p * (size_t)cap);
        if (!p) return;
        c->lps = p;
        c->cap_lps = cap;
    }
    c->lps[c->n_lps++] = u->logprob;
    u->logprob = NULL;
}

void rt_lp_clear(rt_choice *c) {
    for (int i = 0; i < c->n_lps; i++) free(c->lps[i]);
    c->n_lps = 0;
}

/* The choice a line is for; NULL (with q->error) for an index out of range. */
rt_choice *rt_choice_of(rt_req *q, const api_upstream_line *u) {
    if (u->index >= 0 && u->index < q->req.n && !q->ch[u->index].done) return &q->ch[u->index];
    snprintf(q->error, sizeof q->error, "decode node %s sent a line for choice %d of %d", q->decode_addr, u->index, q->req.n);
    return NULL;
}

/* A choice's final line: its figures, and choice 0's line kept as q->fin
 * (taken from u). Once every choice is done, fin's completion_tokens
 * become their sum (usage counts the prompt once, as OpenAI does). */
void rt_choice_end(rt_req *q, rt_choice *c, api_upstream_line *u) {
    c->done = 1;
    q->n_done++;
    snprintf(c->finish_reason, sizeof c->finish_reason, "%s", u->finish_reason);
    c->completion_tokens = u->completion_tokens;
    if (u->index == 0) {
        q->fin = *u;
        q->have_fin = 1;
        memset(u, 0, sizeof *u);
    }
    if (q->n_done == q->req.n && q->have_fin) {
        int sum = 0;
        for (int i = 0; i < q->req.n; i++) sum += q->ch[i].completion_tokens;
        q->fin.completion_tokens = sum;
    }
}

/* Forgets every choice's output (a retry starts from scratch). */
void rt_choices_reset(rt_req *q) {
    for (int i = 0; i < q->req.n; i++) {
        rt_choice *c = &q->ch[i];
        c->text_len = 0;
        rt_lp_clear(c);
        c->n_tokens = c->done = c->completion_tokens = 0;
        c->lp_offset = 0;
        c->finish_reason[0] = 0;
    }
    q->n_done = 0;
}

/* Release the current attempt's node; failed: count a failure against it. */
void rt_release_node(rt_req *q, int failed, int mark_down) {
    router *r = q->r;
    if (q->have_up) { rt_up_close(&q->up); q->have_up = 0; }
    pthread_mutex_lock(&r->mu);
    if (q->decode_idx >= 0) {
        rt_node *n = &r->nodes[q->decode_idx];
        rc_note_end_locked(q, q->decode_idx, !failed && q->status == 200);
        if (n->inflight > 0) n->inflight--;
        if (failed) n->failures++;
        if (mark_down && n->up) { n->up = 0; log_warn(q->rid, "decode node %s marked down: %s", n->cfg.addr, q->error); }
    }
    if (q->prefill_idx >= 0 && r->nodes[q->prefill_idx].inflight > 0) r->nodes[q->prefill_idx].inflight--;
    pthread_mutex_unlock(&r->mu);
    q->decode_idx = q->prefill_idx = -1;
}

/* How long the check that a failed node's port still accepts connections
 * waits: a live process's kernel accepts at once, even under heavy load. */
#define RT_DEAD_CONNECT_MS 300
#define RT_DEAD_LOOKS 3
#define RT_DEAD_GAP_MS 100

/* The attempt's stream broke (reset, or closed before its final line):
 * when the node's port no longer accepts connections its process is gone,
 * and it is marked down now rather than at its next health checks (its
 * other requests failed too). A stall or a node that still accepts is left
 * to the health checks. No lock held. */
void rt_check_dead(rt_req *q) {
    router *r = q->r;
    if (!q->have_up || !q->up.done || q->decode_idx < 0) return;
    char err[160];
    /* a process being killed closes its connections before its listening
     * socket: look again for a moment before calling it alive */
    for (int k = 0;; k++) {
        int fd = wire_connect(q->decode_addr, RT_DEAD_CONNECT_MS, err, sizeof err);
        if (fd < 0) break;
        close(fd);
        if (k == RT_DEAD_LOOKS) return;
        struct timespec ts = { 0, RT_DEAD_GAP_MS * 1000000L };
        nanosleep(&ts, NULL);
    }
    pthread_mutex_lock(&r->mu);
    rt_node *n = &r->nodes[q->decode_idx];
    int was = n->up && !strcmp(n->cfg.addr, q->decode_addr);
    if (was) { n->up = 0; n->fails = r->cfg.down_after; }
    pthread_mutex_unlock(&r->mu);
    if (was) log_warn(q->rid, "decode node %s marked down: its stream broke (%s) and it refuses connections (%s)",
                      q->decode_addr, q->error[0] ? q->error : "no reply", err);
}

/* A split's cost beyond the prefill node's compute until measured (as
 * router_cache.c assumes): on a LAN, the request's round trip and the
 * decode node's last position. */
#define RT_SPLIT_OVERHEAD_MS 2.0

/* Prompt length from its bytes, for when the decode node cannot count it:
 * the bytes per token the decode node's completed requests showed. */
static int rt_estimate_tokens(const rt_req *q, const rt_node *d) {
    double bpt = d->bytes_per_token > 0 ? d->bytes_per_token : 4.0;   /* ~4 bytes/token for English BPE */
    return (int)(q->req.prompt_bytes / bpt) + 1;
}

/* The prompt's tokens as the decode node at addr (table entry idx) will
 * evaluate them (its tokenizer, its chat template), and with cache-aware
 * routing their ids (q->rcp); a byte estimate, with why in q->count_note,
 * when it cannot answer within tokenize_timeout_ms. No lock held. */
static void rt_count_prompt(rt_req *q, const char *addr, int idx) {
    router *r = q->r;
    q->count_exact = 1;
    snprintf(q->count_note, sizeof q->count_note, "tokenizer");
    if (q->req.tokens) {
        q->n_prompt = q->req.n_tokens;
        snprintf(q->count_note, sizeof q->count_note, "token ids");
        int32_t *ids = r->cfg.cache_aware && q->n_prompt > 0 ? malloc(sizeof *ids * (size_t)q->n_prompt) : NULL;
        if (ids) { memcpy(ids, q->req.tokens, sizeof *ids * (size_t)q->n_prompt); rc_prompt_set(q, ids, q->n_prompt); }
        return;
    }
    char err[160];
    int32_t *ids = NULL;
    int n = rt_count_tokens(r, addr, &q->req, r->cfg.cache_aware ? &ids : NULL, err, sizeof err);
    if (n > 0) { q->n_prompt = n; rc_prompt_set(q, ids, n); return; }
    pthread_mutex_lock(&r->mu);
    q->n_prompt = rt_estimate_tokens(q, &r->nodes[idx]);
    pthread_mutex_unlock(&r->mu);
    q->count_exact = 0;
    snprintf(q->count_note, sizeof q->count_note, "byte estimate: %s", err);
}

/* The decode node for the request: with n > 1 choices, one whose slots
 * (as it reports them) can run them all, when there is one; else the best
 * left, whose 400 then names its limit. Caller holds mu. */
static int rt_pick_decode_locked(rt_req *q) {
    router *r = q->r;
    if (q->req.n > 1) {
        int skip[ROUTER_MAX_NODES];
        for (int i = 0; i < r->n_nodes; i++) skip[i] = q->tried[i] || rt_node_slots(&r->nodes[i]) < q->req.n;
        int d = rt_pick_locked(r, ROUTER_NODE_DECODE, q->req.model, skip);
        if (d >= 0) return d;
    }
    return rt_pick_locked(r, ROUTER_NODE_DECODE, q->req.model, q->tried);
}

/* The decode node by expected time to first token (router_cache.c): with
 * n > 1 choices, one whose slots can run them all when there is one. The
 * plan comes with it when the prompt was counted (cache-aware routing).
 * Caller holds mu. */
static int rt_pick_scored_locked(rt_req *q) {
    router *r = q->r;
    int with_plan = q->counted, d = -1;
    if (q->req.n > 1) {
        int skip[ROUTER_MAX_NODES];
        for (int i = 0; i < r->n_nodes; i++) skip[i] = q->tried[i] || rt_node_slots(&r->nodes[i]) < q->req.n;
        d = rc_choose_locked(q, skip, with_plan, &q->prefill_idx, &q->dec);
    }
    if (d < 0) d = rc_choose_locked(q, q->tried, with_plan, &q->prefill_idx, &q->dec);
    q->planned = d >= 0 && with_plan;
    return d;
}

/* With cache-aware routing, the prompt is counted (and its ids hashed)
 * before the pick, on the node today's order would pick. No lock held. */
static void rt_count_first(rt_req *q) {
    router *r = q->r;
    if (!r->cfg.cache_aware || q->counted) return;
    pthread_mutex_lock(&r->mu);
    int d = rt_pick_decode_locked(q);
    char addr[128] = "";
    if (d >= 0) snprintf(addr, sizeof addr, "%s", r->nodes[d].cfg.addr);
    pthread_mutex_unlock(&r->mu);
    if (d < 0) return;
    /* a forced tool call's assistant prefix (that node's template) is part
     * of the prompt the node evaluates: counted too (rt_tools_prepare makes
     * it again for the node chosen) */
    if (api_tools_active(&q->req)) {
        api_error e;
        int was = q->decode_idx;
        q->decode_idx = d;
        rt_tools_prepare(q, &e);   /* a template without tool calls: refused after the pick */
        q->decode_idx = was;
    }
    rt_count_prompt(q, addr, d);
    q->counted = 1;
}

/* Chooses a decode node; -1 when no node is left, -2 when the best one
 * left is full with this router's own requests. */
static int rt_choose(rt_req *q) {
    router *r = q->r;
    rt_count_first(q);
    pthread_mutex_lock(&r->mu);
    int d = rt_pick_scored_locked(q);
    if (d < 0) { pthread_mutex_unlock(&r->mu); return -1; }
    if (rt_node_full(&r->nodes[d], 1)) { pthread_mutex_unlock(&r->mu); return -2; }
    rt_node *dn = &r->nodes[d];
    q->tried[d] = 1;
    q->decode_idx = d;
    dn->inflight++;
    dn->requests++;
    snprintf(q->decode_addr, sizeof q->decode_addr, "%s", dn->cfg.addr);
    if (!q->planned) q->prefill_idx = -1;
    q->prefill_addr[0] = 0;
    pthread_mutex_unlock(&r->mu);
    return 0;
}

/* The prefill plan for the chosen decode node: the pick's own plan with
 * cache-aware routing; else counts the prompt there, then the cost model
 * (router_decide) against the best prefill node. Either way the route is
 * noted in the cache index (router_cache.c). */
static void rt_plan(rt_req *q) {
    router *r = q->r;
    if (!q->planned && !q->counted) rt_count_prompt(q, q->decode_addr, q->decode_idx);
    pthread_mutex_lock(&r->mu);
    int p = q->prefill_idx;
    if (!q->planned) {
        /* no split of a prompt longer than a prefill node's context to it */
        int skip[ROUTER_MAX_NODES] = {0}, too_short = 0;
        for (int i = 0; i < r->n_nodes; i++)
            if (r->nodes[i].cfg.role == ROUTER_NODE_PREFILL && r->nodes[i].up && !rc_prefill_fits(&r->nodes[i], q))
                skip[i] = too_short = 1;
        p = rt_pick_locked(r, ROUTER_NODE_PREFILL, q->req.model, skip);
        router_cost_in in;
        rc_cost_in_locked(q, q->decode_idx, p, 1, &in);
        in.prefill_too_short = p < 0 && too_short;
        router_decide(&in, &q->dec);
    }
    q->planned = 0;   /* a retry plans again */
    rt_node *pn = q->dec.split && p >= 0 ? &r->nodes[p] : NULL;
    q->prefill_idx = -1;
    q->prefill_addr[0] = 0;
    if (pn) {
        q->prefill_idx = p;
        pn->inflight++;
        pn->requests++;
        snprintf(q->prefill_addr, sizeof q->prefill_addr, "%s", pn->cfg.addr);
    }
    rc_note_route_locked(q, q->decode_idx, q->prefill_idx);
    metrics_add(r->m.decisions, (const char *[]){q->dec.split ? "split" : "local", q->dec.key ? q->dec.key : "unknown"}, 1);
    pthread_mutex_unlock(&r->mu);
    if (!r->cfg.quiet)
        log_debug(q->rid, "model %s -> decode %s, %s%s%s", q->req.model, q->decode_addr, q->dec.reason,
               q->dec.split ? " via prefill " : "", q->prefill_addr);
}

/* Maps a decode node's 4xx reply to the client's error. */
static void rt_client_error_from_node(rt_req *q, long status, api_error *e) {
    char msg[300];
    api_upstream_error_message(q->up.buf ? q->up.buf + q->up.off : "", q->up.len - q->up.off, msg, sizeof msg);
    const char *code = NULL, *param = NULL;
    if (strstr(msg, "context") || strstr(msg, "too long") || strstr(msg, "exceeds")) {
        code = "context_length_exceeded";
        param = q->req.kind == API_CHAT ? "messages" : "prompt";
    }
    api_error_set(e, status == 413 ? 413 : 400, "invalid_request_error", code, param, "%s", msg);
}

/* The request's whole-time limit (ms): request_timeout_ms, plus what the
 * nodes' prefill deadline grants a prompt beyond its 300 s base (50 ms a
 * token over 6,000, net/deadline.h), so that the router does not cut a
 * long prompt that a prefill node, or the decode node's own fallback,
 * is still computing. */
static int rt_limit_ms(const rt_req *q) {
    long long ms = (long long)q->r->cfg.request_timeout_ms + deadline_prefill_extra_ms(q->n_prompt);
    return ms > DEADLINE_MAX_MS ? DEADLINE_MAX_MS : (int)ms;
}

/* The first line of an attempt. Before it the request may wait in the
 * node's queue and for its prefill, which the idle timeout must not cut
 * short (a queue of long generations takes minutes): it waits as long as
 * the node passes its health checks, up to the request's deadline. */
static int rt_wait_first(rt_req *q, char **line, size_t *len) {
    router *r = q->r;
    double hard = q->t_start + rt_limit_ms(q);
    for (;;) {
        double slice = rt_now_ms() + r->cfg.health_interval_ms;   /* look at the node's health this often */
        int rc = rt_up_line(&q->up, slice < hard ? slice : hard, q->client_fd, line, len);
        if (rc != RT_TIMEOUT || rt_now_ms() >= hard) return rc;
        pthread_mutex_lock(&r->mu);
        int up = q->decode_idx >= 0 && r->nodes[q->decode_idx].up;
        pthread_mutex_unlock(&r->mu);
        if (!up) return RT_TIMEOUT;
    }
}

/* A node that refused a request as full counts as full until its next
 * health report. */
static void rt_mark_full(router *r, int idx) {
    if (idx < 0) return;
    pthread_mutex_lock(&r->mu);
    rt_node *n = &r->nodes[idx];
    if (!n->queue_known) { n->queue_max = 0; n->queue_known = 1; }
    int cap = rt_node_slots(n) + n->queue_max;
    if (n->queue_depth < cap) n->queue_depth = cap;
    pthread_mutex_unlock(&r->mu);
}

/* ==== Attempts, outcome, log ==== */

static int rt_attempt(rt_req *q, api_error *e) {
    router *r = q->r;
    if (rt_tools_prepare(q, e)) return -1;
    rt_plan(q);
    const char *mode = q->dec.split ? "remote" : "local";
    char *body = api_upstream_body(&q->req, mode, q->dec.split ? q->prefill_addr : NULL);
    if (!body || rt_up_open(&q->up, q->decode_addr, body, r->cfg.connect_timeout_ms, r->have_secret ? &r->api_key : NULL,
                             q->rid, q->client)) {
        if (!q->up.body) free(body);
        rt_up_close(&q->up);
        api_error_set(e, 500, "server_error", NULL, NULL, "out of memory");
        return -1;
    }
    q->have_up = 1;
    q->up.cancel = q->batch ? &q->batch->cancel : NULL;   /* the batch gives up: a sibling failed, the client left */
    q->up.cut = &r->cut;
    if (atomic_load(&r->cut)) { q->cut = 1; rt_ops_cut_error(e, 0); return -1; }
    char *line;
    size_t len;
    int rc = rt_wait_first(q, &line, &len);
    long status = rt_up_status(&q->up);
    if (rc == RT_GONE) { snprintf(q->error, sizeof q->error, "client disconnected"); return -1; }
    if (rc == RT_CUT) { q->cut = 1; rt_ops_cut_error(e, 0); snprintf(q->error, sizeof q->error, "%s", e->message); return -1; }
    /* 401: the node does not accept our signature (no or another secret):
     * the node's fault towards the client, not the request's */
    if (status >= 400 && status < 500 && status != 429 && status != 408 && status != 401) {
        rt_client_error_from_node(q, status, e);
        return -1;
    }
    if (rc == RT_LINE && status == 200 && api_parse_upstream_line(line, len, &q->pending) == 0) {
        if (q->pending.is_token || (q->pending.is_done && strcmp(q->pending.finish_reason, "error"))) {
            q->have_pending = 1;
            q->error[0] = 0;   /* earlier attempts' failures are in the log and the retry count */
            return 0;
        }
        snprintf(q->error, sizeof q->error, "decode node %s failed before the first token: %s", q->decode_addr,
                 q->pending.error[0] ? q->pending.error : "error");
        api_upstream_line_free(&q->pending);
    } else if (rc == RT_TIMEOUT) {
        if (rt_now_ms() >= q->t_start + rt_limit_ms(q))
            snprintf(q->error, sizeof q->error, "request timed out after %d ms before the first token from decode node %s",
                     rt_limit_ms(q), q->decode_addr);
        else
            snprintf(q->error, sizeof q->error, "decode node %s failed its health checks before the first token", q->decode_addr);
    } else if (status == 401) {
        char msg[300];
        api_upstream_error_message(q->up.buf ? q->up.buf + q->up.off : "", q->up.len - q->up.off, msg, sizeof msg);
        snprintf(q->error, sizeof q->error, "decode node %s refused the router's request (HTTP 401: %s); check that "
                 "router and node share the secret", q->decode_addr, msg);
    } else if (status == 503 || status == 429) {
        snprintf(q->error, sizeof q->error, "decode node %s is busy (HTTP %ld)", q->decode_addr, status);
    } else {
        snprintf(q->error, sizeof q->error, "decode node %s failed before the first token: %s (HTTP %ld)",
                 q->decode_addr, q->up.errbuf[0] ? q->up.errbuf : rc == RT_EOF ? "closed without a reply" : "bad reply",
                 status);
    }
    return 1;
}

/* No node could start the request: 429 when the nodes are full (retry
 * later), 503 when none is healthy, 502 when they failed. */
static void rt_start_error(rt_req *q, int chose, api_error *e) {
    if (chose == -2 || (q->attempts > 0 && q->busy == q->attempts))
        api_error_set(e, 429, "rate_limit_error", "overloaded", NULL,
                      "All decode nodes for '%s' are busy (every slot taken and every queue full); retry later.",
                      q->req.model);
    else if (q->attempts == 0)
        api_error_set(e, 503, "server_error", "no_healthy_node", NULL,
                      "No healthy decode node serves model '%s' right now; try again later.", q->req.model);
    else
        api_error_set(e, 502, "server_error", "upstream_failed", NULL,
                      "The request failed on %d decode node(s); last error: %s", q->attempts, q->error);
}

/* Runs attempts until a node streams; 0, or -1 with e filled. */
int rt_start(rt_req *q, api_error *e) {
    router *r = q->r;
    for (;;) {
        int chose = q->attempts >= r->cfg.max_attempts ? -1 : rt_choose(q);
        if (chose) { rt_start_error(q, chose, e); return -1; }
        q->attempts++;
        int rc = rt_attempt(q, e);
        if (rc == 0) return 0;
        int busy = strstr(q->error, "busy") != NULL, idx = q->decode_idx;
        int conn_fail = q->have_up && q->up.done && q->up.result == CURLE_COULDNT_CONNECT;
        if (rc > 0 && !busy && !conn_fail) rt_check_dead(q);
        rt_release_node(q, rc > 0 && !busy, conn_fail);
        if (rc < 0) {
            if (!strcmp(q->error, "client disconnected")) api_error_set(e, 499, "invalid_request_error", NULL, NULL, "client disconnected");
            return -1;
        }
        if (busy) {
            q->busy++;
            rt_mark_full(r, idx);
        }
        metrics_add(r->m.retries, NULL, 1);
        log_warn(q->rid, "%s; retrying on another decode node", q->error);
    }
}

/* Where the prompt was prefilled: on the prefill node; on the decode node
 * because it held the prompt already (prefix reuse: nothing was left for a
 * prefill node, and no fallback happened); else on the decode node (as
 * planned, or a fallback: fallback_reason says). */
int rt_prefill_outcome(const api_upstream_line *f) {
    if (!strcmp(f->prefill_mode, "remote")) return RT_PF_SPLIT;
    if (!f->fallback_reason[0] && f->prompt_tokens > 0 && f->start_pos >= f->prompt_tokens - 1) return RT_PF_CACHED;
    return RT_PF_LOCAL;
}

/* A completed request's figures into the metrics; times in seconds (< 0: unknown). */
static void rt_observe_done(rt_req *q, double ttft, double tpot, double transfer_ms, int remote) {
    rt_metrics *m = &q->r->m;
    const api_upstream_line *f = &q->fin;
    const char *const model[] = {q->req.model};
    if (ttft >= 0) metrics_observe(m->ttft, model, ttft);
    if (tpot >= 0) metrics_observe(m->tpot, model, tpot);
    if (f->queue_ms >= 0 && isfinite(f->queue_ms)) metrics_observe(m->queue, model, f->queue_ms / 1e3);
    if (f->prompt_tokens > 0) metrics_add(m->prompt_tokens, NULL, f->prompt_tokens);
    if (f->completion_tokens > 0) metrics_add(m->completion_tokens, NULL, f->completion_tokens);
    metrics_add(m->served, (const char *[]){rt_pf_names[rt_prefill_outcome(f)]}, 1);
    if (f->fallback_reason[0]) metrics_add(m->fallbacks, NULL, 1);
    if (remote) {
        metrics_add(m->kv_bytes, NULL, f->kv_bytes);
        metrics_add(m->wire_bytes, NULL, f->wire_bytes);
        if (transfer_ms >= 0 && isfinite(transfer_ms)) metrics_observe(m->transfer, model, transfer_ms / 1e3);
    }
}

/* Feeds a final line's figures into the node registry and the metrics. */
void rt_learn(rt_req *q) {
    router *r = q->r;
    const api_upstream_line *f = &q->fin;
    double ttft = q->t_first > 0 ? (q->t_first - q->t_start) / 1e3 : -1;
    double tpot = q->n_tokens > 1 ? (q->t_last - q->t_first) / 1e3 / (q->n_tokens - 1) : -1;
    double transfer = f->transfer_ms >= 0 ? f->transfer_ms : (f->ttft_ms > f->prefill_ms ? f->ttft_ms - f->prefill_ms : 0);
    int remote = !strcmp(f->prefill_mode, "remote");
    rt_observe_done(q, ttft, tpot, transfer, remote);
    pthread_mutex_lock(&r->mu);
    if (q->decode_idx >= 0) {
        rt_node *d = &r->nodes[q->decode_idx];
        if (q->req.prompt_bytes > 0 && f->prompt_tokens > 0) rt_ewma(&d->bytes_per_token, (double)q->req.prompt_bytes / f->prompt_tokens);
        if (!remote && f->computed_local >= 16 && f->prefill_ms > 0) rt_ewma(&d->prefill_tps, f->computed_local / f->prefill_ms * 1e3);
        if (tpot > 0) rt_ewma(&d->decode_tps, 1.0 / tpot);
        /* how long it held a slot: arrival to its last token, less its wait
         * in the node's queue (the pick's capacity estimate, router_cache.c) */
        double hold = q->t_last - q->t_start - (f->queue_ms > 0 ? f->queue_ms : 0);
        if (q->t_last > 0 && hold > 0) rt_ewma(&d->hold_ms, hold);
    }
    if (q->prefill_idx >= 0 && remote) {
        rt_node *p = &r->nodes[q->prefill_idx];
        double pms = f->remote_prefill_ms > 0 ? f->remote_prefill_ms : f->prefill_ms;
        if (f->computed_remote >= 16 && pms > 0) rt_ewma(&p->prefill_tps, f->computed_remote / pms * 1e3);
        if (f->positions_received > 0 && f->kv_bytes > 0) rt_ewma(&p->kv_bytes_per_token, f->kv_bytes / f->positions_received);
        /* The frames travel during the whole handoff (overlapped with compute):
         * bytes over handoff time is a lower bound of the link rate. It is
         * the rate itself only when the frames outlasted the compute (the
         * link was the bottleneck); otherwise it only says the link is at
         * least that fast, and taking it for the rate would make every
         * later estimate see a compute-bound link as slow. */
        if (f->handoff_ms > 0 && f->wire_bytes > 0) {
            double lb = f->wire_bytes / f->handoff_ms * 1e3;
            double cur = p->link_Bps > 0 ? p->link_Bps : r->cfg.link_gbps * 1e9 / 8;
            rt_ewma(&p->link_Bps, transfer > 0.1 * f->handoff_ms || lb > cur ? lb : cur);
        }
        /* The split's cost beyond the prefill node's compute and the exposed
         * transfer, as the decode node measured it: the request's round
         * trip, writing the frames into its cache, its own last position. */
        double fixed = pms > 0 && f->prefill_ms > pms ? f->prefill_ms - pms - transfer : 0;
        /* Seeded with the assumed cost, not the first sample: a decode
         * node's first split also opens its connection to the prefill node
         * (~100 ms), which later splits reuse. */
        if (!(p->overhead_ms > 0)) p->overhead_ms = RT_SPLIT_OVERHEAD_MS;
        rt_ewma(&p->overhead_ms, (transfer > 0 ? transfer : 0) + (fixed > 0.1 ? fixed : 0.1));
    }
    int marked = 0;
    if (q->prefill_idx >= 0 && f->fallback_reason[0]) {
        rt_node *p = &r->nodes[q->prefill_idx];
        p->failures++;
        p->fails = r->cfg.down_after;   /* suspect until the next good probe */
        marked = p->up;
        p->up = 0;
    }
    pthread_mutex_unlock(&r->mu);
    if (marked)
        log_warn(q->rid, "prefill node %s marked down (its split fell back to the decode node; up again at its next "
                 "good health check)", q->prefill_addr);
    if (f->fallback_reason[0])
        log_warn(q->rid, "prefill fell back to the decode node: %s", f->fallback_reason);
}

void rt_log_done(rt_req *q, const char *outcome) {
    if (q->logged) return;
    q->logged = 1;
    if (q->r->cfg.quiet) return;
    const api_upstream_line *f = &q->fin;
    double ttft = q->t_first > 0 ? q->t_first - q->t_start : -1;
    double tpot = q->n_tokens > 1 ? (q->t_last - q->t_first) / (q->n_tokens - 1) : 0;
    double transfer = strcmp(f->prefill_mode, "remote") ? 0
                    : f->transfer_ms >= 0 ? f->transfer_ms : (f->ttft_ms > f->prefill_ms ? f->ttft_ms - f->prefill_ms : 0);
    /* prefill: where it happened; "fallback" when a split plan ended local
     * because the prefill node failed, "cached" when the decode node held
     * the prompt already (nothing to compute remotely) */
    const char *pf = !f->prefill_mode[0] ? "-" : f->fallback_reason[0] ? "fallback" : rt_pf_names[rt_prefill_outcome(f)];
    /* tokens the client was sent, also when the stream failed before its final line */
    int completion = f->completion_tokens > q->n_tokens ? f->completion_tokens : q->n_tokens;
    char part[32] = "";   /* one prompt of several: which */
    if (q->batch) snprintf(part, sizeof part, " prompt_index=%d", rt_kid_index(q));
    char spec[80] = "";   /* speculative decoding on the decode node */
    if (f->spec_source[0]) snprintf(spec, sizeof spec, " spec=%s drafted=%d accepted=%d", f->spec_source, f->spec_drafted,
                                    f->spec_accepted);
    /* a 4xx or 5xx at warn level; the model and the client's own id named */
    log_line(q->status >= 400 ? LOGL_WARN : LOGL_INFO, q->rid, "%s status=%d id=%s%s model=%s%s%s attempts=%d decode=%s plan=%s reason=%s est_ms=%.1f counted=%d(%s) prefill=%s%s%s "
           "prompt=%d completion=%d ttft_ms=%.1f tpot_ms=%.2f "
           "start_pos=%d computed_remote=%d computed_local=%d kv_bytes=%.0f wire_bytes=%.0f prefill_ms=%.1f transfer_ms=%.1f%s%s%s%s%s",
           outcome, q->status, q->id, part, q->req.model ? q->req.model : "-", q->client_rid[0] ? " client_request_id=" : "",
           q->client_rid, q->attempts, q->decode_addr, q->dec.split ? "split" : "local",
           q->dec.key ? q->dec.key : "-", q->dec.split ? q->dec.est_split_ms : q->dec.est_local_ms, q->n_prompt,
           q->count_exact ? "exact" : "estimate",
           pf, f->prefill_node[0] ? "@" : "", f->prefill_node, f->prompt_tokens, completion, ttft, tpot,
           f->start_pos, f->computed_remote, f->computed_local, f->kv_bytes, f->wire_bytes, f->prefill_ms, transfer,
           f->fallback_reason[0] ? " fallback=" : "", f->fallback_reason, q->error[0] ? " error=" : "", q->error, spec);
}

/* Reads the next line of the current attempt. 1 token/done line in *u;
 * 0 the attempt failed (q->error says why); -1 the client went away. */
int rt_next(rt_req *q, api_upstream_line *u) {
    if (q->have_pending) { *u = q->pending; q->have_pending = 0; memset(&q->pending, 0, sizeof q->pending); return 1; }
    router *r = q->r;
    char *line;
    size_t len;
    double deadline = rt_now_ms() + r->cfg.idle_timeout_ms, hard = q->t_start + rt_limit_ms(q);
    int rc = rt_up_line(&q->up, deadline < hard ? deadline : hard, q->client_fd, &line, &len);
    if (rc == RT_GONE) return -1;
    if (rc == RT_CUT) {
        q->cut = 1;
        snprintf(q->error, sizeof q->error, "the router is shutting down (its drain timeout passed)");
        return 0;
    }
    if (rc == RT_LINE && api_parse_upstream_line(line, len, u) == 0) {
        if (u->error[0] && !u->is_token) {
            snprintf(q->error, sizeof q->error, "decode node %s: %s", q->decode_addr, u->error);
            if (u->is_done) return 1;
            api_upstream_line_free(u);
            return 0;
        }
        return 1;
    }
    if (rc == RT_TIMEOUT)
        snprintf(q->error, sizeof q->error, rt_now_ms() >= hard ? "request timed out after %d ms" : "decode node stalled for %d ms",
                 rt_now_ms() >= hard ? rt_limit_ms(q) : r->cfg.idle_timeout_ms);
    else
        snprintf(q->error, sizeof q->error, "decode node %s %s", q->decode_addr,
                 rc == RT_LINE ? "sent a malformed line" : rc == RT_EOF ? "closed the stream before finishing"
                 : q->up.errbuf[0] ? q->up.errbuf : "connection failed");
    return 0;
}

void rt_on_token(rt_req *q, const api_upstream_line *u) {
    double now = rt_now_ms();
    if (q->n_tokens == 0) {
        q->t_first = now;
        pthread_mutex_lock(&q->r->mu);
        if (q->decode_idx >= 0) rc_note_first_locked(q, q->decode_idx);
        pthread_mutex_unlock(&q->r->mu);
    }
    q->t_last = now;
    q->n_tokens++;
}

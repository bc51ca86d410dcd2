/* router_cache.c - routing by cache and capacity (router_cache.h): the
 * per-node index of held prefixes (node reports and this router's own
 * routing) and the pick of a decode node, with its plan, by expected time
 * to first token.
 *
 * The rule of every router file: the registry, the measured rates and the
 * metrics live under one mutex (router.mu); no lock is held across I/O.
 */
#include "router/router_cache.h"
#include "router/router_nodes.h"

#include "base/prefix_hash.h"

/* ==== Types ==== */

/* Sorted, without duplicates. */
typedef struct {
    uint64_t *h;
    int n;
} rc_set;

struct rc_report {
    uint64_t seed;
    rc_set held;                 /* every tier: slots, a KV store's host and disk */
    int n_peer;
    struct { char addr[128]; rc_set s; } peer[RC_PEERS];
};

/* A request this router sent to the node: its prompt is held there from
 * then on, until a report asked for after it ended says otherwise. */
typedef struct {
    const void *owner;           /* the rt_req while it runs; NULL once ended */
    uint64_t *h;                 /* its prompt's hashes, under the node's seed */
    int n;
    char peer[128];              /* the prefill node it went through ("" local) */
    int landed;                  /* its first token came: its prefill is over */
    double done_ms;              /* when it ended (0 while it runs) */
} rc_routed;

typedef struct rc_node {
    rc_report *rep;              /* the last report, or NULL */
    double report_ms;            /* when it was asked for */
    rc_routed routed[RC_ROUTED_MAX];
} rc_node;

/* The seeds a request's prompt is hashed under (one per model
 * fingerprint among the candidate nodes; normally one). */
#define RC_SEEDS 4

typedef struct rc_prompt {
    int32_t *ids;
    int n;
    int n_seed;
    struct { uint64_t seed; uint64_t *h; int nb; } s[RC_SEEDS];
} rc_prompt;

/* ==== Sets ==== */

static int rc_cmp(const void *a, const void *b) {
    uint64_t x = *(const uint64_t *)a, y = *(const uint64_t *)b;
    return x < y ? -1 : x > y;
}

/* Sorts, drops duplicates, and gives back the buffer's unused room (a
 * report is kept until the next one). */
static void rc_set_sort(rc_set *s) {
    if (s->n > 1) {
        qsort(s->h, (size_t)s->n, sizeof *s->h, rc_cmp);
        int k = 1;
        for (int i = 1; i < s->n; i++)
            if (s->h[i] != s->h[k - 1]) s->h[k++] = s->h[i];
        s->n = k;
    }
    uint64_t *p = s->h ? realloc(s->h, sizeof *s->h * (size_t)(s->n > 0 ? s->n : 1)) : NULL;
    if (p) s->h = p;
}

static int rc_set_has(const rc_set *s, uint64_t h) {
    int lo = 0, hi = s->n - 1;
    while (lo <= hi) {
        int mid = lo + (hi - lo) / 2;
        if (s->h[mid] == h) return 1;
        if (s->h[mid] < h) lo = mid + 1;
        else hi = mid - 1;
    }
    return 0;
}

/* Leading hashes of h[0..n) that s holds. */
static int rc_set_match(const rc_set *s, const uint64_t *h, int n) {
    int k = 0;
    while (k < n && rc_set_has(s, h[k])) k++;
    return k;
}

/* ==== Reports ==== */

/* Exactly 16 hex digits. */
static int rc_hex(const char *s, uint64_t *out) {
    uint64_t v = 0;
    int i = 0;
    for (; i < 16 && s[i]; i++) {
        char c = s[i];
        int d = c >= '0' && c <= '9' ? c - '0' : c >= 'a' && c <= 'f' ? c - 'a' + 10 : c >= 'A' && c <= 'F' ? c - 'A' + 10 : -1;
        if (d < 0) return -1;
        v = v << 4 | (uint64_t)d;
    }
    if (i != 16 || s[16]) return -1;
    *out = v;
    return 0;
}

/* Appends the hashes of array a (at most *budget of them) to s, whose
 * buffer holds cap. -1 when a is not an array of hashes. */
static int rc_set_append(rc_set *s, int cap, json_t *a, int *budget) {
    if (!json_is_array(a)) return -1;
    size_t n = json_array_size(a);
    for (size_t i = 0; i < n && *budget > 0 && s->n < cap; i++) {
        json_t *v = json_array_get(a, i);
        if (!json_is_string(v) || rc_hex(json_string_value(v), &s->h[s->n])) return -1;
        s->n++;
        (*budget)--;
    }
    return 0;
}

rc_report *rc_report_parse(json_t *p) {
    if (!json_is_object(p)) return NULL;
    json_t *blk = json_object_get(p, "block"), *seed = json_object_get(p, "seed");
    json_t *tiers = json_object_get(p, "tiers"), *peers = json_object_get(p, "peers");
    if (!json_is_integer(blk) || json_integer_value(blk) != PREFIX_HASH_BLOCK || !json_is_string(seed) ||
        !json_is_object(tiers) || (peers && !json_is_array(peers)))
        return NULL;
    rc_report *rep = calloc(1, sizeof *rep);
    if (!rep || rc_hex(json_string_value(seed), &rep->seed)) { free(rep); return NULL; }
    int budget = RC_HELD_MAX, bad = 0;
    if (!(rep->held.h = malloc(sizeof(uint64_t) * RC_HELD_MAX))) bad = 1;
    const char *k;
    json_t *v;
    json_object_foreach(tiers, k, v) {
        if (bad) break;
        bad = rc_set_append(&rep->held, RC_HELD_MAX, v, &budget);
    }
    rc_set_sort(&rep->held);
    for (size_t i = 0; !bad && i < json_array_size(peers) && rep->n_peer < RC_PEERS; i++) {
        json_t *o = json_array_get(peers, i);
        const char *addr = json_string_value(json_object_get(o, "addr"));
        if (!addr || strlen(addr) >= sizeof rep->peer[0].addr) { bad = 1; break; }
        rc_set *s = &rep->peer[rep->n_peer].s;
        snprintf(rep->peer[rep->n_peer].addr, sizeof rep->peer[0].addr, "%s", addr);
        rep->n_peer++;
        int pb = RC_PEER_MAX;
        if (!(s->h = malloc(sizeof(uint64_t) * RC_PEER_MAX))) { bad = 1; break; }
        bad = rc_set_append(s, RC_PEER_MAX, json_object_get(o, "hashes"), &pb);
        rc_set_sort(s);
    }
    if (bad) { rc_report_free(rep); return NULL; }
    return rep;
}

void rc_report_free(rc_report *rep) {
    if (!rep) return;
    free(rep->held.h);
    for (int i = 0; i < rep->n_peer; i++) free(rep->peer[i].s.h);
    free(rep);
}

static void rc_routed_clear(rc_routed *e) {
    free(e->h);
    memset(e, 0, sizeof *e);
}

static rc_node *rc_node_get(rt_node *n) {
    if (!n->cache) n->cache = calloc(1, sizeof *n->cache);
    return n->cache;
}

void rc_report_apply_locked(router *r, int i, rc_report *rep, double asked_ms) {
    rc_node *c = rc_node_get(&r->nodes[i]);
    if (!c) { rc_report_free(rep); return; }
    rc_report_free(c->rep);
    c->rep = rep;
    c->report_ms = asked_ms;
    /* a request that ended before the report was asked for is in the
     * report if the node still holds it */
    for (int k = 0; k < RC_ROUTED_MAX; k++)
        if (!c->routed[k].owner && c->routed[k].h && c->routed[k].done_ms <= asked_ms) rc_routed_clear(&c->routed[k]);
}

void rc_node_free_locked(rt_node *n) {
    if (!n->cache) return;
    rc_report_free(n->cache->rep);
    for (int k = 0; k < RC_ROUTED_MAX; k++) rc_routed_clear(&n->cache->routed[k]);
    free(n->cache);
    n->cache = NULL;
}

/* ==== A request's prompt ==== */

void rc_prompt_set(rt_req *q, int32_t *ids, int n) {
    rc_prompt_free(q);
    if (!ids) return;
    if (!(q->rcp = calloc(1, sizeof *q->rcp))) { free(ids); return; }
    q->rcp->ids = ids;
    q->rcp->n = n;
}

void rc_prompt_free(rt_req *q) {
    if (!q->rcp) return;
    for (int i = 0; i < q->rcp->n_seed; i++) free(q->rcp->s[i].h);
    free(q->rcp->ids);
    free(q->rcp);
    q->rcp = NULL;
}

/* q's block hashes under seed (NULL when unknown). */
static const uint64_t *rc_prompt_hashes(rt_req *q, uint64_t seed, int *nb) {
    rc_prompt *p = q->rcp;
    *nb = 0;
    if (!p) return NULL;
    for (int i = 0; i < p->n_seed; i++)
        if (p->s[i].seed == seed) { *nb = p->s[i].nb; return p->s[i].h; }
    if (p->n_seed == RC_SEEDS) return NULL;
    int max = p->n / PREFIX_HASH_BLOCK;
    if (max > RC_PROMPT_BLOCKS) max = RC_PROMPT_BLOCKS;
    uint64_t *h = malloc(sizeof *h * (size_t)(max > 0 ? max : 1));
    if (!h) return NULL;
    int k = prefix_hash_blocks(p->ids, p->n, PREFIX_HASH_BLOCK, seed, h, max);
    p->s[p->n_seed].seed = seed;
    p->s[p->n_seed].h = h;
    p->s[p->n_seed].nb = k > 0 ? k : 0;
    *nb = p->s[p->n_seed++].nb;
    return h;
}

/* ==== Matching ==== */

static int rc_fresh(const router *r, const rc_node *c, double now) {
    double stale = RC_STALE_INTERVALS * (double)r->cfg.health_interval_ms;
    if (stale < RC_STALE_MIN_MS) stale = RC_STALE_MIN_MS;
    return c->rep && now - c->report_ms <= stale;
}

/* Leading common hashes of two lists. */
static int rc_common(const uint64_t *a, int na, const uint64_t *b, int nb) {
    int k = 0;
    while (k < na && k < nb && a[k] == b[k]) k++;
    return k;
}

/* Is routed request e's prompt in the decode node's slots now? One that
 * went through a prefill node is there once its rows came (its first
 * token): till then a local prefill started beside it computes the prefix
 * again (bench_route: 2,116 positions per such pick). One prefilled there
 * is there from the start: the node prefills one slot after another and
 * reuses what the earlier one wrote. */
static int rc_routed_on_decode(const rc_routed *e) {
    return !e->owner || e->landed || !e->peer[0];
}

/* Of the sessions to one prefill node, m[0..n) what each holds of q's
 * prompt: the most held by a session no running handoff has taken. A
 * handoff whose prompt shares a block with q's took the session holding
 * the most of it (dn_peer_take) and keeps it until its rows are sent; a
 * split started meanwhile opens another session, which holds nothing of
 * what the busy one does (bench_route: the prefill node computed the
 * whole prompt again). */
static int rc_free_session(int *m, int n, int busy) {
    for (int b = 0; b < busy; b++) {
        int top = -1;
        for (int i = 0; i < n; i++)
            if (m[i] > 0 && (top < 0 || m[i] > m[top])) top = i;
        if (top < 0) break;
        m[top] = 0;
    }
    int best = 0;
    for (int i = 0; i < n; i++)
        if (m[i] > best) best = m[i];
    return best;
}

/* Positions of q's prompt decode node d holds (peer NULL), or that a free
 * session of its connections to the prefill node at peer holds; 0 when
 * unknown. */
static int rc_match_locked(rt_req *q, int d, const char *peer) {
    router *r = q->r;
    rc_node *c = r->nodes[d].cache;
    if (!r->cfg.cache_aware || !c || !c->rep || !q->rcp) return 0;   /* no report: the seed is unknown */
    int nb;
    const uint64_t *h = rc_prompt_hashes(q, c->rep->seed, &nb);
    if (!h || nb == 0) return 0;
    double now = rt_now_ms(), stale = RC_STALE_INTERVALS * (double)r->cfg.health_interval_ms;
    if (stale < RC_STALE_MIN_MS) stale = RC_STALE_MIN_MS;
    int m[RC_PEERS + RC_ROUTED_MAX], n = 0, busy = 0;
    if (rc_fresh(r, c, now)) {
        if (!peer) m[n++] = rc_set_match(&c->rep->held, h, nb);
        for (int i = 0; peer && i < c->rep->n_peer; i++)
            if (!strcmp(c->rep->peer[i].addr, peer)) m[n++] = rc_set_match(&c->rep->peer[i].s, h, nb);
    }
    for (int k = 0; k < RC_ROUTED_MAX; k++) {
        const rc_routed *e = &c->routed[k];
        if (!e->h || (peer && strcmp(e->peer, peer)) || (!e->owner && now - e->done_ms > stale)) continue;
        if (!peer && !rc_routed_on_decode(e)) continue;
        int mk = rc_common(e->h, e->n, h, nb);
        if (peer && e->owner && !e->landed) { busy += mk > 0; continue; }
        m[n++] = mk;
    }
    int best = rc_free_session(m, n, busy);
    /* the tail past the last full block has no hash: a prompt whose every
     * full block is held is taken as held whole (a repeated prompt); when
     * it is not, at most PREFIX_HASH_BLOCK - 1 positions are computed */
    return best == nb && nb > 0 ? q->rcp->n : best * PREFIX_HASH_BLOCK;
}

/* ==== Routing decisions ==== */

void rc_note_route_locked(rt_req *q, int d, int p) {
    router *r = q->r;
    rt_node *n = &r->nodes[d];
    if (!r->cfg.cache_aware || !q->rcp || !n->cache || !n->cache->rep) return;
    int nb;
    const uint64_t *h = rc_prompt_hashes(q, n->cache->rep->seed, &nb);
    if (!h || nb == 0) return;
    rc_node *c = n->cache;
    /* a free entry, else the oldest ended one, else the first */
    rc_routed *e = NULL;
    for (int k = 0; k < RC_ROUTED_MAX && !e; k++)
        if (!c->routed[k].h) e = &c->routed[k];
    for (int k = 0; k < RC_ROUTED_MAX && !e; k++)
        if (!c->routed[k].owner && (!e || c->routed[k].done_ms < e->done_ms)) e = &c->routed[k];
    if (!e) e = &c->routed[0];
    rc_routed_clear(e);
    if (!(e->h = malloc(sizeof *h * (size_t)nb))) return;
    memcpy(e->h, h, sizeof *h * (size_t)nb);
    e->n = nb;
    e->owner = q;
    snprintf(e->peer, sizeof e->peer, "%s", p >= 0 ? r->nodes[p].cfg.addr : "");
}

void rc_note_first_locked(rt_req *q, int d) {
    rc_node *c = q->r->nodes[d].cache;
    for (int k = 0; c && k < RC_ROUTED_MAX; k++)
        if (c->routed[k].owner == q) c->routed[k].landed = 1;
}

void rc_note_end_locked(rt_req *q, int d, int ok) {
    rc_node *c = q->r->nodes[d].cache;
    if (!c) return;
    for (int k = 0; k < RC_ROUTED_MAX; k++) {
        rc_routed *e = &c->routed[k];
        if (e->owner != q) continue;
        if (!ok) { rc_routed_clear(e); continue; }
        e->owner = NULL;
        e->done_ms = rt_now_ms();
    }
}

/* ==== The pick ==== */

/* Requests ahead of a new one on decode node n: the others' requests as of
 * its last report plus this router's in flight now (less ours, when
 * counted already). */
static int rc_ahead(const rt_node *n, int ours_counted) {
    int others = n->queue_depth - n->inflight_at_report;
    int ahead = (others > 0 ? others : 0) + n->inflight - (ours_counted ? 1 : 0);
    return ahead > 0 ? ahead : 0;
}

/* A split's cost beyond the prefill node's compute until measured: on a
 * LAN, the request's round trip and the decode node's last position. */
#define RC_SPLIT_OVERHEAD_MS 2.0

void rc_cost_in_locked(rt_req *q, int d, int p, int ours_counted, router_cost_in *in) {
    router *r = q->r;
    rt_node *dn = &r->nodes[d], *pn = p >= 0 ? &r->nodes[p] : NULL;
    *in = (router_cost_in){
        .n_prompt = q->n_prompt,
        .count_note = q->count_note,
        .decode_prefill_tps = dn->prefill_tps > 0 ? dn->prefill_tps : r->cfg.default_prefill_tps,
        .prefill_prefill_tps = pn && pn->prefill_tps > 0 ? pn->prefill_tps : r->cfg.default_prefill_tps,
        .decode_tps_assumed = !(dn->prefill_tps > 0),
        .prefill_tps_assumed = !(pn && pn->prefill_tps > 0),
        .link_bytes_per_s = pn && pn->link_Bps > 0 ? pn->link_Bps : r->cfg.link_gbps * 1e9 / 8,
        .kv_bytes_per_token = pn ? pn->kv_bytes_per_token : 0,
        .handoff_overhead_ms = pn && pn->overhead_ms > 0 ? pn->overhead_ms : RC_SPLIT_OVERHEAD_MS,
        .decode_queue = rc_ahead(dn, ours_counted),
        .prefill_queue = pn ? rt_node_load(pn) : 0,
        .have_prefill = pn != NULL,
        .policy = r->cfg.split,
        .min_split_tokens = r->cfg.min_split_tokens,
        .cached_decode = rc_match_locked(q, d, NULL),
        .cached_prefill = pn ? rc_match_locked(q, d, pn->cfg.addr) : 0,
    };
}

/* Within this of each other (ms, or 2% of the smaller), two estimates tie
 * and the capacity order decides: estimates are not finer than that. */
#define RC_TIE_MS 1.0
#define RC_TIE_FRAC 0.02

/* Do estimates a and b tie? */
static int rc_tie(double a, double b) {
    double lo = a < b ? a : b, tol = lo * RC_TIE_FRAC > RC_TIE_MS ? lo * RC_TIE_FRAC : RC_TIE_MS;
    return fabs(a - b) <= tol;
}

/* Is estimate a (node na) better than b (node nb)? */
static int rc_better(double a, const rt_node *na, double b, const rt_node *nb) {
    if (!rc_tie(a, b)) return a < b;
    return rt_node_better(na, nb);
}

int rc_prefill_fits(const rt_node *p, const rt_req *q) {
    return p->n_ctx <= 0 || q->n_prompt <= p->n_ctx;
}

/* The best plan for q on decode node d: its estimated prefill time, the
 * prefill node in *pidx (-1: local) and the decision in *dec. */
static double rc_plan_locked(rt_req *q, int d, int *pidx, router_decision *dec) {
    router *r = q->r;
    int best = -1, too_short = 0, best_cp = 0;
    double best_e = 0;
    router_decision bd;
    for (int i = 0; i < r->n_nodes; i++) {
        rt_node *p = &r->nodes[i];
        if (p->cfg.role != ROUTER_NODE_PREFILL || !p->up || strcmp(p->cfg.model, q->req.model)) continue;
        if (!rc_prefill_fits(p, q)) { too_short = 1; continue; }
        router_cost_in in;
        router_decision dd;
        rc_cost_in_locked(q, d, i, 0, &in);
        router_decide(&in, &dd);
        double e = dd.split ? dd.est_split_ms : dd.est_local_ms;
        /* on a tie, the prefill node that holds more of the prompt: a decode
         * node whose every full block matches may still lack the tail past
         * them (a prompt's last partial block has no hash), and then asks
         * the prefill node for it */
        int better = best < 0 || (rc_tie(e, best_e) && in.cached_prefill != best_cp ? in.cached_prefill > best_cp
                                                                                     : rc_better(e, p, best_e, &r->nodes[best]));
        if (better) { best = i; best_e = e; bd = dd; best_cp = in.cached_prefill; }
    }
    if (best < 0) {
        router_cost_in in;
        rc_cost_in_locked(q, d, -1, 0, &in);
        in.prefill_too_short = too_short;
        router_decide(&in, &bd);
        best_e = bd.est_local_ms;
    }
    *pidx = bd.split ? best : -1;
    *dec = bd;
    return best_e;
}

/* Expected wait for a slot on n (ms): none while one is free; else the
 * requests ahead of ours per slot times the time a request holds a slot
 * (a node's capacity, not its queue length alone). */
static double rc_wait_ms(const rt_node *n, double hold_ms) {
    int load = rc_ahead(n, 0), slots = rt_node_slots(n);
    if (load < slots) return 0;
    return (double)(load - slots + 1) / slots * hold_ms;
}

static int rc_candidate(const router *r, const rt_req *q, int i, const int *skip) {
    const rt_node *n = &r->nodes[i];
    return n->cfg.role == ROUTER_NODE_DECODE && n->up && !strcmp(n->cfg.model, q->req.model) && !(skip && skip[i]);
}

int rc_choose_locked(rt_req *q, const int *skip, int with_plan, int *pidx, router_decision *dec) {
    router *r = q->r;
    /* One slot hold time for every candidate: the mean of those measured.
     * It sets what a place in a queue costs against a prefill saved; the
     * per-node figures only add noise to the capacity order (measured on a
     * shared 2-core host, a 4-slot node's requests held their slots 3-3.7x
     * as long as a 1-slot node's, from one run to the next, the rest of the
     * host's load moving them both). */
    double hold = 0;
    int measured = 0;
    for (int i = 0; i < r->n_nodes; i++)
        if (rc_candidate(r, q, i, skip) && r->nodes[i].hold_ms > 0) { hold += r->nodes[i].hold_ms; measured++; }
    hold = measured ? hold / measured : RC_HOLD_DEFAULT_MS;
    int best = -1, best_p = -1;
    double best_t = 0;
    router_decision best_dec;
    memset(&best_dec, 0, sizeof best_dec);
    for (int i = 0; i < r->n_nodes; i++) {
        if (!rc_candidate(r, q, i, skip)) continue;
        rt_node *n = &r->nodes[i];
        /* a node whose last report says full comes after every node with
         * room (the report may be stale: it is still tried last) */
        double t = rc_wait_ms(n, hold) + (rt_node_full(n, 0) ? 1e12 : 0);
        int p = -1;
        router_decision dd;
        memset(&dd, 0, sizeof dd);
        double wait = t;
        if (with_plan) t += rc_plan_locked(q, i, &p, &dd);
        if (!r->cfg.quiet && log_enabled(LOGL_DEBUG))
            log_debug(q->rid, "pick: decode %s wait %.1f ms (ahead %d, %d slots, hold %.0f ms) + plan %.1f ms "
                      "(held %d of %d, %s%s) = %.1f ms", n->cfg.addr, wait, rc_ahead(n, 0), rt_node_slots(n), hold,
                      t - wait, with_plan ? rc_match_locked(q, i, NULL) : 0, q->n_prompt, dd.split ? "split" : "local",
                      p >= 0 ? " via prefill" : "", t);
        if (best < 0 || rc_better(t, n, best_t, &r->nodes[best])) { best = i; best_t = t; best_p = p; best_dec = dd; }
    }
    if (with_plan && best >= 0) { *pidx = best_p; *dec = best_dec; }
    return best;
}

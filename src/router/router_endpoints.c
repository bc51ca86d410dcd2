/* router_endpoints.c - the endpoints other than generation: /v1/models,
 * /health, /metrics, /tokenize and /detokenize (forwarded to a decode
 * node), and node registration (POST /v1/nodes/register).
 *
 * The rule of every router file: the registry, the measured rates and the
 * metrics live under one mutex (router.mu); no lock is held across I/O.
 */
#include "router/router_internal.h"
#include "router/router_nodes.h"
#include "router/router_chain.h"

/* ==== Other endpoints ==== */

/* The models a healthy decode node serves, each once. Caller holds mu. */
static int rt_served_models_locked(router *r, const char **ids) {
    int n = 0;
    for (int i = 0; i < r->n_nodes; i++) {
        if (r->nodes[i].cfg.role != ROUTER_NODE_DECODE || !r->nodes[i].up) continue;
        int dup = 0;
        for (int k = 0; k < n; k++) dup |= !strcmp(ids[k], r->nodes[i].cfg.model);
        if (!dup) ids[n++] = r->nodes[i].cfg.model;
    }
    return n;
}

/* A model object of api_render_model(s) with its layer-split prefill chains
 * (docs/layer-split.md) added as "prefill_chains": [{"chain": SPEC, "up":
 * bool, "desc": the members' slices}], only where the model has one: the
 * OpenAI shape is unchanged otherwise. Caller holds mu. */
static void rt_model_add_chains_locked(router *r, json_t *model) {
    const char *id = json_string_value(json_object_get(model, "id"));
    json_t *arr = NULL;
    for (int i = 0; id && i < r->n_nodes; i++) {
        const rt_node *n = &r->nodes[i];
        if (n->cfg.role != ROUTER_NODE_PREFILL || !chain_spec_is(n->cfg.addr) || strcmp(n->cfg.model, id)) continue;
        if (!arr) arr = json_array();
        json_array_append_new(arr, json_pack("{s:s, s:b, s:s}", "chain", n->cfg.addr, "up", n->up, "desc", n->desc));
    }
    if (arr) json_object_set_new(model, "prefill_chains", arr);
}

/* body (api_render_models' list or api_render_model's object) with every
 * model's chains; body itself where it cannot be parsed. Caller holds mu. */
static char *rt_models_with_chains_locked(router *r, char *body) {
    json_t *j = body ? json_loads(body, 0, NULL) : NULL;
    if (!j) return body;
    json_t *data = json_object_get(j, "data");
    if (json_is_array(data))
        for (size_t i = 0; i < json_array_size(data); i++) rt_model_add_chains_locked(r, json_array_get(data, i));
    else rt_model_add_chains_locked(r, j);
    char *out = json_dumps(j, JSON_COMPACT);
    json_decref(j);
    if (!out) return body;
    free(body);
    return out;
}

enum MHD_Result rt_models(router *r, struct MHD_Connection *c) {
    const char *ids[ROUTER_MAX_NODES];
    pthread_mutex_lock(&r->mu);
    int n = rt_served_models_locked(r, ids);
    char *body = rt_models_with_chains_locked(r, api_render_models(ids, n, r->started_unix));
    pthread_mutex_unlock(&r->mu);
    rt_count_request(r, RT_EP_MODELS, 200);
    return rt_send(c, 200, "application/json", body);
}

/* GET /v1/models/{id}: a model a healthy decode node serves, else 404. */
enum MHD_Result rt_model_one(router *r, struct MHD_Connection *c, const char *id) {
    const char *ids[ROUTER_MAX_NODES];
    char *body = NULL;
    pthread_mutex_lock(&r->mu);
    int n = rt_served_models_locked(r, ids);
    for (int i = 0; i < n && !body; i++)
        if (!strcmp(ids[i], id)) body = rt_models_with_chains_locked(r, api_render_model(id, r->started_unix));
    pthread_mutex_unlock(&r->mu);
    if (!body) {
        api_error e;
        api_error_set(&e, 404, "invalid_request_error", "model_not_found", "model",
                      "The model '%.200s' does not exist or you do not have access to it.", id);
        return rt_send_error(r, c, RT_EP_MODELS, &e);
    }
    rt_count_request(r, RT_EP_MODELS, 200);
    return rt_send(c, 200, "application/json", body);
}

static json_t *rt_node_json_base(const rt_node *n);

static json_t *rt_node_json(const rt_node *n) {
    json_t *o = rt_node_json_base(n);
    /* the pick's measured figures (router_cache.c, health checks) */
    json_object_set_new(o, "hold_ms", json_real(n->hold_ms));
    json_object_set_new(o, "probe_ms", json_real(n->probe_ms));
    json_object_set_new(o, "slots", json_integer(n->slots));
    json_object_set_new(o, "n_ctx", json_integer(n->n_ctx));
    return o;
}

static json_t *rt_node_json_base(const rt_node *n) {
    return json_pack("{s:s, s:s, s:s, s:b, s:b, s:i, s:i, s:f, s:f, s:f, s:f, s:I, s:I, s:s}",
                     "addr", n->cfg.addr, "role", n->cfg.role == ROUTER_NODE_DECODE ? "decode" : "prefill",
                     "model", n->cfg.model, "up", n->up, "registered", n->registered,
                     "inflight", n->inflight, "queue_depth", n->queue_depth,
                     "prefill_tps", n->prefill_tps, "decode_tps", n->decode_tps,
                     "kv_bytes_per_token", n->kv_bytes_per_token, "link_bytes_per_s", n->link_Bps,
                     "requests", (json_int_t)n->requests, "failures", (json_int_t)n->failures, "desc", n->desc);
}

/* Open to all as a liveness answer; the node list (addresses, files,
 * rates) only to a caller with the API key when one is set. */
enum MHD_Result rt_health(router *r, struct MHD_Connection *c) {
    int full = rt_key_ok(r, c);
    json_t *arr = json_array();
    int decode_up = 0;
    pthread_mutex_lock(&r->mu);
    for (int i = 0; i < r->n_nodes; i++) {
        if (!r->nodes[i].cfg.role) continue;   /* a free entry */
        if (full) json_array_append_new(arr, rt_node_json(&r->nodes[i]));
        decode_up += r->nodes[i].cfg.role == ROUTER_NODE_DECODE && r->nodes[i].up;
    }
    int active = r->active;
    pthread_mutex_unlock(&r->mu);
    const char *st = r->draining ? "draining" : decode_up ? "ok" : "unavailable";
    json_t *o = full ? json_pack("{s:s, s:s, s:i, s:o}", "status", st, "role", "router", "active_requests", active, "nodes", arr)
                     : json_pack("{s:s, s:s}", "status", st, "role", "router");
    if (!full) json_decref(arr);
    char *s = json_dumps(o, JSON_COMPACT);
    json_decref(o);
    int code = decode_up && !r->draining ? 200 : 503;   /* draining: a balancer should look elsewhere */
    rt_count_request(r, RT_EP_OTHER, code);
    return rt_send(c, code, "application/json", s);
}


/* The registry's text, with the gauges that live in the node registry
 * copied in first (under mu, so two scrapes do not interleave). */
enum MHD_Result rt_metrics_page(router *r, struct MHD_Connection *c) {
    rt_metrics *m = &r->m;
    pthread_mutex_lock(&r->mu);
    for (int k = 0; k < RT_NM_N; k++) metrics_clear(m->node[k]);
    for (int i = 0; i < r->n_nodes; i++) {
        const rt_node *n = &r->nodes[i];
        if (!n->cfg.role) continue;   /* a free entry */
        const char *lv[] = {n->cfg.addr, n->cfg.role == ROUTER_NODE_DECODE ? "decode" : "prefill", n->cfg.model};
        double v[RT_NM_N] = {n->up, n->inflight, n->queue_depth, n->prefill_tps, n->decode_tps, n->kv_bytes_per_token,
                             n->link_Bps, (double)n->requests, (double)n->failures};
        for (int k = 0; k < RT_NM_N; k++) metrics_set(m->node[k], lv, v[k]);
    }
    metrics_set(m->active, NULL, r->active);
    char *text = metrics_render(m->reg, NULL);
    pthread_mutex_unlock(&r->mu);
    rt_count_request(r, RT_EP_OTHER, text ? 200 : 500);
    return rt_send(c, text ? 200 : 500, METRICS_CONTENT_TYPE, text);
}

/* ==== /tokenize and /detokenize: forwarded to a decode node ==== */

/* Body bytes a /tokenize request may carry per context token: the decode
 * node's own bound (node_decode.c DN_TOK_BODY_PER_TOKEN, 24: above the
 * costliest realistic text, JSON-escaped non-Latin script at 6 bytes a
 * token), plus the JSON around a prompt (DN_TOK_BODY_SLACK). A body past
 * it cannot fit the context, and tokenizing costs a node about 53 bytes
 * of memory per input byte: refused unread (413). */
#define RT_TOK_BODY_PER_TOKEN 24
#define RT_TOK_BODY_SLACK (64u << 10)

static size_t rt_tok_cap_of(const router *r, int n_ctx) {
    if (n_ctx <= 0) return r->cfg.max_body_bytes;   /* a node that does not say: its own bound applies */
    size_t cap = (size_t)n_ctx * RT_TOK_BODY_PER_TOKEN + RT_TOK_BODY_SLACK;
    return cap < r->cfg.max_body_bytes ? cap : r->cfg.max_body_bytes;
}

size_t rt_tokenize_cap(router *r) {
    size_t cap = 0;
    int any = 0;
    pthread_mutex_lock(&r->mu);
    for (int i = 0; i < r->n_nodes; i++) {
        const rt_node *n = &r->nodes[i];
        if (n->cfg.role != ROUTER_NODE_DECODE || !n->up) continue;
        size_t c = rt_tok_cap_of(r, n->n_ctx);
        if (!any || c > cap) cap = c;
        any = 1;
    }
    pthread_mutex_unlock(&r->mu);
    return any ? cap : r->cfg.max_body_bytes;   /* none up: the request fails on its model anyway */
}

/* The decode node for a tokenizer request: "model" if given, else the only
 * model served; its context into *n_ctx. -1 with e filled. */
static int rt_tokens_node(router *r, json_t *o, char *addr, size_t addrlen, int *n_ctx, api_error *e) {
    json_t *mv = json_object_get(o, "model");
    const char *ids[ROUTER_MAX_NODES];
    if (mv && !json_is_null(mv) && !json_is_string(mv)) {
        api_error_set(e, 400, "invalid_request_error", "invalid_type", "model", "'model' must be a string.");
        return -1;
    }
    pthread_mutex_lock(&r->mu);
    int n = rt_served_models_locked(r, ids), idx = -1;
    const char *model = json_string_value(mv);
    if (!model && n == 1) model = ids[0];
    if (model) idx = rt_pick_locked(r, ROUTER_NODE_DECODE, model, NULL);
    if (idx >= 0) {
        snprintf(addr, addrlen, "%s", r->nodes[idx].cfg.addr);
        *n_ctx = r->nodes[idx].n_ctx;
    }
    pthread_mutex_unlock(&r->mu);
    if (idx >= 0) return 0;
    if (!model)
        api_error_set(e, n ? 400 : 503, n ? "invalid_request_error" : "server_error", n ? "missing_required_parameter" : "no_healthy_node",
                      n ? "model" : NULL, n ? "This router serves %d models: name one in 'model'." : "No healthy decode node (%d models).", n);
    else if (!rt_model_known(r, model))
        api_error_set(e, 404, "invalid_request_error", "model_not_found", "model",
                      "The model '%.200s' does not exist or you do not have access to it.", model);
    else
        api_error_set(e, 503, "server_error", "no_healthy_node", NULL, "No healthy decode node serves model '%.200s' right now.", model);
    return -1;
}

/* The forwarded call, once the request holds its share of max_concurrent. */
static enum MHD_Result rt_tokens_forward(router *r, struct MHD_Connection *c, rt_conn *cc, int detok) {
    api_error e;
    char addr[128];
    int n_ctx = 0;
    json_t *o = json_loadb(cc->body ? cc->body : "", cc->len, 0, NULL);
    if (!json_is_object(o)) {
        json_decref(o);
        api_error_set(&e, 400, "invalid_request_error", "invalid_json", NULL, "The request body must be a JSON object.");
        return rt_send_error(r, c, RT_EP_OTHER, &e);
    }
    int rc = rt_tokens_node(r, o, addr, sizeof addr, &n_ctx, &e);
    json_decref(o);
    if (rc) return rt_send_error(r, c, RT_EP_OTHER, &e);
    if (!detok && cc->len > rt_tok_cap_of(r, n_ctx)) {   /* the chosen node's context is smaller than the largest */
        api_error_set(&e, 413, "invalid_request_error", "request_too_large", NULL,
                      "The request body (%zu bytes) exceeds %zu bytes (what the model's context of %d tokens can hold).",
                      cc->len, rt_tok_cap_of(r, n_ctx), n_ctx);
        return rt_send_error(r, c, RT_EP_OTHER, &e);
    }
    strbuf b = {0};
    long st = rt_http_post(addr, detok ? "/v1/detokenize" : "/v1/tokenize", cc->body, cc->len, rt_node_key(r),
                           RT_REPLY_TOKENS, r->cfg.request_timeout_ms, &b);
    if (st <= 0 || !b.p) {
        free(b.p);
        api_error_set(&e, 502, "server_error", "upstream_failed", NULL, "Decode node %s did not answer.", addr);
        return rt_send_error(r, c, RT_EP_OTHER, &e);
    }
    rt_count_request(r, RT_EP_OTHER, (int)st);
    return rt_send(c, (int)st, "application/json", b.p);
}

/* POST /tokenize, /detokenize: a decode node does the work, so each holds
 * one of the router's max_concurrent requests while it runs (429 with
 * Retry-After past it, as for completions). */
enum MHD_Result rt_tokens(router *r, struct MHD_Connection *c, rt_conn *cc, int detok) {
    api_error e;
    if (cc->too_big) {
        api_error_set(&e, 413, "invalid_request_error", "request_too_large", NULL, "The request body exceeds %zu bytes%s.",
                      cc->limit, cc->limit < r->cfg.max_body_bytes ? " (what the decode nodes' context can hold)" : "");
        return rt_send_error(r, c, RT_EP_OTHER, &e);
    }
    pthread_mutex_lock(&r->mu);
    int over = r->active + 1 > r->cfg.max_concurrent;
    if (!over) r->active++;
    pthread_mutex_unlock(&r->mu);
    if (over) {
        api_error_set(&e, 429, "rate_limit_error", "too_many_requests", NULL,
                      "Too many concurrent requests (limit %d); retry later.", r->cfg.max_concurrent);
        return rt_send_error(r, c, RT_EP_OTHER, &e);
    }
    enum MHD_Result mr = rt_tokens_forward(r, c, cc, detok);
    pthread_mutex_lock(&r->mu);
    r->active--;
    pthread_mutex_unlock(&r->mu);
    return mr;
}

/* ==== Node registration ==== */

/* Adds or refreshes a node; returns its index or -1. Caller holds mu. */
int rt_node_upsert_locked(router *r, const router_node_cfg *cfg, int registered) {
    for (int i = 0; i < r->n_nodes; i++) {
        rt_node *n = &r->nodes[i];
        if (!strcmp(n->cfg.addr, cfg->addr) && n->cfg.role == cfg->role) {
            snprintf(n->cfg.model, sizeof n->cfg.model, "%s", cfg->model);
            if (registered) { n->registered = 1; n->last_heartbeat_ms = rt_now_ms(); }
            return i;
        }
    }
    int i = 0;
    while (i < r->n_nodes && r->nodes[i].cfg.role) i++;   /* a free entry (rt_node_forget_locked), else a new one */
    if (i >= ROUTER_MAX_NODES) return -1;
    rt_node *n = &r->nodes[i];
    memset(n, 0, sizeof *n);
    n->cfg = *cfg;
    n->registered = registered;
    n->last_heartbeat_ms = rt_now_ms();
    if (i == r->n_nodes) r->n_nodes++;
    return i;
}

/* A registered name or address ends up in URLs, metrics labels and logs:
 * printable, no spaces, no quotes or backslashes. */
static int rt_reg_token_ok(const char *s, size_t len, size_t max) {
    if (len == 0 || len >= max || strlen(s) != len) return 0;
    for (; *s; s++)
        if ((unsigned char)*s <= ' ' || *s == 0x7f || *s == '"' || *s == '\\') return 0;
    return 1;
}

/* A registered address is where health checks and signed calls go:
 * HOST:PORT and nothing else (issue 39 item 6: "127.0.0.1:80/admin?x=:1"
 * sent them to a path of the registrant's choosing). HOST is a name of
 * letters, digits, '-' and '.', a dotted IPv4 address, or an IPv6 address
 * in brackets; PORT is 1-65535. Link-local addresses (169.254.0.0/16, where
 * clouds serve instance metadata, and fe80::/10) and unspecified ones are
 * refused; with registration_addresses "private", so is every address
 * that is not loopback or private (10/8, 172.16/12, 192.168/16, fc00::/7),
 * and every name (it could resolve anywhere). 0, or -1 with a message. */
int router_check_addr(const char *a, int private_only, char *err, size_t errlen) {
    const char *colon = strrchr(a, ':');
    char host[128];
    if (!colon || colon == a || !colon[1] || strlen(colon + 1) > 5 || strspn(colon + 1, "0123456789") != strlen(colon + 1) ||
        atoi(colon + 1) < 1 || atoi(colon + 1) > 65535) {
        rt_errf(err, errlen, "\"addr\" must be HOST:PORT with a port of 1-65535");
        return -1;
    }
    size_t hl = (size_t)(colon - a);
    if (hl >= sizeof host) { rt_errf(err, errlen, "\"addr\" has a host over %zu bytes", sizeof host - 1); return -1; }
    int v6 = a[0] == '[';
    if (v6 ? hl < 3 || a[hl - 1] != ']' : 0) { rt_errf(err, errlen, "\"addr\" must be [IPV6]:PORT"); return -1; }
    if (v6) { memcpy(host, a + 1, hl - 2); host[hl - 2] = 0; }
    else { memcpy(host, a, hl); host[hl] = 0; }
    if (strspn(host, v6 ? "0123456789abcdefABCDEF:." : "0123456789abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ-.") != strlen(host)) {
        rt_errf(err, errlen, "\"addr\" must be HOST:PORT only (no path, query, fragment, user or spaces)");
        return -1;
    }
    unsigned char ip[16];
    if (v6 && inet_pton(AF_INET6, host, ip) != 1) { rt_errf(err, errlen, "\"addr\" has a bad IPv6 address"); return -1; }
    int is4 = !v6 && inet_pton(AF_INET, host, ip) == 1;
    if (!v6 && !is4) {
        if (host[0] == '-' || host[0] == '.' || strspn(host, "0123456789.") == strlen(host)) {
            rt_errf(err, errlen, "\"addr\" has a bad host name or IPv4 address");
            return -1;
        }
        if (private_only) {
            rt_errf(err, errlen, "\"addr\" must be a loopback or private IP address (registration_addresses is \"private\")");
            return -1;
        }
        return 0;
    }
    if (v6 && !memcmp(ip, "\0\0\0\0\0\0\0\0\0\0\xff\xff", 12)) { memmove(ip, ip + 12, 4); is4 = 1; v6 = 0; }   /* ::ffff:a.b.c.d */
    static const unsigned char zero[16];
    int link_local = is4 ? ip[0] == 169 && ip[1] == 254 : ip[0] == 0xfe && (ip[1] & 0xc0) == 0x80;
    int unspecified = !memcmp(ip, zero, is4 ? 4 : 16);
    if (link_local || unspecified) {
        rt_errf(err, errlen, "\"addr\" is a %s address", link_local ? "link-local" : "unspecified");
        return -1;
    }
    int priv = is4 ? ip[0] == 127 || ip[0] == 10 || (ip[0] == 172 && (ip[1] & 0xf0) == 16) || (ip[0] == 192 && ip[1] == 168)
                   : (!memcmp(ip, zero, 15) && ip[15] == 1) || (ip[0] & 0xfe) == 0xfc;
    if (private_only && !priv) {
        rt_errf(err, errlen, "\"addr\" must be a loopback or private IP address (registration_addresses is \"private\")");
        return -1;
    }
    return 0;
}

/* {"role", "model", "addr"} into *nc; 0, or -1 with a message. */
static int rt_reg_parse(const char *body, size_t len, int private_only, router_node_cfg *nc, int *leaving, char *err,
                        size_t errlen) {
    json_t *o = json_loadb(body ? body : "", len, JSON_REJECT_DUPLICATES, NULL);
    *leaving = json_is_true(json_object_get(o, "leaving"));
    json_t *role = json_object_get(o, "role"), *model = json_object_get(o, "model"), *addr = json_object_get(o, "addr");
    const char *rs = json_string_value(role), *a = json_string_value(addr);
    int rc = -1;
    memset(nc, 0, sizeof *nc);
    nc->role = rs && !strcmp(rs, "decode") ? ROUTER_NODE_DECODE : rs && !strcmp(rs, "prefill") ? ROUTER_NODE_PREFILL : 0;
    if (!json_is_object(o)) rt_errf(err, errlen, "the body must be a JSON object");
    else if (!nc->role) rt_errf(err, errlen, "\"role\" must be \"decode\" or \"prefill\"");
    else if (!json_is_string(model) || !rt_reg_token_ok(json_string_value(model), json_string_length(model), sizeof nc->model))
        rt_errf(err, errlen, "\"model\" must be a non-empty printable name without spaces, under %zu bytes", sizeof nc->model);
    else if (!json_is_string(addr) || !rt_reg_token_ok(a, json_string_length(addr), sizeof nc->addr))
        rt_errf(err, errlen, "\"addr\" must be HOST:PORT");
    else if (!router_check_addr(a, private_only, err, errlen)) {
        snprintf(nc->model, sizeof nc->model, "%s", json_string_value(model));
        snprintf(nc->addr, sizeof nc->addr, "%s", a);
        rc = 0;
    }
    json_decref(o);
    return rc;
}

/* POST /v1/nodes/register: signed (node_auth.h, registration key), never
 * replayed (nonce cache), never touching a statically configured node. */
enum MHD_Result rt_register(router *r, struct MHD_Connection *c, rt_conn *cc) {
    api_error e;
    char err[256];
    if (!r->have_secret) {
        api_error_set(&e, 404, "invalid_request_error", NULL, NULL, "Node registration is off (the router has no shared secret).");
        return rt_send_error(r, c, RT_EP_OTHER, &e);
    }
    if (node_auth_check_request(c, &r->reg_key, r->reg_replay, "POST", "/v1/nodes/register", cc->body ? cc->body : "",
                                cc->len, err, sizeof err)) {
        api_error_set(&e, 401, "invalid_request_error", "invalid_signature", NULL, "Registration refused: %s.", err);
        return rt_send_error(r, c, RT_EP_OTHER, &e);
    }
    router_node_cfg nc;
    int leaving = 0;
    if (rt_reg_parse(cc->body, cc->len, r->cfg.reg_private_only, &nc, &leaving, err, sizeof err)) {
        api_error_set(&e, 400, "invalid_request_error", NULL, NULL, "Bad registration: %s.", err);
        return rt_send_error(r, c, RT_EP_OTHER, &e);
    }
    const char *role = nc.role == ROUTER_NODE_DECODE ? "decode" : "prefill";
    pthread_mutex_lock(&r->mu);
    int i = -1, is_static = 0;
    for (int k = 0; k < r->n_nodes; k++)
        if (r->nodes[k].cfg.role == nc.role && !strcmp(r->nodes[k].cfg.addr, nc.addr)) i = k;
    is_static = i >= 0 && !r->nodes[i].registered;
    if (leaving && !is_static) {   /* a draining node: no new request; removed once its requests are done */
        if (i >= 0) rt_ops_node_leaves_locked(r, i);
        pthread_mutex_unlock(&r->mu);
        rt_count_request(r, RT_EP_OTHER, 200);
        return rt_send(c, 200, "application/json", strdup("{\"status\":\"ok\"}"));
    }
    int was_new = i < 0;
    if (!is_static) i = rt_node_upsert_locked(r, &nc, 1);
    pthread_mutex_unlock(&r->mu);
    if (is_static) {
        api_error_set(&e, 409, "invalid_request_error", "static_node", NULL,
                      "The %s node %s is in the router's configuration; a registration cannot change it.", role, nc.addr);
        return rt_send_error(r, c, RT_EP_OTHER, &e);
    }
    if (i < 0) {
        api_error_set(&e, 503, "server_error", NULL, NULL, "Node table full.");
        return rt_send_error(r, c, RT_EP_OTHER, &e);
    }
    if (was_new) log_info(NULL, "node %s (%s, model %s) registered", nc.addr, role, nc.model);
    pthread_cond_broadcast(&r->cv);   /* probe it now */
    rt_count_request(r, RT_EP_OTHER, 200);
    return rt_send(c, 200, "application/json", strdup("{\"status\":\"ok\"}"));
}

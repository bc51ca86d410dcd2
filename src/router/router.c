/* router.c - `tandem serve --role router` (see router.h, docs/router.md).
 *
 * Threads: libmicrohttpd runs one thread per client connection; a request's
 * whole life (choosing nodes, talking to the decode node through a libcurl
 * multi handle, streaming SSE back) runs on that thread. One health thread
 * checks every node each health_interval_ms. The registry, the measured
 * rates and the metrics live under one mutex; no lock is held across I/O.
 * The router's other files: router_internal.h.
 */
#include "router/router.h"
#include "router/router_internal.h"
#include "router/router_cache.h"
#include "router/router_batch.h"
#include "router/router_endpoints.h"
#include "router/router_nodes.h"
#include "router/router_responses.h"
#include "router/router_web.h"

/* ==== Small helpers ==== */

double rt_now_ms(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return ts.tv_sec * 1e3 + ts.tv_nsec / 1e6;
}

void rt_errf(char *err, size_t errlen, const char *fmt, ...) {
    if (!err || !errlen) return;
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(err, errlen, fmt, ap);
    va_end(ap);
}

/* Exponentially weighted moving average; the first sample is taken as is. */
void rt_ewma(double *avg, double x) {
    if (!(x > 0) || !isfinite(x)) return;
    *avg = *avg > 0 ? 0.7 * *avg + 0.3 * x : x;
}

/* ==== Metrics ==== */

static const char *const rt_lbl_model[] = {"model", NULL};

static int rt_metrics_counters(rt_metrics *m, char *err, size_t errlen) {
    metrics *g = m->reg;
    return !(m->requests = metrics_counter(g, "tandem_router_requests_total", "HTTP requests answered, by endpoint and status.",
                                           (const char *[]){"endpoint", "status", NULL}, err, errlen)) ||
           !(m->decisions = metrics_counter(g, "tandem_router_decisions_total",
                                            "Routing decisions: split (prefill node) or local, and why; only pairs that occurred.",
                                            (const char *[]){"decision", "reason", NULL}, err, errlen)) ||
           !(m->served = metrics_counter(g, "tandem_router_prefill_total",
                                         "Completed requests by where the prompt was actually prefilled.",
                                         (const char *[]){"mode", NULL}, err, errlen)) ||
           !(m->fallbacks = metrics_counter(g, "tandem_router_prefill_fallbacks_total",
                                            "Split requests whose decode node fell back to local prefill.", NULL, err, errlen)) ||
           !(m->retries = metrics_counter(g, "tandem_router_retries_total",
                                          "Attempts retried on another decode node.", NULL, err, errlen)) ||
           !(m->cancels = metrics_counter(g, "tandem_router_cancelled_total",
                                          "Generation requests whose client went away.", NULL, err, errlen)) ||
           !(m->stream_errors = metrics_counter(g, "tandem_router_stream_errors_total",
                                                "Streams that ended with an error event after the first token.", NULL, err, errlen)) ||
           !(m->prompt_tokens = metrics_counter(g, "tandem_router_prompt_tokens_total",
                                                "Prompt tokens of completed requests.", NULL, err, errlen)) ||
           !(m->completion_tokens = metrics_counter(g, "tandem_router_completion_tokens_total",
                                                    "Generated tokens of completed requests.", NULL, err, errlen)) ||
           !(m->kv_bytes = metrics_counter(g, "tandem_router_kv_bytes_total",
                                           "KV cache bytes handed from prefill to decode nodes (split requests).", NULL, err, errlen)) ||
           !(m->wire_bytes = metrics_counter(g, "tandem_router_wire_bytes_total",
                                             "Bytes those handoffs put on the wire.", NULL, err, errlen)) ||
           !(m->active = metrics_gauge(g, "tandem_router_active_requests", "Generation requests in flight.", NULL, err, errlen));
}

static int rt_metrics_histograms(rt_metrics *m, char *err, size_t errlen) {
    metrics *g = m->reg;
    return !(m->e2e = metrics_histogram(g, "tandem_router_request_duration_seconds",
                                        "End-to-end time of a generation request, arrival to last byte, by outcome (ok, error, cancelled).",
                                        (const char *[]){"model", "outcome", NULL}, metrics_buckets_latency, METRICS_N_LATENCY,
                                        err, errlen)) ||
           !(m->queue = metrics_histogram(g, "tandem_router_queue_seconds",
                                          "Time a completed request waited in its decode node's queue, as the node reports it.",
                                          rt_lbl_model, metrics_buckets_latency, METRICS_N_LATENCY, err, errlen)) ||
           !(m->ttft = metrics_histogram(g, "tandem_router_ttft_seconds", "Time to first token seen by the router.",
                                         rt_lbl_model, metrics_buckets_latency, METRICS_N_LATENCY, err, errlen)) ||
           !(m->tpot = metrics_histogram(g, "tandem_router_tpot_seconds", "Time per output token after the first.",
                                         rt_lbl_model, metrics_buckets_fast, METRICS_N_FAST, err, errlen)) ||
           !(m->transfer = metrics_histogram(g, "tandem_router_kv_transfer_seconds",
                                             "KV handoff time exposed to the request (split only).",
                                             rt_lbl_model, metrics_buckets_fast, METRICS_N_FAST, err, errlen));
}

static int rt_metrics_node_families(rt_metrics *m, char *err, size_t errlen) {
    static const struct { const char *name, *help; int counter; } d[RT_NM_N] = {
        {"tandem_node_up", "1 if the node passed its last health check.", 0},
        {"tandem_node_inflight", "This router's requests on the node now.", 0},
        {"tandem_node_queue_depth", "Requests running and waiting on the node, as it last reported.", 0},
        {"tandem_node_prefill_tokens_per_second", "Measured prefill speed (moving average).", 0},
        {"tandem_node_decode_tokens_per_second", "Measured decode speed (moving average).", 0},
        {"tandem_node_kv_bytes_per_token", "KV cache bytes per prompt token handed off (prefill nodes).", 0},
        {"tandem_node_link_bytes_per_second", "Measured handoff link rate, a lower bound (prefill nodes).", 0},
        {"tandem_node_requests_total", "Requests this router sent to the node.", 1},
        {"tandem_node_failures_total", "Requests or checks of the node that failed.", 1},
    };
    static const char *const lbl[] = {"node", "role", "model", NULL};
    for (int k = 0; k < RT_NM_N; k++) {
        m->node[k] = d[k].counter ? metrics_counter(m->reg, d[k].name, d[k].help, lbl, err, errlen)
                                  : metrics_gauge(m->reg, d[k].name, d[k].help, lbl, err, errlen);
        if (!m->node[k]) return -1;
    }
    return 0;
}

/* 0, or -1 with err (a bad family definition or out of memory). */
static int rt_metrics_init(rt_metrics *m, char *err, size_t errlen) {
    if (!(m->reg = metrics_new())) { rt_errf(err, errlen, "out of memory"); return -1; }
    if (rt_metrics_counters(m, err, errlen) || rt_metrics_histograms(m, err, errlen) ||
        rt_metrics_node_families(m, err, errlen))
        return -1;
    /* the generation endpoints' success series exist from the start */
    metrics_touch(m->requests, (const char *[]){"chat", "200"});
    metrics_touch(m->requests, (const char *[]){"completions", "200"});
    return 0;
}

void rt_count_request(router *r, int ep, int status) {
    char st[8];
    snprintf(st, sizeof st, "%d", status >= 100 && status <= 599 ? status : 0);
    metrics_add(r->m.requests, (const char *[]){rt_ep_names[ep], st}, 1);
}


/* ==== HTTP plumbing ==== */

/* A response of body (taken) with its Content-Type, and Retry-After on a
 * 429 or 503 (the client may come back: full, or no node up yet). */
static struct MHD_Response *rt_response(int *status, const char *ctype, char *body) {
    if (!body) {
        *status = 500;
        body = strdup("{\"error\":{\"message\":\"out of memory\",\"type\":\"server_error\",\"param\":null,\"code\":null}}");
        if (!body) return NULL;
    }
    struct MHD_Response *resp = MHD_create_response_from_buffer(strlen(body), body, MHD_RESPMEM_MUST_FREE);
    if (!resp) { free(body); return NULL; }
    MHD_add_response_header(resp, "Content-Type", ctype);
    if (*status == 429 || *status == 503) MHD_add_response_header(resp, "Retry-After", RT_RETRY_AFTER);
    return resp;
}

struct MHD_Response *rt_response_json(int status, char *body) { return rt_response(&status, "application/json", body); }

enum MHD_Result rt_send(struct MHD_Connection *c, int status, const char *ctype, char *body) {
    struct MHD_Response *resp = rt_response(&status, ctype, body);
    if (!resp) return MHD_NO;
    enum MHD_Result rc = MHD_queue_response(c, (unsigned)status, resp);
    MHD_destroy_response(resp);
    return rc;
}

enum MHD_Result rt_send_error(router *r, struct MHD_Connection *c, int ep, const api_error *e) {
    rt_count_request(r, ep, e->status);
    return rt_send(c, e->status, "application/json", api_error_json(e));
}

int rt_client_fd(struct MHD_Connection *c) {
    const union MHD_ConnectionInfo *ci = MHD_get_connection_info(c, MHD_CONNECTION_INFO_CONNECTION_FD);
    return ci ? ci->connect_fd : -1;
}

void rt_client_addr(struct MHD_Connection *c, char *out, size_t n) {
    const union MHD_ConnectionInfo *ci = MHD_get_connection_info(c, MHD_CONNECTION_INFO_CLIENT_ADDRESS);
    const struct sockaddr *sa = ci ? ci->client_addr : NULL;
    out[0] = 0;
    if (sa && sa->sa_family == AF_INET) inet_ntop(AF_INET, &((const struct sockaddr_in *)sa)->sin_addr, out, (socklen_t)n);
    else if (sa && sa->sa_family == AF_INET6) inet_ntop(AF_INET6, &((const struct sockaddr_in6 *)sa)->sin6_addr, out, (socklen_t)n);
}

/* ==== Request dispatch ==== */

static int rt_route(const char *method, const char *url, int *ep, int *post) {
    *post = !strcmp(method, "POST");
    if (!strcmp(url, "/v1/chat/completions")) { *ep = RT_EP_CHAT; return 1; }
    if (!strcmp(url, "/v1/completions")) { *ep = RT_EP_COMPLETIONS; return 1; }
    if (!strcmp(url, "/v1/responses")) { *ep = RT_EP_RESPONSES; return 1; }
    if (!strcmp(url, "/v1/nodes/register") || !strcmp(url, "/tokenize") || !strcmp(url, "/detokenize")) {
        *ep = RT_EP_OTHER;
        return 1;
    }
    *ep = !strncmp(url, "/v1/models", 10) ? RT_EP_MODELS : RT_EP_OTHER;
    return 0;   /* GET endpoints */
}

/* 1 when no API key is set or c's request carries it. */
int rt_key_ok(router *r, struct MHD_Connection *c) {
    if (!r->cfg.api_key[0]) return 1;
    const char *h = MHD_lookup_connection_value(c, MHD_HEADER_KIND, "Authorization");
    size_t kl = strlen(r->cfg.api_key);
    return h && !strncmp(h, "Bearer ", 7) && strlen(h + 7) == kl && !CRYPTO_memcmp(h + 7, r->cfg.api_key, kl);
}

/* /health is open (a liveness answer; rt_health shows the node list only
 * to a caller with the key), /metrics too unless metrics_auth, and a
 * registration is signed with the shared secret instead. */
static int rt_authorized(router *r, struct MHD_Connection *c, const char *url) {
    /* the chat page itself is public: it asks for the key (router_web.c) */
    if (!strcmp(url, "/") || !strncmp(url, "/health", 7) || (!strcmp(url, "/metrics") && !r->cfg.metrics_auth) ||
        !strcmp(url, "/v1/nodes/register"))
        return 1;
    return rt_key_ok(r, c);
}

/* First call for a connection's request: checks that need no body. */
static enum MHD_Result rt_first_call(router *r, struct MHD_Connection *c, const char *url, const char *method,
                                     void **con_cls) {
    int ep, post;
    int is_post_ep = rt_route(method, url, &ep, &post);
    api_error e;
    if (!rt_authorized(r, c, url)) {
        api_error_set(&e, 401, "invalid_request_error", "invalid_api_key", NULL,
                      "Incorrect or missing API key: send 'Authorization: Bearer <key>'.");
        return rt_send_error(r, c, ep, &e);
    }
    if (r->draining && is_post_ep && ep != RT_EP_OTHER) {   /* a kept-alive client's next request while draining */
        api_error_set(&e, 503, "server_error", "shutting_down", NULL, "The router is shutting down; retry on another.");
        return rt_send_error(r, c, ep, &e);
    }
    int known_get = !strcmp(url, "/v1/models") || (!strncmp(url, "/v1/models/", 11) && url[11]) ||
                    !strcmp(url, "/health") || !strcmp(url, "/metrics") || !strcmp(url, "/");
    if (!is_post_ep && !known_get) {
        api_error_set(&e, 404, "invalid_request_error", "unknown_url", NULL, "Unknown request URL: %s %.100s.", method, url);
        return rt_send_error(r, c, ep, &e);
    }
    if (is_post_ep != post || (!post && strcmp(method, "GET") && strcmp(method, "HEAD"))) {
        api_error_set(&e, 405, "invalid_request_error", "method_not_allowed", NULL,
                      "Method %s is not allowed for %.100s.", method, url);
        return rt_send_error(r, c, ep, &e);
    }
    const char *cl = MHD_lookup_connection_value(c, MHD_HEADER_KIND, "Content-Length");
    size_t limit = !strcmp(url, "/tokenize") ? rt_tokenize_cap(r) : r->cfg.max_body_bytes;
    if (post && cl && strtoull(cl, NULL, 10) > limit) {
        api_error_set(&e, 413, "invalid_request_error", "request_too_large", NULL,
                      "The request body (%s bytes) exceeds %zu bytes%s.", cl, limit,
                      limit < r->cfg.max_body_bytes ? " (what the decode nodes' context can hold)" : "");
        return rt_send_error(r, c, ep, &e);
    }
    rt_conn *cc = calloc(1, sizeof *cc);
    if (!cc) return MHD_NO;
    cc->ep = ep;
    cc->limit = limit;
    *con_cls = cc;
    return MHD_YES;
}

static enum MHD_Result rt_handler(void *cls, struct MHD_Connection *c, const char *url, const char *method,
                                  const char *version, const char *upload_data, size_t *upload_size, void **con_cls) {
    router *r = cls;
    if (!*con_cls) return rt_first_call(r, c, url, method, con_cls);
    rt_conn *cc = *con_cls;
    if (*upload_size) {
        if (!cc->too_big && cc->len + *upload_size > cc->limit) {
            cc->too_big = 1;
            free(cc->body);
            cc->body = NULL;
            cc->len = cc->cap = 0;
        }
        if (!cc->too_big) {
            if (cc->len + *upload_size + 1 > cc->cap) {
                size_t cap = cc->cap ? cc->cap : 4096;
                while (cap < cc->len + *upload_size + 1) cap *= 2;
                char *b = realloc(cc->body, cap);
                if (!b) return MHD_NO;
                cc->body = b;
                cc->cap = cap;
            }
            memcpy(cc->body + cc->len, upload_data, *upload_size);
            cc->len += *upload_size;
            cc->body[cc->len] = 0;
        }
        *upload_size = 0;
        return MHD_YES;
    }
    if (cc->handled) return MHD_YES;
    cc->handled = 1;
    if (!strcmp(url, "/v1/models")) return rt_models(r, c);
    if (!strncmp(url, "/v1/models/", 11)) return rt_model_one(r, c, url + 11);
    if (!strcmp(url, "/tokenize") || !strcmp(url, "/detokenize")) return rt_tokens(r, c, cc, url[1] == 'd');
    if (!strcmp(url, "/health")) return rt_health(r, c);
    if (!strcmp(url, "/metrics")) return rt_metrics_page(r, c);
    if (!strcmp(url, "/")) return rt_web_page(r, c);
    if (!strcmp(url, "/v1/nodes/register")) return rt_register(r, c, cc);
    return rt_generate(r, c, cc);
}

static void rt_completed(void *cls, struct MHD_Connection *c, void **con_cls, enum MHD_RequestTerminationCode tc) {
    rt_conn *cc = *con_cls;
    if (!cc) return;
    rt_responses_free(cc->responses);
    free(cc->body);
    free(cc);
    *con_cls = NULL;
}

/* ==== Start / stop ==== */

static int rt_bind_addr(const char *listen, struct sockaddr_storage *ss, socklen_t *sl, int *v6, char *err, size_t errlen) {
    char host[128], port[16];
    const char *colon = strrchr(listen, ':');
    if (!colon || (size_t)(colon - listen) >= sizeof host || strlen(colon + 1) >= sizeof port || !colon[1]) {
        rt_errf(err, errlen, "listen address must be HOST:PORT, got \"%s\"", listen);
        return -1;
    }
    memcpy(host, listen, (size_t)(colon - listen));
    host[colon - listen] = 0;
    snprintf(port, sizeof port, "%s", colon + 1);
    char *h = host;
    if (h[0] == '[') { h++; char *e = strchr(h, ']'); if (e) *e = 0; }
    if (!*h) h = "127.0.0.1";   /* loopback unless told otherwise */
    struct addrinfo hints = {.ai_socktype = SOCK_STREAM, .ai_flags = AI_PASSIVE | AI_NUMERICSERV}, *res = NULL;
    int rc = getaddrinfo(h, port, &hints, &res);
    if (rc || !res) { rt_errf(err, errlen, "cannot resolve %s: %s", listen, gai_strerror(rc)); return -1; }
    memcpy(ss, res->ai_addr, res->ai_addrlen);
    *sl = res->ai_addrlen;
    *v6 = res->ai_family == AF_INET6;
    freeaddrinfo(res);
    return 0;
}

int router_start(router **out, const router_config *cfg, char *err, size_t errlen) {
    *out = NULL;
    router *r = calloc(1, sizeof *r);
    if (!r) { rt_errf(err, errlen, "out of memory"); return -1; }
    r->cfg = *cfg;
    r->cfg.secret = NULL;
    if (cfg->secret && !(r->cfg.secret = malloc(cfg->secret_len + 1))) { free(r); rt_errf(err, errlen, "out of memory"); return -1; }
    if (cfg->secret) { memcpy(r->cfg.secret, cfg->secret, cfg->secret_len); r->cfg.secret[cfg->secret_len] = 0; }
    r->have_secret = cfg->secret && cfg->secret_len;
    if (r->have_secret) {
        node_auth_derive(&r->api_key, cfg->secret, cfg->secret_len, NODE_AUTH_LABEL_DECODE_API);
        node_auth_derive(&r->reg_key, cfg->secret, cfg->secret_len, NODE_AUTH_LABEL_REGISTER);
    }
    pthread_mutex_init(&r->mu, NULL);
    pthread_cond_init(&r->cv, NULL);
    r->started_unix = (long long)time(NULL);
    if (r->have_secret && !(r->reg_replay = node_auth_replay_new(0))) { rt_errf(err, errlen, "out of memory"); router_stop(r); return -1; }
    if (rt_metrics_init(&r->m, err, errlen)) { router_stop(r); return -1; }
    for (int i = 0; i < cfg->n_nodes; i++) rt_node_upsert_locked(r, &cfg->nodes[i], 0);
    curl_global_init(CURL_GLOBAL_DEFAULT);
    struct sockaddr_storage ss;
    socklen_t sl;
    int v6 = 0;
    if (rt_bind_addr(cfg->listen, &ss, &sl, &v6, err, errlen)) { router_stop(r); return -1; }
    (void)v6;
    char herr[200];
    int fd = httpd_listen((struct sockaddr *)&ss, sl, herr, sizeof herr);
    if (fd < 0) { rt_errf(err, errlen, "%s: %s", cfg->listen, herr); router_stop(r); return -1; }
    /* Connections beyond the concurrent-request limit still get a 429 answer
     * and GET /health, /metrics keep working: the connection limit is far
     * above max_concurrent (httpd.h has the slow-client defences). */
    unsigned conn_limit = (unsigned)cfg->max_conns;
    if (conn_limit < (unsigned)cfg->max_concurrent * 2 + 16) conn_limit = (unsigned)cfg->max_concurrent * 2 + 16;
    /* A fair share per address by default: a 16th of the pool (64 of the
     * default 1024), and httpd's per-/24 share (half the pool) and
     * slow-stranger eviction behind it. */
    unsigned per_ip = cfg->max_conns_per_ip > 0 ? (unsigned)cfg->max_conns_per_ip : conn_limit / 16;
    httpd_limits lim = { .max_conns = conn_limit, .max_conns_per_ip = per_ip,
                         .request_deadline_ms = cfg->request_deadline_ms, .idle_timeout_s = 60 };
    if (httpd_start(&r->http, &lim, fd, rt_handler, r, rt_completed, r, herr, sizeof herr)) {
        rt_errf(err, errlen, "%s: %s", cfg->listen, herr);
        router_stop(r);
        return -1;
    }
    r->port = httpd_port(r->http);
    rt_health_round(r, 1);   /* know who is up before the first request */
    if (rt_ops_check_secret(r, err, errlen)) { router_stop(r); return -1; }   /* a mismatch is found now, not as 502s */
    if (pthread_create(&r->health, NULL, rt_health_main, r)) { rt_errf(err, errlen, "cannot start the health thread"); router_stop(r); return -1; }
    r->health_started = 1;
    *out = r;
    return 0;
}

int router_port(const router *r) { return r ? r->port : -1; }

void router_stop(router *r) {
    if (!r) return;
    pthread_mutex_lock(&r->mu);
    r->stopping = 1;
    pthread_cond_broadcast(&r->cv);
    pthread_mutex_unlock(&r->mu);
    if (r->health_started) pthread_join(r->health, NULL);
    httpd_stop(r->http);
    for (int i = 0; i < r->n_nodes; i++) rc_node_free_locked(&r->nodes[i]);
    router_config_free(&r->cfg);
    node_auth_replay_free(r->reg_replay);
    metrics_free(r->m.reg);
    node_auth_wipe(&r->api_key);
    node_auth_wipe(&r->reg_key);
    pthread_cond_destroy(&r->cv);
    pthread_mutex_destroy(&r->mu);
    free(r);
    curl_global_cleanup();
}

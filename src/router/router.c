/* router.c - `tandem serve --role router` (see router.h, docs/router.md).
 *
 * Threads: libmicrohttpd runs one thread per client connection; a request's
 * whole life (choosing nodes, talking to the decode node through a libcurl
 * multi handle, streaming SSE back) runs on that thread. One health thread
 * checks every node each health_interval_ms. The registry, the measured
 * rates and the metrics live under one mutex; no lock is held across I/O.
 */
#include "router/router.h"

#include <arpa/inet.h>
#include <curl/curl.h>
#include <errno.h>
#include <jansson.h>
#include <math.h>
#include <microhttpd.h>
#include <netdb.h>
#include <openssl/crypto.h>
#include <openssl/evp.h>
#include <openssl/hmac.h>
#include <poll.h>
#include <pthread.h>
#include <signal.h>
#include <stdatomic.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <time.h>
#include <unistd.h>

#include "base/cliopt.h"
#include "net/httpd.h"
#include "base/log.h"
#include "base/logsafe.h"
#include "base/metrics.h"
#include "net/node_auth.h"
#include "net/prefill_rate.h"
#include "base/strbuf.h"
#include "api/tools.h"
#include "net/wire.h"

/* ==== Small helpers ==== */

static double rt_now_ms(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return ts.tv_sec * 1e3 + ts.tv_nsec / 1e6;
}

static void rt_errf(char *err, size_t errlen, const char *fmt, ...) __attribute__((format(printf, 3, 4)));
static void rt_errf(char *err, size_t errlen, const char *fmt, ...) {
    if (!err || !errlen) return;
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(err, errlen, fmt, ap);
    va_end(ap);
}

/* Exponentially weighted moving average; the first sample is taken as is. */
static void rt_ewma(double *avg, double x) {
    if (!(x > 0) || !isfinite(x)) return;
    *avg = *avg > 0 ? 0.7 * *avg + 0.3 * x : x;
}

/* ==== Config ==== */

void router_config_default(router_config *c) {
    memset(c, 0, sizeof *c);
    snprintf(c->listen, sizeof c->listen, "127.0.0.1:8000");
    c->split = ROUTER_SPLIT_AUTO;
    c->min_split_tokens = 32;          /* below this a handoff's fixed cost dominates */
    c->link_gbps = 10.0;               /* a datacentre link until measured */
    c->default_prefill_tps = 500.0;    /* order of magnitude of a CPU node on a small model */
    /* Counting a prompt's tokens on a decode node is one local HTTP round
     * trip and a tokenizer pass (well under 10 ms for 4k tokens); past this
     * the router estimates from bytes and says so in the decision. */
    c->tokenize_timeout_ms = 500;
    api_limits_default(&c->lim);
    c->max_body_bytes = 1 << 20;       /* 1 MiB: far above max_prompt_bytes + JSON overhead */
    c->max_concurrent = 64;
    c->request_timeout_ms = 300000;
    c->idle_timeout_ms = 30000;
    c->connect_timeout_ms = 2000;
    c->max_attempts = 3;
    c->health_interval_ms = 1000;
    c->down_after = 2;                 /* one lost probe is noise; two is a node in trouble */
    c->heartbeat_ttl_ms = 5000;
    /* HTTP server (httpd.h): room for many slow or idle clients beside the
     * real work; one address gets a quarter of it; 30 s to send a request
     * (a 1 MiB body at ~35 KB/s). */
    c->max_conns = 1024;
    c->max_conns_per_ip = 256;
    c->request_deadline_ms = 30000;
}

void router_config_free(router_config *c) {
    if (c->secret) { OPENSSL_cleanse(c->secret, c->secret_len); free(c->secret); }
    c->secret = NULL;
    c->secret_len = 0;
}

int router_config_add_node(router_config *c, const char *role, const char *model, const char *addr,
                           char *err, size_t errlen) {
    int r = !strcmp(role, "decode") ? ROUTER_NODE_DECODE : !strcmp(role, "prefill") ? ROUTER_NODE_PREFILL : 0;
    if (!r) { rt_errf(err, errlen, "node role must be \"decode\" or \"prefill\", not \"%s\"", role); return -1; }
    if (!model || !*model || strlen(model) >= sizeof c->nodes[0].model) {
        rt_errf(err, errlen, "node %s: missing or too long model name", addr ? addr : "?");
        return -1;
    }
    if (!addr || !*addr || strlen(addr) >= sizeof c->nodes[0].addr || !strchr(addr, ':')) {
        rt_errf(err, errlen, "node address must be HOST:PORT, got \"%s\"", addr ? addr : "");
        return -1;
    }
    if (c->n_nodes >= ROUTER_MAX_NODES) { rt_errf(err, errlen, "too many nodes (at most %d)", ROUTER_MAX_NODES); return -1; }
    router_node_cfg *n = &c->nodes[c->n_nodes++];
    n->role = r;
    snprintf(n->model, sizeof n->model, "%s", model);
    snprintf(n->addr, sizeof n->addr, "%s", addr);
    return 0;
}

static int rt_cfg_int(json_t *o, const char *key, int lo, int hi, int *out, char *err, size_t errlen) {
    json_t *v = json_object_get(o, key);
    if (!v) return 0;
    if (!json_is_integer(v) || json_integer_value(v) < lo || json_integer_value(v) > hi) {
        rt_errf(err, errlen, "config: \"%s\" must be an integer in [%d, %d]", key, lo, hi);
        return -1;
    }
    *out = (int)json_integer_value(v);
    return 0;
}

static int rt_cfg_str(json_t *o, const char *key, char *out, size_t outlen, char *err, size_t errlen) {
    json_t *v = json_object_get(o, key);
    if (!v) return 0;
    if (!json_is_string(v) || json_string_length(v) >= outlen) {
        rt_errf(err, errlen, "config: \"%s\" must be a string shorter than %zu bytes", key, outlen);
        return -1;
    }
    snprintf(out, outlen, "%s", json_string_value(v));
    return 0;
}

/* Every key of an object must be one the router reads: a misspelled key
 * (min_split_tokenz) is refused by name rather than silently ignored. */
static int rt_cfg_known(json_t *o, const char *const *keys, const char *where, char *err, size_t errlen) {
    const char *k;
    json_t *v;
    json_object_foreach(o, k, v) {
        int found = 0;
        for (const char *const *p = keys; *p && !found; p++) found = !strcmp(*p, k);
        if (!found) {
            rt_errf(err, errlen, "config: unknown key \"%.100s\"%s%s (docs/router.md lists the keys)", k,
                    where[0] ? " in " : "", where);
            return -1;
        }
    }
    return 0;
}

static const char *const rt_cfg_root_keys[] = {
    "listen", "api_key", "secret", "secret_file", "split", "min_split_tokens", "link_gbps", "health_interval_ms",
    "down_after", "heartbeat_ttl_ms", "max_attempts", "tokenize_timeout_ms", "limits", "nodes", NULL};
static const char *const rt_cfg_limit_keys[] = {
    "max_body_bytes", "max_prompt_bytes", "max_prompt_tokens", "max_tokens", "default_max_tokens", "max_concurrent",
    "request_timeout_ms", "idle_timeout_ms", "max_connections", "max_connections_per_ip", "request_deadline_ms", NULL};
static const char *const rt_cfg_node_keys[] = {"role", "model", "addr", NULL};

static int rt_cfg_limits(router_config *c, json_t *l, char *err, size_t errlen) {
    if (!l) return 0;
    if (!json_is_object(l)) { rt_errf(err, errlen, "config: \"limits\" must be an object"); return -1; }
    if (rt_cfg_known(l, rt_cfg_limit_keys, "\"limits\"", err, errlen)) return -1;
    int body = (int)c->max_body_bytes, prompt = (int)c->lim.max_prompt_bytes;
    if (rt_cfg_int(l, "max_body_bytes", 1024, 1 << 28, &body, err, errlen) ||
        rt_cfg_int(l, "max_prompt_bytes", 1, 1 << 28, &prompt, err, errlen) ||
        rt_cfg_int(l, "max_prompt_tokens", 1, 1 << 24, &c->lim.max_prompt_tokens, err, errlen) ||
        rt_cfg_int(l, "max_tokens", 1, 1 << 24, &c->lim.max_tokens_limit, err, errlen) ||
        rt_cfg_int(l, "default_max_tokens", 1, 1 << 24, &c->lim.default_max_tokens, err, errlen) ||
        rt_cfg_int(l, "max_concurrent", 1, 100000, &c->max_concurrent, err, errlen) ||
        rt_cfg_int(l, "request_timeout_ms", 100, 86400000, &c->request_timeout_ms, err, errlen) ||
        rt_cfg_int(l, "idle_timeout_ms", 100, 86400000, &c->idle_timeout_ms, err, errlen) ||
        rt_cfg_int(l, "max_connections", 16, 100000, &c->max_conns, err, errlen) ||
        rt_cfg_int(l, "max_connections_per_ip", 1, 100000, &c->max_conns_per_ip, err, errlen) ||
        rt_cfg_int(l, "request_deadline_ms", 100, 3600000, &c->request_deadline_ms, err, errlen))
        return -1;
    c->max_body_bytes = (size_t)body;
    c->lim.max_prompt_bytes = (size_t)prompt;
    if (c->lim.default_max_tokens > c->lim.max_tokens_limit) c->lim.default_max_tokens = c->lim.max_tokens_limit;
    return 0;
}

static int rt_cfg_split(const char *s, int *out) {
    if (!strcmp(s, "auto")) *out = ROUTER_SPLIT_AUTO;
    else if (!strcmp(s, "always")) *out = ROUTER_SPLIT_ALWAYS;
    else if (!strcmp(s, "never")) *out = ROUTER_SPLIT_NEVER;
    else return -1;
    return 0;
}

static int rt_cfg_secret(router_config *c, json_t *root, char *err, size_t errlen) {
    json_t *s = json_object_get(root, "secret"), *f = json_object_get(root, "secret_file");
    char *val = NULL;
    size_t n = 0;
    if (json_is_string(s)) {
        if (!(val = strdup(json_string_value(s)))) { rt_errf(err, errlen, "out of memory"); return -1; }
        n = strlen(val);
    } else if (json_is_string(f)) {
        if (cliopt_load_secret(json_string_value(f), &val, &n, err, errlen)) return -1;
    } else if (s || f) {
        rt_errf(err, errlen, "config: \"secret\"/\"secret_file\" must be strings");
        return -1;
    } else {
        return 0;
    }
    router_config_free(c);
    c->secret = val;
    c->secret_len = n;
    return 0;
}

static int rt_cfg_nodes(router_config *c, json_t *nodes, char *err, size_t errlen) {
    if (!nodes) return 0;
    if (!json_is_array(nodes)) { rt_errf(err, errlen, "config: \"nodes\" must be an array"); return -1; }
    for (size_t i = 0; i < json_array_size(nodes); i++) {
        json_t *n = json_array_get(nodes, i);
        char where[32];
        snprintf(where, sizeof where, "nodes[%zu]", i);
        if (!json_is_object(n)) { rt_errf(err, errlen, "config: %s must be an object", where); return -1; }
        if (rt_cfg_known(n, rt_cfg_node_keys, where, err, errlen)) return -1;
        const char *role = json_string_value(json_object_get(n, "role"));
        const char *model = json_string_value(json_object_get(n, "model"));
        const char *addr = json_string_value(json_object_get(n, "addr"));
        if (!role || !model || !addr) {
            rt_errf(err, errlen, "config: nodes[%zu] needs string \"role\", \"model\" and \"addr\"", i);
            return -1;
        }
        if (router_config_add_node(c, role, model, addr, err, errlen)) return -1;
    }
    return 0;
}

static int rt_cfg_apply(router_config *c, json_t *root, char *err, size_t errlen) {
    char split[16] = "";
    double gbps = c->link_gbps;
    if (rt_cfg_known(root, rt_cfg_root_keys, "", err, errlen)) return -1;
    json_t *g = json_object_get(root, "link_gbps");
    if (g && (!json_is_number(g) || json_number_value(g) <= 0)) {
        rt_errf(err, errlen, "config: \"link_gbps\" must be a positive number");
        return -1;
    }
    if (g) gbps = json_number_value(g);
    c->link_gbps = gbps;
    if (rt_cfg_str(root, "listen", c->listen, sizeof c->listen, err, errlen) ||
        rt_cfg_str(root, "api_key", c->api_key, sizeof c->api_key, err, errlen) ||
        rt_cfg_str(root, "split", split, sizeof split, err, errlen) ||
        rt_cfg_int(root, "min_split_tokens", 0, 1 << 24, &c->min_split_tokens, err, errlen) ||
        rt_cfg_int(root, "health_interval_ms", 50, 600000, &c->health_interval_ms, err, errlen) ||
        rt_cfg_int(root, "down_after", 1, 100, &c->down_after, err, errlen) ||
        rt_cfg_int(root, "heartbeat_ttl_ms", 100, 3600000, &c->heartbeat_ttl_ms, err, errlen) ||
        rt_cfg_int(root, "max_attempts", 1, 16, &c->max_attempts, err, errlen) ||
        rt_cfg_int(root, "tokenize_timeout_ms", 10, 60000, &c->tokenize_timeout_ms, err, errlen) ||
        rt_cfg_secret(c, root, err, errlen) ||
        rt_cfg_limits(c, json_object_get(root, "limits"), err, errlen) ||
        rt_cfg_nodes(c, json_object_get(root, "nodes"), err, errlen))
        return -1;
    if (split[0] && rt_cfg_split(split, &c->split)) {
        rt_errf(err, errlen, "config: \"split\" must be \"auto\", \"always\" or \"never\"");
        return -1;
    }
    return 0;
}

int router_config_load(router_config *c, const char *path, char *err, size_t errlen) {
    json_error_t je;
    json_t *root = json_load_file(path, JSON_REJECT_DUPLICATES, &je);
    if (!root) { rt_errf(err, errlen, "%s:%d: %s", path, je.line, je.text); return -1; }
    int rc = -1;
    if (!json_is_object(root)) rt_errf(err, errlen, "%s: the config must be a JSON object", path);
    else rc = rt_cfg_apply(c, root, err, errlen);
    json_decref(root);
    return rc;
}

/* ==== Cost model ==== */

void router_decide(const router_cost_in *in, router_decision *d) {
    memset(d, 0, sizeof *d);
    int n = in->n_prompt > 0 ? in->n_prompt : 1;
    const char *cnt = in->count_note && *in->count_note ? in->count_note : "tokenizer";
    double dtps = in->decode_prefill_tps > 0 ? in->decode_prefill_tps : 1;
    double ptps = in->prefill_prefill_tps > 0 ? in->prefill_prefill_tps : 1;
    d->est_local_ms = n / dtps * 1e3;
    double compute = n / ptps * 1e3;
    double transfer = in->kv_bytes_per_token > 0 && in->link_bytes_per_s > 0
                    ? n * in->kv_bytes_per_token / in->link_bytes_per_s * 1e3 : 0;
    /* Frames go out while later layers compute: only the part of the
     * transfer that outlasts the compute is exposed, plus the measured fixed
     * cost; requests queued on the prefill node are served before ours. */
    double exposed = (transfer > compute ? transfer - compute : 0) + in->handoff_overhead_ms;
    d->est_split_ms = compute * (1 + in->prefill_queue) + exposed;
    if (in->policy == ROUTER_SPLIT_NEVER) {
        d->key = "policy";
        snprintf(d->reason, sizeof d->reason, "local: split policy is \"never\"");
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
    snprintf(d->reason, sizeof d->reason,
             "%s: est split %.1f ms (prefill node %.0f t/s %s, queue %d, exposed %.1f ms) %s local %.1f ms "
             "(decode node %.0f t/s %s, queue %d); prompt %d tokens (%s)",
             d->split ? "split" : "local", d->est_split_ms, ptps, in->prefill_tps_assumed ? "assumed" : "measured",
             in->prefill_queue, exposed, d->split ? "<" : ">=", d->est_local_ms, dtps,
             in->decode_tps_assumed ? "assumed" : "measured", in->decode_queue, n, cnt);
}

/* ==== Registry ==== */

typedef struct {
    router_node_cfg cfg;
    int registered;              /* came in through POST /v1/nodes/register */
    int up;
    int fails;                   /* consecutive failed checks */
    double last_heartbeat_ms;
    int inflight;                /* this router's requests on the node now */
    int queue_depth;             /* requests running + waiting, as the node reports it (decode: /v1/stats) */
    int inflight_at_report;      /* this router's requests on the node when it reported queue_depth */
    int slots;                   /* generation slots (decode: /v1/stats "slots"; 1 when not reported) */
    int queue_max;               /* requests that may wait beyond the slots ... */
    int queue_known;             /* ... if the node reported it */
    double prefill_tps, decode_tps;
    double kv_bytes_per_token, link_Bps, overhead_ms;
    double bytes_per_token;      /* prompt bytes per token (decode nodes), to estimate prompt length */
    char chat_format[16];        /* the decode node's template family (its /health), for tool calls */
    unsigned long long requests, failures, checks_failed;
    char desc[400];
} rt_node;

/* ==== Metrics ==== */

/* Families of the router's /metrics (metrics.h; docs/router.md lists
 * them). Series are created when first observed: a (decision, reason) pair
 * is exported once a request took it. Histograms are in seconds and carry
 * the request's model (a name some decode node serves). */
enum { RT_EP_CHAT, RT_EP_COMPLETIONS, RT_EP_MODELS, RT_EP_OTHER, RT_EP_N };
static const char *const rt_ep_names[RT_EP_N] = {"chat", "completions", "models", "other"};
/* Where a completed request's prompt was prefilled (rt_prefill_outcome). */
enum { RT_PF_LOCAL, RT_PF_SPLIT, RT_PF_CACHED, RT_PF_N };
static const char *const rt_pf_names[RT_PF_N] = {"local", "split", "cached"};

/* per-node figures, rebuilt from the registry at each scrape */
enum { RT_NM_UP, RT_NM_INFLIGHT, RT_NM_QUEUE, RT_NM_PREFILL_TPS, RT_NM_DECODE_TPS, RT_NM_KV_PER_TOKEN,
       RT_NM_LINK, RT_NM_REQUESTS, RT_NM_FAILURES, RT_NM_N };

typedef struct {
    metrics *reg;
    metrics_family *requests, *decisions, *served, *fallbacks, *retries, *cancels, *stream_errors;
    metrics_family *prompt_tokens, *completion_tokens, *kv_bytes, *wire_bytes, *active;
    metrics_family *e2e, *queue, *ttft, *tpot, *transfer;
    metrics_family *node[RT_NM_N];
} rt_metrics;

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

struct router {
    router_config cfg;
    httpd *http;
    /* keys derived from the shared secret (node_auth.h) */
    int have_secret;
    node_auth_key api_key;       /* signs our requests to decode nodes */
    node_auth_key reg_key;       /* verifies node registrations */
    node_auth_replay *reg_replay;
    int port;
    pthread_mutex_t mu;
    pthread_cond_t cv;
    rt_node nodes[ROUTER_MAX_NODES];
    int n_nodes;
    int active;                  /* generation requests in flight */
    unsigned long long seq;
    volatile int stopping;
    pthread_t health;
    int health_started;
    rt_metrics m;
    long long started_unix;
};

static void rt_count_request(router *r, int ep, int status) {
    char st[8];
    snprintf(st, sizeof st, "%d", status >= 100 && status <= 599 ? status : 0);
    metrics_add(r->m.requests, (const char *[]){rt_ep_names[ep], st}, 1);
}

/* ==== Node selection ==== */

/* Requests on a node, running and waiting: this router's own in-flight
 * count is exact and current; the node's report also covers other clients
 * but is up to one health interval old. */
static int rt_node_load(const rt_node *n) {
    return n->inflight > n->queue_depth ? n->inflight : n->queue_depth;
}

static int rt_node_slots(const rt_node *n) { return n->slots > 0 ? n->slots : 1; }

/* Free slots when positive; otherwise minus the length of its queue. */
static int rt_node_free(const rt_node *n) { return rt_node_slots(n) - rt_node_load(n); }

/* Every slot busy and the queue full. by_own: judged on this router's own
 * requests alone (certain) rather than on the node's last report. */
static int rt_node_full(const rt_node *n, int by_own) {
    if (!n->queue_known) return 0;
    return (by_own ? n->inflight : rt_node_load(n)) >= rt_node_slots(n) + n->queue_max;
}

static int rt_model_known(router *r, const char *model) {
    int found = 0;
    pthread_mutex_lock(&r->mu);
    for (int i = 0; i < r->n_nodes; i++)
        if (r->nodes[i].cfg.role == ROUTER_NODE_DECODE && !strcmp(r->nodes[i].cfg.model, model)) found = 1;
    pthread_mutex_unlock(&r->mu);
    return found;
}

/* Is node a a better pick than node b? Not full first, then the most free
 * slots (or, with none free, the shortest queue), then fewer requests so far. */
static int rt_better(const rt_node *a, const rt_node *b) {
    int fa = rt_node_full(a, 0), fb = rt_node_full(b, 0);
    if (fa != fb) return fb;
    if (rt_node_free(a) != rt_node_free(b)) return rt_node_free(a) > rt_node_free(b);
    return a->requests < b->requests;
}

/* Best healthy node of a role for a model, skipping tried[]; -1 if none.
 * A node whose last report says full is still picked when nothing better
 * is left (the report may be stale; a full node answers 503 at once).
 * Caller holds mu. */
static int rt_pick_locked(router *r, int role, const char *model, const int *tried) {
    int best = -1;
    for (int i = 0; i < r->n_nodes; i++) {
        rt_node *n = &r->nodes[i];
        if (n->cfg.role != role || !n->up || strcmp(n->cfg.model, model) || (tried && tried[i])) continue;
        if (best < 0 || rt_better(n, &r->nodes[best])) best = i;
    }
    return best;
}

/* ==== Upstream: one streamed POST /v1/generate through a curl multi handle ==== */

#define RT_UP_MAX_BUF (16u << 20)   /* a decode node's reply line is small; bound a broken one */

typedef struct {
    CURL *easy;
    CURLM *multi;
    struct curl_slist *hdrs;
    char *body;
    char *buf;
    size_t len, cap, off;
    int done, overflow;
    CURLcode result;
    char errbuf[CURL_ERROR_SIZE];
    atomic_int *cancel;          /* set: the reader gives up as if the client had gone (NULL: never) */
} rt_up;

static size_t rt_up_write(char *p, size_t sz, size_t nm, void *ud) {
    rt_up *u = ud;
    size_t n = sz * nm;
    if (u->off > 0 && u->off == u->len) u->off = u->len = 0;
    if (u->len + n > RT_UP_MAX_BUF) { u->overflow = 1; return 0; }
    if (u->len + n + 1 > u->cap) {
        if (u->off > 0) { memmove(u->buf, u->buf + u->off, u->len - u->off); u->len -= u->off; u->off = 0; }
        size_t cap = u->cap ? u->cap : 4096;
        while (cap < u->len + n + 1) cap *= 2;
        char *b = realloc(u->buf, cap);
        if (!b) return 0;
        u->buf = b;
        u->cap = cap;
    }
    memcpy(u->buf + u->len, p, n);
    u->len += n;
    u->buf[u->len] = 0;
    return n;
}

static void rt_up_close(rt_up *u) {
    if (u->multi && u->easy) curl_multi_remove_handle(u->multi, u->easy);
    if (u->easy) curl_easy_cleanup(u->easy);
    if (u->multi) curl_multi_cleanup(u->multi);
    curl_slist_free_all(u->hdrs);
    free(u->body);
    free(u->buf);
    memset(u, 0, sizeof *u);
}

/* key: signs the request for a decode node that authenticates (NULL: unsigned).
 * rid: the request id (log.h), sent as X-Request-Id for the node's log. */
static int rt_up_open(rt_up *u, const char *addr, char *body, int connect_ms, const node_auth_key *key, const char *rid) {
    memset(u, 0, sizeof *u);
    u->body = body;
    char url[192];
    snprintf(url, sizeof url, "http://%s/v1/generate", addr);
    u->easy = curl_easy_init();
    u->multi = curl_multi_init();
    char xid[32];
    snprintf(xid, sizeof xid, "X-Request-Id: %s", rid);
    u->hdrs = curl_slist_append(NULL, "Content-Type: application/json");
    if (u->hdrs) u->hdrs = curl_slist_append(u->hdrs, xid);
    if (!u->easy || !u->multi || !u->hdrs) return -1;
    node_auth_sig sig;
    if (key && (node_auth_sign(key, "POST", "/v1/generate", body, strlen(body), node_auth_now_ms(), &sig) ||
                !(u->hdrs = node_auth_curl_headers(u->hdrs, &sig))))
        return -1;
    curl_easy_setopt(u->easy, CURLOPT_URL, url);
    curl_easy_setopt(u->easy, CURLOPT_POSTFIELDS, u->body);
    curl_easy_setopt(u->easy, CURLOPT_POSTFIELDSIZE, (long)strlen(u->body));
    curl_easy_setopt(u->easy, CURLOPT_HTTPHEADER, u->hdrs);
    curl_easy_setopt(u->easy, CURLOPT_WRITEFUNCTION, rt_up_write);
    curl_easy_setopt(u->easy, CURLOPT_WRITEDATA, u);
    curl_easy_setopt(u->easy, CURLOPT_NOSIGNAL, 1L);
    curl_easy_setopt(u->easy, CURLOPT_TCP_NODELAY, 1L);
    curl_easy_setopt(u->easy, CURLOPT_CONNECTTIMEOUT_MS, (long)connect_ms);
    curl_easy_setopt(u->easy, CURLOPT_ERRORBUFFER, u->errbuf);
    curl_easy_setopt(u->easy, CURLOPT_PROXY, "");   /* nodes are reached directly, never through $http_proxy */
    return curl_multi_add_handle(u->multi, u->easy) == CURLM_OK ? 0 : -1;
}

static long rt_up_status(rt_up *u) {
    long code = 0;
    curl_easy_getinfo(u->easy, CURLINFO_RESPONSE_CODE, &code);
    return code;
}

enum { RT_LINE = 1, RT_EOF = 0, RT_FAIL = -1, RT_TIMEOUT = -2, RT_GONE = -3 };

/* A client that shut down only its sending side (it has sent the whole
 * request and waits for the answer) looks like POLLRDHUP, exactly as one
 * that closed: only a reset or a fully shut socket counts as gone. A closed
 * streaming client is noticed by the failed write instead. */
static int rt_client_gone(int fd) {
    if (fd < 0) return 0;
    struct pollfd p = {.fd = fd, .events = POLLIN};
    return poll(&p, 1, 0) > 0 && (p.revents & (POLLHUP | POLLERR));
}

static void rt_up_pump(rt_up *u, int wait_ms) {
    curl_multi_poll(u->multi, NULL, 0, wait_ms, NULL);
    int running = 0, left;
    curl_multi_perform(u->multi, &running);
    CURLMsg *msg;
    while ((msg = curl_multi_info_read(u->multi, &left)))
        if (msg->msg == CURLMSG_DONE) { u->done = 1; u->result = msg->data.result; }
}

/* Next complete line of the reply into *line (NUL-terminated, valid until the
 * next call). Blocks until a line, the end, deadline_ms (monotonic) or the
 * client hanging up (client_fd, -1 = do not watch). A reply with a status
 * other than 200 is read whole and left in the buffer: RT_EOF. */
static int rt_up_line(rt_up *u, double deadline_ms, int client_fd, char **line, size_t *len) {
    for (;;) {
        long status = rt_up_status(u);
        int plain = status == 0 || status == 200;
        char *start = u->buf ? u->buf + u->off : NULL;
        char *nl = plain && start ? memchr(start, '\n', u->len - u->off) : NULL;
        if (nl) {
            *nl = 0;
            *line = start;
            *len = (size_t)(nl - start);
            u->off += *len + 1;
            if (*len == 0 || (*len == 1 && start[0] == '\r')) continue;   /* blank keep-alive lines */
            return RT_LINE;
        }
        if (u->done) {
            if (u->result != CURLE_OK || u->overflow) return RT_FAIL;
            if (plain && start && u->len > u->off) {   /* last line without a newline */
                *line = start;
                *len = u->len - u->off;
                u->off = u->len;
                return RT_LINE;
            }
            return RT_EOF;
        }
        double now = rt_now_ms();
        if (now >= deadline_ms) return RT_TIMEOUT;
        if (rt_client_gone(client_fd) || (u->cancel && atomic_load(u->cancel))) return RT_GONE;
        int wait = (int)(deadline_ms - now);
        rt_up_pump(u, wait < 100 ? wait : 100);
    }
}

/* ==== A generation request ==== */

/* One choice's output: n > 1 choices are sibling sequences on the decode
 * node, their lines tagged with an index. */
typedef struct {
    int n_tokens;                /* tokens received */
    char *text;                  /* accumulated (non-stream) */
    size_t text_len, text_cap;
    char **lps;                  /* logprobs (non-stream): each token's entry from the node, in order */
    int n_lps, cap_lps;
    size_t lp_offset;            /* completions' text_offset of the next streamed token */
    tool_parser *tp;             /* tool calls: the output parsed per the node's template */
    int tp_prefix_fed;
    int done;                    /* its final line came */
    char finish_reason[16];
    int completion_tokens;
} rt_choice;

struct rt_batch;

typedef struct {
    router *r;
    int ep;
    api_request req;
    /* one prompt of several (rt_batch): its choices' indices start at
     * index_base; the batch counts the request and ends the stream */
    struct rt_batch *batch;
    int index_base;
    char id[48];
    char rid[LOG_ID_CHARS + 1];  /* request id in the logs of every node (log.h) */
    long long created;
    int client_fd;
    /* chosen nodes */
    int decode_idx, prefill_idx;
    char decode_addr[128], prefill_addr[128];
    router_decision dec;
    int n_prompt;                /* prompt tokens the plan was made for */
    int count_exact;             /* counted by the decode node's tokenizer (else a byte estimate) */
    char count_note[200];        /* "tokenizer", "token ids" or "byte estimate: why" */
    int tried[ROUTER_MAX_NODES];
    int attempts;
    int busy;                    /* attempts a node refused as full (503/429) */
    rt_up up;
    int have_up;
    /* progress */
    double t_start, t_first, t_last;
    int n_tokens;                /* choice 0's tokens (TTFT, TPOT) */
    api_upstream_line pending;   /* first line read while choosing a node */
    int have_pending;
    api_upstream_line fin;       /* choice 0's final line (the prefill figures); once every
                                  * choice is done its completion_tokens is their sum */
    int have_fin;
    rt_choice ch[API_MAX_N];     /* [req.n] */
    int n_done;                  /* choices whose final line came */
    /* stream output */
    char *out;
    size_t out_len, out_off;
    int phase;                   /* 0 streaming tokens, 1 ended */
    int status;
    char error[800];
    int logged;
    int counted_active;          /* requests it holds of the router's max_concurrent (prompts) */
} rt_req;

/* A request with several prompts: one rt_req per prompt (below, "Several
 * prompts"); their stream chunks wait for the client in a queue. */
typedef struct rt_piece {
    struct rt_piece *next;
    char *s;
    size_t len;
    int failed;                  /* a prompt's error event: the stream ends with it */
} rt_piece;

typedef struct rt_batch {
    rt_req *parent;              /* the client's request: its id, its metrics, its share of max_concurrent */
    int n;                       /* prompts */
    rt_req *kid[API_MAX_PROMPTS];
    pthread_t th[API_MAX_PROMPTS];
    int n_threads;               /* kid[0..n_threads) have a thread */
    int failed[API_MAX_PROMPTS];
    api_error err[API_MAX_PROMPTS];
    atomic_int cancel;           /* every prompt stops (read by rt_up_line) */
    pthread_mutex_t mu;          /* guards the fields below */
    pthread_cond_t cv;
    int started, go, running;
    rt_piece *head, *tail;
    size_t queued;
} rt_batch;

/* Prompt q's place in its batch's list. */
static int rt_kid_index(const rt_req *q) { return q->index_base / q->batch->parent->req.n; }

static int rt_text_add(rt_choice *c, const char *s) {
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
static void rt_lp_add(rt_choice *c, api_upstream_line *u) {
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

static void rt_lp_clear(rt_choice *c) {
    for (int i = 0; i < c->n_lps; i++) free(c->lps[i]);
    c->n_lps = 0;
}

/* The choice a line is for; NULL (with q->error) for an index out of range. */
static rt_choice *rt_choice_of(rt_req *q, const api_upstream_line *u) {
    if (u->index >= 0 && u->index < q->req.n && !q->ch[u->index].done) return &q->ch[u->index];
    snprintf(q->error, sizeof q->error, "decode node %s sent a line for choice %d of %d", q->decode_addr, u->index, q->req.n);
    return NULL;
}

/* A choice's final line: its figures, and choice 0's line kept as q->fin
 * (taken from u). Once every choice is done, fin's completion_tokens
 * become their sum (usage counts the prompt once, as OpenAI does). */
static void rt_choice_end(rt_req *q, rt_choice *c, api_upstream_line *u) {
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
static void rt_choices_reset(rt_req *q) {
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
static void rt_release_node(rt_req *q, int failed, int mark_down) {
    router *r = q->r;
    if (q->have_up) { rt_up_close(&q->up); q->have_up = 0; }
    pthread_mutex_lock(&r->mu);
    if (q->decode_idx >= 0) {
        rt_node *n = &r->nodes[q->decode_idx];
        if (n->inflight > 0) n->inflight--;
        if (failed) n->failures++;
        if (mark_down && n->up) { n->up = 0; log_warn(q->rid, "decode node %s marked down: %s", n->cfg.addr, q->error); }
    }
    if (q->prefill_idx >= 0 && r->nodes[q->prefill_idx].inflight > 0) r->nodes[q->prefill_idx].inflight--;
    pthread_mutex_unlock(&r->mu);
    q->decode_idx = q->prefill_idx = -1;
}

/* A split's cost beyond the prefill node's compute until measured: on a
 * LAN, the request's round trip and the decode node's last position. */
#define RT_SPLIT_OVERHEAD_MS 2.0

/* Prompt length from its bytes, for when the decode node cannot count it:
 * the bytes per token the decode node's completed requests showed. */
static int rt_estimate_tokens(const rt_req *q, const rt_node *d) {
    double bpt = d->bytes_per_token > 0 ? d->bytes_per_token : 4.0;   /* ~4 bytes/token for English BPE */
    return (int)(q->req.prompt_bytes / bpt) + 1;
}

static int rt_count_tokens(router *r, const char *addr, const api_request *req, char *err, size_t errlen);

/* The prompt's tokens as the decode node will evaluate them (its
 * tokenizer, its chat template); a byte estimate, with why in q->count_note,
 * when it cannot answer within tokenize_timeout_ms. No lock held. */
static void rt_count_prompt(rt_req *q) {
    router *r = q->r;
    q->count_exact = 1;
    snprintf(q->count_note, sizeof q->count_note, "tokenizer");
    if (q->req.tokens) { q->n_prompt = q->req.n_tokens; snprintf(q->count_note, sizeof q->count_note, "token ids"); return; }
    char err[160];
    int n = rt_count_tokens(r, q->decode_addr, &q->req, err, sizeof err);
    if (n > 0) { q->n_prompt = n; return; }
    pthread_mutex_lock(&r->mu);
    q->n_prompt = rt_estimate_tokens(q, &r->nodes[q->decode_idx]);
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

/* Chooses a decode node; -1 when no node is left, -2 when the best one
 * left is full with this router's own requests. */
static int rt_choose(rt_req *q) {
    router *r = q->r;
    pthread_mutex_lock(&r->mu);
    int d = rt_pick_decode_locked(q);
    if (d < 0) { pthread_mutex_unlock(&r->mu); return -1; }
    if (rt_node_full(&r->nodes[d], 1)) { pthread_mutex_unlock(&r->mu); return -2; }
    rt_node *dn = &r->nodes[d];
    q->tried[d] = 1;
    q->decode_idx = d;
    dn->inflight++;
    dn->requests++;
    snprintf(q->decode_addr, sizeof q->decode_addr, "%s", dn->cfg.addr);
    q->prefill_idx = -1;
    q->prefill_addr[0] = 0;
    pthread_mutex_unlock(&r->mu);
    return 0;
}

/* Requests ahead of this one on a decode node: the others' requests as of
 * its last report (the report also counted ours then in flight, which may
 * have finished since) plus ours in flight now, less this one (rt_choose
 * counted it). Caller holds mu. */
static int rt_decode_ahead(const rt_node *n) {
    int others = n->queue_depth - n->inflight_at_report;
    int ahead = (others > 0 ? others : 0) + n->inflight - 1;
    return ahead > 0 ? ahead : 0;
}

/* The prefill plan for the chosen decode node: counts the prompt, then the
 * cost model (router_decide) against the best prefill node. */
static void rt_plan(rt_req *q) {
    router *r = q->r;
    rt_count_prompt(q);
    pthread_mutex_lock(&r->mu);
    int p = rt_pick_locked(r, ROUTER_NODE_PREFILL, q->req.model, NULL);
    rt_node *dn = &r->nodes[q->decode_idx], *pn = p >= 0 ? &r->nodes[p] : NULL;
    router_cost_in in = {
        .n_prompt = q->n_prompt,
        .count_note = q->count_note,
        .decode_prefill_tps = dn->prefill_tps > 0 ? dn->prefill_tps : r->cfg.default_prefill_tps,
        .prefill_prefill_tps = pn && pn->prefill_tps > 0 ? pn->prefill_tps : r->cfg.default_prefill_tps,
        .decode_tps_assumed = !(dn->prefill_tps > 0),
        .prefill_tps_assumed = !(pn && pn->prefill_tps > 0),
        .link_bytes_per_s = pn && pn->link_Bps > 0 ? pn->link_Bps : r->cfg.link_gbps * 1e9 / 8,
        .kv_bytes_per_token = pn ? pn->kv_bytes_per_token : 0,
        .handoff_overhead_ms = pn && pn->overhead_ms > 0 ? pn->overhead_ms : RT_SPLIT_OVERHEAD_MS,
        .decode_queue = rt_decode_ahead(dn),
        .prefill_queue = pn ? rt_node_load(pn) : 0,
        .have_prefill = pn != NULL,
        .policy = r->cfg.split,
        .min_split_tokens = r->cfg.min_split_tokens,
    };
    router_decide(&in, &q->dec);
    q->prefill_idx = -1;
    q->prefill_addr[0] = 0;
    if (q->dec.split) {
        q->prefill_idx = p;
        pn->inflight++;
        pn->requests++;
        snprintf(q->prefill_addr, sizeof q->prefill_addr, "%s", pn->cfg.addr);
    }
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

/* The first line of an attempt. Before it the request may wait in the
 * node's queue and for its prefill, which the idle timeout must not cut
 * short (a queue of long generations takes minutes): it waits as long as
 * the node passes its health checks, up to the request's deadline. */
static int rt_wait_first(rt_req *q, char **line, size_t *len) {
    router *r = q->r;
    double hard = q->t_start + r->cfg.request_timeout_ms;
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

/* ==== Tool calls ==== */

/* Per attempt: the chosen node's template decides the forced-call prefix
 * (tool_choice "required" or named) and how its output is parsed.
 * 0, or -1 with e filled. */
static int rt_tools_prepare(rt_req *q, api_error *e) {
    if (!api_tools_active(&q->req)) return 0;
    char name[16];
    pthread_mutex_lock(&q->r->mu);
    snprintf(name, sizeof name, "%s", q->r->nodes[q->decode_idx].chat_format);
    pthread_mutex_unlock(&q->r->mu);
    enum chat_format fmt = tools_format_from_name(name);
    if (fmt == CHAT_NONE) {
        api_error_set(e, 400, "invalid_request_error", "unsupported_parameter", "tools",
                      "Model '%s' has a chat template without tool calls (%s).", q->req.model, name[0] ? name : "unknown");
        return -1;
    }
    api_request *r = &q->req;
    int forced = r->tool_choice == API_TOOLS_REQUIRED || r->tool_choice == API_TOOLS_NAMED;
    free(r->assistant_prefix);
    r->assistant_prefix = forced ? tools_prefix(fmt, r->tool_name, r->tool_name && r->tool_args_fixed) : NULL;
    r->prefix_complete = forced && r->tool_name && r->tool_args_fixed;
    /* one call: a named function, or parallel_tool_calls false; ChatML's
     * closing tag then ends the generation */
    int one = (forced && r->tool_name) || !r->parallel_tool_calls;
    r->call_stop = one && fmt == CHAT_CHATML ? "</tool_call>" : NULL;
    /* a named call's arguments are constrained on the node, which stops
     * once they are complete: the call's closing is ours to add */
    r->call_suffix = forced && r->tool_name && r->tool_args_format && !r->prefix_complete
                   ? (fmt == CHAT_CHATML ? "}\n</tool_call>" : "}") : NULL;
    int ok = 1;
    for (int i = 0; i < r->n; i++) {
        tool_parser_free(q->ch[i].tp);
        q->ch[i].tp = tool_parser_new(fmt, one ? 1 : 0);
        q->ch[i].tp_prefix_fed = 0;
        ok &= q->ch[i].tp != NULL;
    }
    if (!ok || (forced && !r->assistant_prefix)) {
        api_error_set(e, 500, "server_error", NULL, NULL, "out of memory");
        return -1;
    }
    return 0;
}

/* Parses output text (the prefix first: it is the start of the assistant's
 * message); end flushes. Events into ev; 0 or -1. */
static int rt_tools_feed(rt_req *q, rt_choice *c, const char *text, int end, tool_evs *ev) {
    int bad = 0;
    if (!c->tp_prefix_fed) {
        c->tp_prefix_fed = 1;
        if (q->req.assistant_prefix) bad |= tool_parser_feed(c->tp, q->req.assistant_prefix, strlen(q->req.assistant_prefix), ev);
    }
    if (text) bad |= tool_parser_feed(c->tp, text, strlen(text), ev);
    if (end) bad |= tool_parser_end(c->tp, ev);
    return bad ? -1 : 0;
}

/* A constrained call's arguments ended the generation ("stop"): its
 * closing follows them (not when cut by max_tokens). */
static int rt_tools_close(rt_req *q, rt_choice *c, const char *reason, tool_evs *ev) {
    if (!q->req.call_suffix || strcmp(reason, "stop")) return 0;
    return rt_tools_feed(q, c, q->req.call_suffix, 0, ev);
}

/* OpenAI's finish_reason once calls were made: "tool_calls" unless the
 * generation was cut inside one. Call before the parser's end. */
static const char *rt_tools_finish(rt_choice *c, const char *reason) {
    if (!c->tp || tool_parser_calls(c->tp) == 0) return reason;
    return !strcmp(reason, "stop") || tool_parser_done(c->tp) ? "tool_calls" : reason;
}

static char *rt_tools_chunks(rt_req *q, rt_choice *c, const api_resp_meta *m, const char *text, int end) {
    tool_evs ev = {0};
    char *s = rt_tools_feed(q, c, text, end, &ev) ? NULL : api_render_tool_chunks(m, &ev);
    tool_evs_clear(&ev);
    return s;
}

static char *rt_tools_response(rt_req *q, rt_choice *c, const api_resp_meta *m) {
    tool_evs ev = {0};
    char *s = NULL;
    if (rt_tools_feed(q, c, c->text ? c->text : "", 0, &ev) == 0 && rt_tools_close(q, c, c->finish_reason, &ev) == 0) {
        const char *finish = rt_tools_finish(c, c->finish_reason);
        if (tool_parser_end(c->tp, &ev) == 0)
            s = api_render_tool_response(m, &ev, finish, q->fin.prompt_tokens, q->fin.completion_tokens);
    }
    tool_evs_clear(&ev);
    return s;
}

/* One attempt: open the stream to the chosen node and wait for its first
 * line. 0 = streaming (q->pending holds the first line); 1 = retry on another
 * node; -1 = give up with e filled. */
static int rt_attempt(rt_req *q, api_error *e) {
    router *r = q->r;
    if (rt_tools_prepare(q, e)) return -1;
    rt_plan(q);
    const char *mode = q->dec.split ? "remote" : "local";
    char *body = api_upstream_body(&q->req, mode, q->dec.split ? q->prefill_addr : NULL);
    if (!body || rt_up_open(&q->up, q->decode_addr, body, r->cfg.connect_timeout_ms, r->have_secret ? &r->api_key : NULL,
                             q->rid)) {
        if (!q->up.body) free(body);
        rt_up_close(&q->up);
        api_error_set(e, 500, "server_error", NULL, NULL, "out of memory");
        return -1;
    }
    q->have_up = 1;
    q->up.cancel = q->batch ? &q->batch->cancel : NULL;   /* the batch gives up: a sibling failed, the client left */
    char *line;
    size_t len;
    int rc = rt_wait_first(q, &line, &len);
    long status = rt_up_status(&q->up);
    if (rc == RT_GONE) { snprintf(q->error, sizeof q->error, "client disconnected"); return -1; }
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
        if (rt_now_ms() >= q->t_start + r->cfg.request_timeout_ms)
            snprintf(q->error, sizeof q->error, "request timed out after %d ms before the first token from decode node %s",
                     r->cfg.request_timeout_ms, q->decode_addr);
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
static int rt_start(rt_req *q, api_error *e) {
    router *r = q->r;
    for (;;) {
        int chose = q->attempts >= r->cfg.max_attempts ? -1 : rt_choose(q);
        if (chose) { rt_start_error(q, chose, e); return -1; }
        q->attempts++;
        int rc = rt_attempt(q, e);
        if (rc == 0) return 0;
        int busy = strstr(q->error, "busy") != NULL, idx = q->decode_idx;
        int conn_fail = q->have_up && q->up.done && q->up.result == CURLE_COULDNT_CONNECT;
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
static int rt_prefill_outcome(const api_upstream_line *f) {
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
static void rt_learn(rt_req *q) {
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
    if (q->prefill_idx >= 0 && f->fallback_reason[0]) {
        rt_node *p = &r->nodes[q->prefill_idx];
        p->failures++;
        p->fails = r->cfg.down_after;   /* suspect until the next good probe */
        p->up = 0;
    }
    pthread_mutex_unlock(&r->mu);
    if (f->fallback_reason[0])
        log_warn(q->rid, "prefill fell back to the decode node: %s", f->fallback_reason);
}

static void rt_log_done(rt_req *q, const char *outcome) {
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
    log_info(q->rid, "%s status=%d id=%s%s attempts=%d decode=%s plan=%s reason=%s est_ms=%.1f counted=%d(%s) prefill=%s%s%s "
           "prompt=%d completion=%d ttft_ms=%.1f tpot_ms=%.2f "
           "start_pos=%d computed_remote=%d computed_local=%d kv_bytes=%.0f wire_bytes=%.0f prefill_ms=%.1f transfer_ms=%.1f%s%s%s%s",
           outcome, q->status, q->id, part, q->attempts, q->decode_addr, q->dec.split ? "split" : "local",
           q->dec.key ? q->dec.key : "-", q->dec.split ? q->dec.est_split_ms : q->dec.est_local_ms, q->n_prompt,
           q->count_exact ? "exact" : "estimate",
           pf, f->prefill_node[0] ? "@" : "", f->prefill_node, f->prompt_tokens, completion, ttft, tpot,
           f->start_pos, f->computed_remote, f->computed_local, f->kv_bytes, f->wire_bytes, f->prefill_ms, transfer,
           f->fallback_reason[0] ? " fallback=" : "", f->fallback_reason, q->error[0] ? " error=" : "", q->error);
}

/* Reads the next line of the current attempt. 1 token/done line in *u;
 * 0 the attempt failed (q->error says why); -1 the client went away. */
static int rt_next(rt_req *q, api_upstream_line *u) {
    if (q->have_pending) { *u = q->pending; q->have_pending = 0; memset(&q->pending, 0, sizeof q->pending); return 1; }
    router *r = q->r;
    char *line;
    size_t len;
    double deadline = rt_now_ms() + r->cfg.idle_timeout_ms, hard = q->t_start + r->cfg.request_timeout_ms;
    int rc = rt_up_line(&q->up, deadline < hard ? deadline : hard, q->client_fd, &line, &len);
    if (rc == RT_GONE) return -1;
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
                 rt_now_ms() >= hard ? r->cfg.request_timeout_ms : r->cfg.idle_timeout_ms);
    else
        snprintf(q->error, sizeof q->error, "decode node %s %s", q->decode_addr,
                 rc == RT_LINE ? "sent a malformed line" : rc == RT_EOF ? "closed the stream before finishing"
                 : q->up.errbuf[0] ? q->up.errbuf : "connection failed");
    return 0;
}

static void rt_on_token(rt_req *q, const api_upstream_line *u) {
    double now = rt_now_ms();
    if (q->n_tokens == 0) q->t_first = now;
    q->t_last = now;
    q->n_tokens++;
}

/* ==== HTTP plumbing ==== */

typedef struct {
    int ep;
    char *body;
    size_t len, cap;
    int too_big;
    int handled;
} rt_conn;

/* Seconds a client told 429 should wait: about one health interval, after
 * which the router knows the nodes' queues afresh. */
#define RT_RETRY_AFTER "1"

static enum MHD_Result rt_send(struct MHD_Connection *c, int status, const char *ctype, char *body) {
    if (!body) {
        status = 500;
        body = strdup("{\"error\":{\"message\":\"out of memory\",\"type\":\"server_error\",\"param\":null,\"code\":null}}");
        if (!body) return MHD_NO;
    }
    struct MHD_Response *resp = MHD_create_response_from_buffer(strlen(body), body, MHD_RESPMEM_MUST_FREE);
    if (!resp) { free(body); return MHD_NO; }
    MHD_add_response_header(resp, "Content-Type", ctype);
    if (status == 429) MHD_add_response_header(resp, "Retry-After", RT_RETRY_AFTER);
    enum MHD_Result rc = MHD_queue_response(c, (unsigned)status, resp);
    MHD_destroy_response(resp);
    return rc;
}

static enum MHD_Result rt_send_error(router *r, struct MHD_Connection *c, int ep, const api_error *e) {
    rt_count_request(r, ep, e->status);
    return rt_send(c, e->status, "application/json", api_error_json(e));
}

static int rt_client_fd(struct MHD_Connection *c) {
    const union MHD_ConnectionInfo *ci = MHD_get_connection_info(c, MHD_CONNECTION_INFO_CONNECTION_FD);
    return ci ? ci->connect_fd : -1;
}

/* ==== Generation endpoints ==== */

static void rt_req_finish(rt_req *q) {
    router *r = q->r;
    if (q->counted_active && q->req.model) {
        const char *outcome = q->status == 200 ? "ok" : q->status == 499 ? "cancelled" : "error";
        metrics_observe(r->m.e2e, (const char *[]){q->req.model, outcome}, (rt_now_ms() - q->t_start) / 1e3);
    }
    if (q->have_fin) api_upstream_line_free(&q->fin);
    if (q->have_pending) api_upstream_line_free(&q->pending);
    rt_release_node(q, 0, 0);
    for (int i = 0; i < API_MAX_N; i++) {
        tool_parser_free(q->ch[i].tp);
        free(q->ch[i].text);
        rt_lp_clear(&q->ch[i]);
        free(q->ch[i].lps);
    }
    api_request_free(&q->req);
    free(q->out);
    if (q->counted_active) {
        pthread_mutex_lock(&r->mu);
        r->active -= q->counted_active;
        pthread_mutex_unlock(&r->mu);
    }
    free(q);
}

static void rt_meta(const rt_req *q, api_resp_meta *m) {
    memset(m, 0, sizeof *m);
    m->id = q->id;
    m->created = q->created;
    m->model = q->req.model;
}

/* Which nodes serve the request, for clients that report it (tandem grade):
 * the decode node, the plan (split = a prefill node computes the prompt) and
 * that prefill node. A non-stream reply also says where the prompt was
 * actually prefilled (a split can fall back to local). */
static void rt_node_headers(struct MHD_Response *resp, const rt_req *q) {
    MHD_add_response_header(resp, "X-Request-Id", q->rid);
    char v[32];
    MHD_add_response_header(resp, "X-Tandem-Decode-Node", q->decode_addr);
    MHD_add_response_header(resp, "X-Tandem-Prefill-Plan", q->dec.split ? "split" : "local");
    if (q->dec.split) MHD_add_response_header(resp, "X-Tandem-Prefill-Node", q->prefill_addr);
    /* the decision's reason key (as in the metrics), the prompt length it
     * used and how it was counted, and the plan's estimated prefill time */
    MHD_add_response_header(resp, "X-Tandem-Prefill-Reason", q->dec.key ? q->dec.key : "-");
    snprintf(v, sizeof v, "%d", q->n_prompt);
    MHD_add_response_header(resp, "X-Tandem-Prompt-Tokens", v);
    MHD_add_response_header(resp, "X-Tandem-Token-Count", q->count_exact ? "exact" : "estimate");
    snprintf(v, sizeof v, "%.1f", q->dec.split ? q->dec.est_split_ms : q->dec.est_local_ms);
    MHD_add_response_header(resp, "X-Tandem-Prefill-Estimate-Ms", v);
    if (q->have_fin && q->fin.prefill_mode[0]) {
        MHD_add_response_header(resp, "X-Tandem-Prefill", strcmp(q->fin.prefill_mode, "remote") ? "local" : "split");
        MHD_add_response_header(resp, "X-Tandem-Prefill-Outcome", q->fin.fallback_reason[0] ? "fallback"
                                : rt_pf_names[rt_prefill_outcome(&q->fin)]);
        snprintf(v, sizeof v, "%.1f", q->fin.prefill_ms);
        MHD_add_response_header(resp, "X-Tandem-Prefill-Ms", v);
        if (!strcmp(q->fin.prefill_mode, "remote")) {
            snprintf(v, sizeof v, "%.1f", q->fin.remote_prefill_ms);
            MHD_add_response_header(resp, "X-Tandem-Remote-Prefill-Ms", v);
        }
    }
}

/* Takes one line of a non-stream attempt (freeing it): 1 read on, 0 every
 * choice is done, -1 the attempt failed (q->error says why when it can). */
static int rt_collect(rt_req *q, api_upstream_line *u) {
    rt_choice *c = rt_choice_of(q, u);
    int rc = 1;
    if (!c) {
        rc = -1;
    } else if (u->is_token) {
        if (u->index == 0) rt_on_token(q, u);
        c->n_tokens++;
        rt_text_add(c, u->text);
        if (u->logprob) rt_lp_add(c, u);
    } else if (!strcmp(u->finish_reason, "error")) {
        rc = -1;
        if (!q->have_fin) { q->fin = *u; q->have_fin = 1; memset(u, 0, sizeof *u); }   /* its figures for the log */
    } else {
        /* the final line releases text held back while it could have
         * started a stop string, and the detokenizer's last bytes */
        rt_text_add(c, u->text);
        rt_choice_end(q, c, u);
        rc = q->n_done < q->req.n;
    }
    api_upstream_line_free(u);
    return rc;
}

/* One choice of the non-stream reply (its meta's index set by the caller). */
static char *rt_render_choice(rt_req *q, rt_choice *c, api_resp_meta *m) {
    if (q->req.echo) {
        char *t = c->text;
        c->text = NULL; c->text_len = c->text_cap = 0;
        rt_text_add(c, q->req.prompt);
        rt_text_add(c, t);
        free(t);
    }
    char *lp = c->n_lps ? api_render_logprobs(q->req.kind, c->lps, c->n_lps,
                                              q->req.echo && q->req.prompt ? strlen(q->req.prompt) : 0) : NULL;
    m->logprobs = lp;
    char *body = c->tp ? rt_tools_response(q, c, m)
               : api_render_response(q->req.kind, m, c->text ? c->text : "", c->finish_reason,
                                     q->fin.prompt_tokens, q->fin.completion_tokens);
    free(lp);
    m->logprobs = NULL;
    return body;
}

/* q's choices rendered one by one into bodies[0..n) (their indices from
 * q->index_base); 0, or -1 when one could not be rendered. */
static int rt_render_choices(rt_req *q, char **bodies) {
    api_resp_meta m;
    rt_meta(q, &m);
    int ok = 1;
    for (int i = 0; i < q->req.n; i++) {
        m.index = q->index_base + i;
        ok &= (bodies[i] = rt_render_choice(q, &q->ch[i], &m)) != NULL;
    }
    return ok ? 0 : -1;
}

/* The whole non-stream reply: n choices rendered one by one, then merged. */
static char *rt_render_reply(rt_req *q) {
    char *bodies[API_MAX_N] = {0};
    int ok = rt_render_choices(q, bodies) == 0;
    if (q->req.n == 1) return bodies[0];
    char *body = ok ? api_merge_responses(bodies, q->req.n, q->fin.prompt_tokens, q->fin.completion_tokens) : NULL;
    for (int i = 0; i < q->req.n; i++) free(bodies[i]);
    return body;
}

/* Non-stream: reads every choice; a node failing mid-way is retried from
 * scratch (the client has seen nothing yet). 0 (learnt from and logged), or
 * -1 with e filled. */
static int rt_complete(rt_req *q, api_error *e) {
    router *r = q->r;
    for (;;) {
        if (rt_start(q, e)) return -1;
        api_upstream_line u;
        int rc = 1, more = 1;
        while (more > 0 && (rc = rt_next(q, &u)) == 1) more = rt_collect(q, &u);
        if (more == 0) {
            rt_learn(q);
            q->status = 200;
            rt_log_done(q, "done");
            return 0;
        }
        if (rc < 0) {
            snprintf(q->error, sizeof q->error, "client disconnected");
            api_error_set(e, 499, "invalid_request_error", NULL, NULL, "client disconnected");
            return -1;
        }
        /* failed mid-way: drop what we have and retry */
        if (q->have_fin) { api_upstream_line_free(&q->fin); q->have_fin = 0; memset(&q->fin, 0, sizeof q->fin); }
        rt_choices_reset(q);
        q->n_tokens = 0;
        q->t_first = 0;
        rt_release_node(q, 1, 0);
        log_warn(q->rid, "%s; retrying", q->error);
        metrics_add(r->m.retries, NULL, 1);
    }
}

/* A request that failed before its reply: logged and counted; the error
 * goes to the client unless it went away (499: the connection is closed). */
static enum MHD_Result rt_fail(rt_req *q, struct MHD_Connection *c, const api_error *e) {
    router *r = q->r;
    q->status = e->status;
    enum MHD_Result mr;
    if (e->status == 499) {
        metrics_add(r->m.cancels, NULL, 1);
        rt_log_done(q, "cancelled");
        mr = MHD_NO;   /* nobody to answer: close the connection */
    } else {
        if (!q->error[0]) snprintf(q->error, sizeof q->error, "%s", e->message);
        rt_log_done(q, "failed");
        mr = rt_send_error(r, c, q->ep, e);
    }
    return mr;
}

/* A JSON reply (taken: body is freed) with the routing headers of q, or of
 * none when q is NULL (several prompts: each went its own way). */
static enum MHD_Result rt_reply_json(struct MHD_Connection *c, const rt_req *q, const char *rid, char *body) {
    struct MHD_Response *resp = body ? MHD_create_response_from_buffer(strlen(body), body, MHD_RESPMEM_MUST_FREE) : NULL;
    if (!resp) { free(body); return MHD_NO; }
    MHD_add_response_header(resp, "Content-Type", "application/json");
    if (q) rt_node_headers(resp, q);
    else MHD_add_response_header(resp, "X-Request-Id", rid);
    enum MHD_Result mr = MHD_queue_response(c, 200, resp);
    MHD_destroy_response(resp);
    return mr;
}

static enum MHD_Result rt_run_blocking(rt_req *q, struct MHD_Connection *c) {
    api_error e;
    enum MHD_Result mr;
    if (rt_complete(q, &e)) {
        mr = rt_fail(q, c, &e);
    } else {
        rt_count_request(q->r, q->ep, 200);
        mr = rt_reply_json(c, q, q->rid, rt_render_reply(q));
    }
    rt_req_finish(q);
    return mr;
}

static int rt_out_set(rt_req *q, char *s) {
    if (!s) return -1;
    free(q->out);
    q->out = s;
    q->out_len = strlen(s);
    q->out_off = 0;
    return 0;
}


/* A streamed token of choice c: its chunk (the role delta first for chat,
 * the echoed prompt first for completions). */
static char *rt_stream_token(rt_req *q, rt_choice *c, const api_resp_meta *m, api_upstream_line *u) {
    int first = c->n_tokens == 0;
    if (u->index == 0) rt_on_token(q, u);
    c->n_tokens++;
    char *lp = u->logprob && !c->tp ? api_render_logprobs(q->req.kind, &u->logprob, 1, c->lp_offset) : NULL;
    api_resp_meta ml = *m;
    ml.logprobs = lp;
    char *s = c->tp ? rt_tools_chunks(q, c, m, u->text, 0) : api_render_chunk(q->req.kind, &ml, u->text ? u->text : "", NULL, 0);
    free(lp);
    c->lp_offset += u->text ? strlen(u->text) : 0;
    if (first && q->req.kind == API_CHAT) s = api_concat(api_render_chunk(API_CHAT, m, "", NULL, 1), s);
    if (first && q->req.echo) s = api_concat(api_render_chunk(API_COMPLETION, m, q->req.prompt, NULL, 0), s);
    return s;
}

/* Choice c's final line: the text it released, then its finish chunk. */
static char *rt_stream_choice_end(rt_req *q, rt_choice *c, const api_resp_meta *m, api_upstream_line *u) {
    char *s;
    if (c->tp) {
        /* the finish reason is decided before the parser's end flushes */
        const char *finish = rt_tools_finish(c, u->finish_reason);
        char *feed = rt_tools_chunks(q, c, m, u->text, 0);
        tool_evs ev = {0};
        char *close = rt_tools_close(q, c, u->finish_reason, &ev) || tool_parser_end(c->tp, &ev) ? NULL
                    : api_render_tool_chunks(m, &ev);
        tool_evs_clear(&ev);
        feed = api_concat(feed, close);
        s = api_concat(feed, api_render_chunk(q->req.kind, m, NULL, finish, 0));
    } else {
        s = api_render_chunk(q->req.kind, m, NULL, u->finish_reason, 0);
        /* text released by the final line (held back while it could have
         * started a stop string) goes out before the finish chunk */
        if (u->text && *u->text) s = api_concat(api_render_chunk(q->req.kind, m, u->text, NULL, 0), s);
    }
    if (c->n_tokens == 0 && q->req.kind == API_CHAT) s = api_concat(api_render_chunk(API_CHAT, m, "", NULL, 1), s);
    rt_choice_end(q, c, u);
    return s;
}

/* Produces the next SSE bytes into q->out; 0, or -1 at the end of stream. */
static int rt_stream_produce(rt_req *q) {
    if (q->phase == 1) return -1;
    api_resp_meta m;
    rt_meta(q, &m);
    api_upstream_line u;
    int rc = rt_next(q, &u);
    rt_choice *c = NULL;
    if (rc == 1 && !(c = rt_choice_of(q, &u))) { api_upstream_line_free(&u); rc = 0; }
    if (c) m.index = q->index_base + u.index;
    if (rc == 1 && u.is_token) {
        char *s = rt_stream_token(q, c, &m, &u);
        api_upstream_line_free(&u);
        return rt_out_set(q, s) ? -1 : 0;
    }
    router *r = q->r;
    if (rc == 1 && strcmp(u.finish_reason, "error")) {
        char *s = rt_stream_choice_end(q, c, &m, &u);
        api_upstream_line_free(&u);
        if (q->n_done < q->req.n) return rt_out_set(q, s) ? -1 : 0;
        q->phase = 1;
        rt_learn(q);
        q->status = 200;
        if (!q->batch) {   /* a batch ends the stream once every prompt is done */
            if (q->req.include_usage)
                s = api_concat(s, api_render_usage_chunk(q->req.kind, &m, q->fin.prompt_tokens, q->fin.completion_tokens));
            s = api_concat(s, strdup("data: [DONE]\n\n"));
            rt_count_request(r, q->ep, 200);
        }
        rt_log_done(q, "done");
        return rt_out_set(q, s) ? -1 : 0;
    }
    q->phase = 1;
    if (rc == 1) {
        if (!q->have_fin) { q->fin = u; q->have_fin = 1; }   /* its figures for the log */
        else api_upstream_line_free(&u);
    }
    if (rc < 0) {
        snprintf(q->error, sizeof q->error, "client disconnected");
        return -1;
    }
    /* After tokens went out, a failure can only be reported in the stream. */
    api_error e;
    api_error_set(&e, 502, "server_error", "upstream_failed", NULL,
                  "The decode node failed after %d tokens were streamed: %s", q->n_tokens, q->error);
    q->status = 502;
    metrics_add(r->m.stream_errors, NULL, 1);
    if (!q->batch) rt_count_request(r, q->ep, 502);
    rt_log_done(q, "stream error");
    return rt_out_set(q, api_render_error_event(&e)) ? -1 : 0;
}

/* Up to max bytes of q's pending stream output into buf. */
static ssize_t rt_out_take(rt_req *q, char *buf, size_t max) {
    size_t n = q->out_len - q->out_off;
    if (n > max) n = max;
    memcpy(buf, q->out + q->out_off, n);
    q->out_off += n;
    return (ssize_t)n;
}

static ssize_t rt_stream_cb(void *cls, uint64_t pos, char *buf, size_t max) {
    rt_req *q = cls;
    while (q->out_off >= q->out_len) {
        if (rt_stream_produce(q)) return MHD_CONTENT_READER_END_OF_STREAM;
    }
    return rt_out_take(q, buf, max);
}

static void rt_stream_free(void *cls) {
    rt_req *q = cls;
    if (!q->logged) {
        /* The client went away mid-stream (MHD could not write): closing the
         * upstream connection tells the decode node to stop. */
        metrics_add(q->r->m.cancels, NULL, 1);
        if (!q->error[0]) snprintf(q->error, sizeof q->error, "client disconnected");
        q->status = 499;
        rt_log_done(q, "cancelled");
    }
    rt_req_finish(q);
}

/* A server-sent event stream, not to be cached or buffered by a proxy. */
static void rt_sse_headers(struct MHD_Response *resp) {
    MHD_add_response_header(resp, "Content-Type", "text/event-stream");
    MHD_add_response_header(resp, "Cache-Control", "no-cache");
    MHD_add_response_header(resp, "X-Accel-Buffering", "no");
}

static enum MHD_Result rt_run_stream(rt_req *q, struct MHD_Connection *c) {
    api_error e;
    if (rt_start(q, &e)) {
        enum MHD_Result mr = rt_fail(q, c, &e);
        rt_req_finish(q);
        return mr;
    }
    /* The status line goes out now: from here errors travel as SSE events. */
    q->client_fd = -1;   /* MHD notices a closed client when it writes */
    struct MHD_Response *resp = MHD_create_response_from_callback(MHD_SIZE_UNKNOWN, 4096, rt_stream_cb, q, rt_stream_free);
    if (!resp) { rt_req_finish(q); return MHD_NO; }
    rt_sse_headers(resp);
    rt_node_headers(resp, q);
    enum MHD_Result mr = MHD_queue_response(c, MHD_HTTP_OK, resp);
    MHD_destroy_response(resp);
    return mr;
}

/* ==== Several prompts (completions) ==== */

/* /v1/completions with a list of prompts: one child request (rt_req) per
 * prompt, each routed, retried and logged as a request of its own on a
 * thread of its own, so that their prefills and decodes run at once. The
 * client's reply numbers prompt k's choice i as k * n + i (as OpenAI does)
 * and its usage sums the prompts. Any prompt that cannot start fails the
 * whole request (the others stop); streamed, a prompt failing after its
 * first token ends the stream with an error event. */

/* Stream bytes the prompts may queue for a slow client before each waits
 * (a token's chunk is a few hundred bytes). */
#define RT_BATCH_QUEUE_MAX (1u << 20)

/* Prompt k's request, taking its parsed request (req). */
static rt_req *rt_kid_new(rt_batch *b, int k, api_request *req) {
    rt_req *p = b->parent;
    rt_req *q = calloc(1, sizeof *q);
    if (!q) return NULL;
    q->r = p->r;
    q->ep = p->ep;
    q->req = *req;
    memset(req, 0, sizeof *req);
    q->decode_idx = q->prefill_idx = -1;
    q->t_start = p->t_start;
    q->created = p->created;
    q->client_fd = p->client_fd;
    memcpy(q->id, p->id, sizeof q->id);
    memcpy(q->rid, p->rid, sizeof q->rid);
    q->batch = b;
    q->index_base = k * p->req.n;
    return q;
}

static void rt_batch_free(rt_batch *b) {
    for (int k = 0; k < b->n; k++)
        if (b->kid[k]) rt_req_finish(b->kid[k]);
    while (b->head) {
        rt_piece *x = b->head;
        b->head = x->next;
        free(x->s);
        free(x);
    }
    pthread_cond_destroy(&b->cv);
    pthread_mutex_destroy(&b->mu);
    free(b);
}

static rt_batch *rt_batch_new(rt_req *p, const rt_conn *cc, api_error *e) {
    rt_batch *b = calloc(1, sizeof *b);
    if (!b) { api_error_set(e, 500, "server_error", NULL, NULL, "out of memory"); return NULL; }
    b->parent = p;
    pthread_mutex_init(&b->mu, NULL);
    pthread_cond_init(&b->cv, NULL);
    atomic_init(&b->cancel, 0);
    api_request reqs[API_MAX_PROMPTS];
    int n = p->req.n_prompts;
    if (api_parse_prompt_children(p->req.kind, cc->body ? cc->body : "", cc->len, &p->r->cfg.lim, n, reqs, e)) {
        rt_batch_free(b);
        return NULL;
    }
    for (; b->n < n && (b->kid[b->n] = rt_kid_new(b, b->n, &reqs[b->n])); b->n++) {}
    if (b->n == n) return b;
    for (int k = b->n; k < n; k++) api_request_free(&reqs[k]);
    rt_batch_free(b);
    api_error_set(e, 500, "server_error", NULL, NULL, "out of memory");
    return NULL;
}

/* Every prompt stops: their readers give up, waiting threads wake. */
static void rt_batch_stop(rt_batch *b) {
    pthread_mutex_lock(&b->mu);
    atomic_store(&b->cancel, 1);
    pthread_cond_broadcast(&b->cv);
    pthread_mutex_unlock(&b->mu);
}

/* One thread per prompt; a thread that cannot be made fails its prompt. */
static void rt_batch_spawn(rt_batch *b, void *(*fn)(void *)) {
    b->running = b->n;
    for (; b->n_threads < b->n; b->n_threads++) {
        if (pthread_create(&b->th[b->n_threads], NULL, fn, b->kid[b->n_threads]) == 0) continue;
        for (int k = b->n_threads; k < b->n; k++) {
            b->failed[k] = 1;
            api_error_set(&b->err[k], 500, "server_error", NULL, NULL, "could not start a thread for prompt %d", k);
        }
        pthread_mutex_lock(&b->mu);
        b->running -= b->n - b->n_threads;
        pthread_mutex_unlock(&b->mu);
        rt_batch_stop(b);
        break;
    }
}

static void rt_batch_join(rt_batch *b) {
    for (int k = 0; k < b->n_threads; k++) pthread_join(b->th[k], NULL);
    b->n_threads = 0;
}

/* The request's error once its threads ended: the first prompt that failed
 * on its own (the others were stopped), else 499 when the client left.
 * 0 when no prompt failed. Every failed prompt is logged. */
static int rt_batch_error(rt_batch *b, api_error *e) {
    int first = -1;
    for (int k = 0; k < b->n; k++)
        if (b->failed[k] && b->err[k].status != 499 && first < 0) first = k;
    for (int k = 0; k < b->n; k++) {
        rt_req *q = b->kid[k];
        if (q->logged || (!b->failed[k] && first < 0)) continue;
        int cancelled = !b->failed[k] || b->err[k].status == 499;
        q->status = cancelled ? 499 : b->err[k].status;
        if (cancelled && first >= 0) snprintf(q->error, sizeof q->error, "stopped: prompt %d failed", first);
        else if (!q->error[0]) snprintf(q->error, sizeof q->error, "%s", b->err[k].message);
        rt_log_done(q, cancelled ? "cancelled" : "failed");
    }
    if (first >= 0) {
        *e = b->err[first];
        snprintf(e->message, sizeof e->message, "Prompt %d: %.300s", first, b->err[first].message);
        return -1;
    }
    for (int k = 0; k < b->n; k++)
        if (b->failed[k]) { api_error_set(e, 499, "invalid_request_error", NULL, NULL, "client disconnected"); return -1; }
    return 0;
}

/* ---- Non-stream ---- */

static void *rt_kid_complete_main(void *arg) {
    rt_req *q = arg;
    rt_batch *b = q->batch;
    int k = rt_kid_index(q);
    if (rt_complete(q, &b->err[k])) {
        b->failed[k] = 1;
        if (b->err[k].status != 499) rt_batch_stop(b);   /* the request fails: the others stop */
    }
    return NULL;
}

/* Every prompt's choices in one reply, usage summed over the prompts. */
static char *rt_batch_reply(rt_batch *b) {
    int per = b->parent->req.n, total = b->n * per, prompt = 0, completion = 0, ok = 1;
    char *bodies[API_MAX_CHOICES] = {0};
    for (int k = 0; k < b->n; k++) {
        ok &= rt_render_choices(b->kid[k], bodies + k * per) == 0;
        prompt += b->kid[k]->fin.prompt_tokens;
        completion += b->kid[k]->fin.completion_tokens;
    }
    char *body = ok ? api_merge_responses(bodies, total, prompt, completion) : NULL;
    for (int i = 0; i < total; i++) free(bodies[i]);
    return body;
}

static enum MHD_Result rt_batch_fail(rt_batch *b, struct MHD_Connection *c, const api_error *e) {
    rt_req *p = b->parent;
    p->status = e->status;
    if (e->status != 499) return rt_send_error(p->r, c, p->ep, e);
    metrics_add(p->r->m.cancels, NULL, 1);
    return MHD_NO;
}

static enum MHD_Result rt_run_batch_blocking(rt_batch *b, struct MHD_Connection *c) {
    rt_req *p = b->parent;
    rt_batch_spawn(b, rt_kid_complete_main);
    rt_batch_join(b);
    api_error e;
    enum MHD_Result mr;
    if (rt_batch_error(b, &e)) {
        mr = rt_batch_fail(b, c, &e);
    } else {
        p->status = 200;
        rt_count_request(p->r, p->ep, 200);
        mr = rt_reply_json(c, NULL, p->rid, rt_batch_reply(b));
    }
    rt_batch_free(b);
    rt_req_finish(p);
    return mr;
}

/* ---- Stream ---- */

/* Queues one chunk of prompt q's stream (taking q->out); waits while the
 * client is RT_BATCH_QUEUE_MAX behind. 0, or -1 when the batch stopped. */
static int rt_kid_push(rt_req *q) {
    rt_batch *b = q->batch;
    rt_piece *x = malloc(sizeof *x);
    if (!x) return -1;
    *x = (rt_piece){.s = q->out, .len = q->out_len, .failed = q->phase == 1 && q->status != 200};
    q->out = NULL;
    q->out_len = q->out_off = 0;
    pthread_mutex_lock(&b->mu);
    if (b->tail) b->tail->next = x;
    else b->head = x;
    b->tail = x;
    b->queued += x->len;
    pthread_cond_broadcast(&b->cv);
    while (b->queued > RT_BATCH_QUEUE_MAX && !atomic_load(&b->cancel)) pthread_cond_wait(&b->cv, &b->mu);
    int stop = atomic_load(&b->cancel);
    pthread_mutex_unlock(&b->mu);
    return stop ? -1 : 0;
}

/* Starts prompt q on a node, waits for the batch's go (every prompt
 * started), then streams its chunks into the queue. */
static void *rt_kid_stream_main(void *arg) {
    rt_req *q = arg;
    rt_batch *b = q->batch;
    int k = rt_kid_index(q);
    api_error e;
    int rc = rt_start(q, &e);
    pthread_mutex_lock(&b->mu);
    if (rc) {
        b->failed[k] = 1;
        b->err[k] = e;
        if (e.status != 499) atomic_store(&b->cancel, 1);
    }
    b->started++;
    pthread_cond_broadcast(&b->cv);
    while (!rc && !b->go && !atomic_load(&b->cancel)) pthread_cond_wait(&b->cv, &b->mu);
    int go = !rc && b->go && !atomic_load(&b->cancel);
    pthread_mutex_unlock(&b->mu);
    if (go) {
        q->client_fd = -1;   /* from here the batch's cancel says the client left */
        while (rt_stream_produce(q) == 0 && q->out && rt_kid_push(q) == 0) {}
    }
    pthread_mutex_lock(&b->mu);
    b->running--;
    pthread_cond_broadcast(&b->cv);
    pthread_mutex_unlock(&b->mu);
    return NULL;
}

/* Every prompt's stream ended: the usage chunk and [DONE], or an error
 * event when a prompt stopped without finishing. */
static int rt_batch_stream_end(rt_batch *b) {
    rt_req *p = b->parent;
    int prompt = 0, completion = 0, bad = -1;
    for (int k = 0; k < b->n; k++) {
        if (b->kid[k]->status != 200 && bad < 0) bad = k;
        prompt += b->kid[k]->fin.prompt_tokens;
        completion += b->kid[k]->fin.completion_tokens;
    }
    char *s = NULL;
    if (bad >= 0) {
        api_error e;
        api_error_set(&e, 502, "server_error", "upstream_failed", NULL, "Prompt %d stopped before it finished: %s", bad,
                      b->kid[bad]->error[0] ? b->kid[bad]->error : "no reason given");
        p->status = 502;
        s = api_render_error_event(&e);
    } else {
        api_resp_meta m;
        rt_meta(p, &m);
        if (p->req.include_usage) s = api_render_usage_chunk(p->req.kind, &m, prompt, completion);
        s = api_concat(s, strdup("data: [DONE]\n\n"));
        p->status = 200;
    }
    rt_count_request(p->r, p->ep, p->status);
    return rt_out_set(p, s);
}

/* The next bytes for the client: a queued chunk of any prompt (in the
 * order they came), or the end. 0, or -1 at the end of the stream. */
static int rt_batch_produce(rt_batch *b) {
    rt_req *p = b->parent;
    if (p->phase == 1) return -1;
    pthread_mutex_lock(&b->mu);
    while (!b->head && b->running > 0) pthread_cond_wait(&b->cv, &b->mu);
    rt_piece *x = b->head;
    if (x) {
        b->head = x->next;
        if (!b->head) b->tail = NULL;
        b->queued -= x->len;
        pthread_cond_broadcast(&b->cv);
    }
    pthread_mutex_unlock(&b->mu);
    p->phase = x ? 0 : 1;
    if (!x) return rt_batch_stream_end(b);
    char *s = x->s;
    if (x->failed) {   /* the error event is the stream's last word */
        rt_batch_stop(b);
        p->phase = 1;
        p->status = 502;
        rt_count_request(p->r, p->ep, 502);
    }
    free(x);
    return rt_out_set(p, s);
}

static ssize_t rt_batch_stream_cb(void *cls, uint64_t pos, char *buf, size_t max) {
    rt_batch *b = cls;
    rt_req *p = b->parent;
    (void)pos;
    while (p->out_off >= p->out_len)
        if (rt_batch_produce(b)) return MHD_CONTENT_READER_END_OF_STREAM;
    return rt_out_take(p, buf, max);
}

/* The response is over (or the client went away mid-stream). */
static void rt_batch_stream_free(void *cls) {
    rt_batch *b = cls;
    rt_req *p = b->parent;
    if (p->phase != 1 || !p->status) {
        p->status = 499;
        metrics_add(p->r->m.cancels, NULL, 1);
    }
    rt_batch_stop(b);
    rt_batch_join(b);
    for (int k = 0; k < b->n; k++) {
        rt_req *q = b->kid[k];
        if (q->logged) continue;
        q->status = 499;
        snprintf(q->error, sizeof q->error, "%s", p->status == 499 ? "client disconnected" : "stopped: another prompt failed");
        rt_log_done(q, "cancelled");
    }
    rt_batch_free(b);
    rt_req_finish(p);
}

static enum MHD_Result rt_run_batch_stream(rt_batch *b, struct MHD_Connection *c) {
    rt_req *p = b->parent;
    rt_batch_spawn(b, rt_kid_stream_main);
    pthread_mutex_lock(&b->mu);
    while (b->started < b->n_threads) pthread_cond_wait(&b->cv, &b->mu);
    int failed = atomic_load(&b->cancel);
    for (int k = 0; k < b->n; k++) failed |= b->failed[k];
    if (!failed) b->go = 1;
    pthread_cond_broadcast(&b->cv);
    pthread_mutex_unlock(&b->mu);
    struct MHD_Response *resp = NULL;
    if (!failed) resp = MHD_create_response_from_callback(MHD_SIZE_UNKNOWN, 4096, rt_batch_stream_cb, b, rt_batch_stream_free);
    if (!resp) {
        api_error e;
        rt_batch_stop(b);
        rt_batch_join(b);
        if (!failed || !rt_batch_error(b, &e)) api_error_set(&e, 500, "server_error", NULL, NULL, "out of memory");
        enum MHD_Result mr = rt_batch_fail(b, c, &e);
        rt_batch_free(b);
        rt_req_finish(p);
        return mr;
    }
    rt_sse_headers(resp);
    MHD_add_response_header(resp, "X-Request-Id", p->rid);
    enum MHD_Result mr = MHD_queue_response(c, MHD_HTTP_OK, resp);
    MHD_destroy_response(resp);
    return mr;
}

/* A request with several prompts (p->req.n_prompts > 1). */
static enum MHD_Result rt_run_batch(rt_req *p, struct MHD_Connection *c, const rt_conn *cc) {
    api_error e;
    rt_batch *b = rt_batch_new(p, cc, &e);
    if (!b) {
        p->status = e.status;
        enum MHD_Result mr = rt_send_error(p->r, c, p->ep, &e);
        rt_req_finish(p);
        return mr;
    }
    return p->req.stream ? rt_run_batch_stream(b, c) : rt_run_batch_blocking(b, c);
}

/* A generation request refused before it was routed: its one log line
 * (with an id of its own), then the error. */
static enum MHD_Result rt_refuse(router *r, struct MHD_Connection *c, int ep, const api_error *e) {
    char rid[LOG_ID_CHARS + 1];
    log_id_format(log_id_new(), rid);
    if (!r->cfg.quiet) log_refused(rid, e->status, e->message);
    return rt_send_error(r, c, ep, e);
}

static enum MHD_Result rt_generate(router *r, struct MHD_Connection *c, rt_conn *cc) {
    enum api_kind kind = cc->ep == RT_EP_CHAT ? API_CHAT : API_COMPLETION;
    api_error e;
    if (cc->too_big) {
        api_error_set(&e, 413, "invalid_request_error", "request_too_large", NULL,
                      "The request body exceeds %zu bytes.", r->cfg.max_body_bytes);
        return rt_refuse(r, c, cc->ep, &e);
    }
    rt_req *q = calloc(1, sizeof *q);
    if (!q) { api_error_set(&e, 500, "server_error", NULL, NULL, "out of memory"); return rt_refuse(r, c, cc->ep, &e); }
    q->r = r;
    q->ep = cc->ep;
    q->decode_idx = q->prefill_idx = -1;
    q->t_start = rt_now_ms();
    q->created = (long long)time(NULL);
    q->client_fd = rt_client_fd(c);
    if (api_parse_request(kind, cc->body ? cc->body : "", cc->len, &r->cfg.lim, &q->req, &e)) {
        free(q);
        return rt_refuse(r, c, cc->ep, &e);
    }
    if (!rt_model_known(r, q->req.model)) {
        api_error_set(&e, 404, "invalid_request_error", "model_not_found", "model",
                      "The model '%s' does not exist or you do not have access to it.", q->req.model);
        api_request_free(&q->req);
        free(q);
        return rt_refuse(r, c, cc->ep, &e);
    }
    /* each prompt of several is a request of its own to a node */
    int want = q->req.n_prompts > 1 ? q->req.n_prompts : 1;
    pthread_mutex_lock(&r->mu);
    int over = r->active + want > r->cfg.max_concurrent;
    if (!over) r->active += want;
    unsigned long long seq = ++r->seq;
    pthread_mutex_unlock(&r->mu);
    if (over && want > r->cfg.max_concurrent) {
        api_error_set(&e, 400, "invalid_request_error", "invalid_value", "prompt",
                      "%d prompts exceed this router's %d concurrent requests; send fewer prompts per request.",
                      want, r->cfg.max_concurrent);
        api_request_free(&q->req);
        free(q);
        return rt_refuse(r, c, cc->ep, &e);
    }
    if (over) {
        api_error_set(&e, 429, "rate_limit_error", "too_many_requests", NULL,
                      "Too many concurrent requests (limit %d); retry later.", r->cfg.max_concurrent);
        api_request_free(&q->req);
        free(q);
        return rt_refuse(r, c, cc->ep, &e);
    }
    q->counted_active = want;
    uint8_t rnd[6] = {0};
    wire_random(rnd, sizeof rnd);
    snprintf(q->id, sizeof q->id, "%s-%llu%02x%02x%02x%02x%02x%02x", kind == API_CHAT ? "chatcmpl" : "cmpl", seq,
             rnd[0], rnd[1], rnd[2], rnd[3], rnd[4], rnd[5]);
    log_id_format(log_id_new(), q->rid);
    if (q->req.n_prompts > 1) return rt_run_batch(q, c, cc);
    return q->req.stream ? rt_run_stream(q, c) : rt_run_blocking(q, c);
}

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

static enum MHD_Result rt_models(router *r, struct MHD_Connection *c) {
    const char *ids[ROUTER_MAX_NODES];
    pthread_mutex_lock(&r->mu);
    int n = rt_served_models_locked(r, ids);
    char *body = api_render_models(ids, n, r->started_unix);
    pthread_mutex_unlock(&r->mu);
    rt_count_request(r, RT_EP_MODELS, 200);
    return rt_send(c, 200, "application/json", body);
}

/* GET /v1/models/{id}: a model a healthy decode node serves, else 404. */
static enum MHD_Result rt_model_one(router *r, struct MHD_Connection *c, const char *id) {
    const char *ids[ROUTER_MAX_NODES];
    char *body = NULL;
    pthread_mutex_lock(&r->mu);
    int n = rt_served_models_locked(r, ids);
    for (int i = 0; i < n && !body; i++)
        if (!strcmp(ids[i], id)) body = api_render_model(id, r->started_unix);
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

static json_t *rt_node_json(const rt_node *n) {
    return json_pack("{s:s, s:s, s:s, s:b, s:b, s:i, s:i, s:f, s:f, s:f, s:f, s:I, s:I, s:s}",
                     "addr", n->cfg.addr, "role", n->cfg.role == ROUTER_NODE_DECODE ? "decode" : "prefill",
                     "model", n->cfg.model, "up", n->up, "registered", n->registered,
                     "inflight", n->inflight, "queue_depth", n->queue_depth,
                     "prefill_tps", n->prefill_tps, "decode_tps", n->decode_tps,
                     "kv_bytes_per_token", n->kv_bytes_per_token, "link_bytes_per_s", n->link_Bps,
                     "requests", (json_int_t)n->requests, "failures", (json_int_t)n->failures, "desc", n->desc);
}

static enum MHD_Result rt_health(router *r, struct MHD_Connection *c) {
    json_t *arr = json_array();
    int decode_up = 0;
    pthread_mutex_lock(&r->mu);
    for (int i = 0; i < r->n_nodes; i++) {
        json_array_append_new(arr, rt_node_json(&r->nodes[i]));
        decode_up += r->nodes[i].cfg.role == ROUTER_NODE_DECODE && r->nodes[i].up;
    }
    int active = r->active;
    pthread_mutex_unlock(&r->mu);
    json_t *o = json_pack("{s:s, s:s, s:i, s:o}", "status", decode_up ? "ok" : "unavailable", "role", "router",
                          "active_requests", active, "nodes", arr);
    char *s = json_dumps(o, JSON_COMPACT);
    json_decref(o);
    rt_count_request(r, RT_EP_OTHER, decode_up ? 200 : 503);
    return rt_send(c, decode_up ? 200 : 503, "application/json", s);
}


/* The registry's text, with the gauges that live in the node registry
 * copied in first (under mu, so two scrapes do not interleave). */
static enum MHD_Result rt_metrics_page(router *r, struct MHD_Connection *c) {
    rt_metrics *m = &r->m;
    pthread_mutex_lock(&r->mu);
    for (int k = 0; k < RT_NM_N; k++) metrics_clear(m->node[k]);
    for (int i = 0; i < r->n_nodes; i++) {
        const rt_node *n = &r->nodes[i];
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

static long rt_http_post(const char *addr, const char *path, const char *body, size_t len, int timeout_ms, strbuf *out);

/* The decode node for a tokenizer request: "model" if given, else the only
 * model served. -1 with e filled. */
static int rt_tokens_node(router *r, json_t *o, char *addr, size_t addrlen, api_error *e) {
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
    if (idx >= 0) snprintf(addr, addrlen, "%s", r->nodes[idx].cfg.addr);
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

static enum MHD_Result rt_tokens(router *r, struct MHD_Connection *c, rt_conn *cc, int detok) {
    api_error e;
    char addr[128];
    if (cc->too_big) {
        api_error_set(&e, 413, "invalid_request_error", "request_too_large", NULL, "The request body exceeds %zu bytes.", r->cfg.max_body_bytes);
        return rt_send_error(r, c, RT_EP_OTHER, &e);
    }
    json_t *o = json_loadb(cc->body ? cc->body : "", cc->len, 0, NULL);
    if (!json_is_object(o)) {
        json_decref(o);
        api_error_set(&e, 400, "invalid_request_error", "invalid_json", NULL, "The request body must be a JSON object.");
        return rt_send_error(r, c, RT_EP_OTHER, &e);
    }
    int rc = rt_tokens_node(r, o, addr, sizeof addr, &e);
    json_decref(o);
    if (rc) return rt_send_error(r, c, RT_EP_OTHER, &e);
    strbuf b = {0};
    long st = rt_http_post(addr, detok ? "/v1/detokenize" : "/v1/tokenize", cc->body, cc->len, r->cfg.request_timeout_ms, &b);
    if (st <= 0 || !b.p) {
        free(b.p);
        api_error_set(&e, 502, "server_error", "upstream_failed", NULL, "Decode node %s did not answer.", addr);
        return rt_send_error(r, c, RT_EP_OTHER, &e);
    }
    rt_count_request(r, RT_EP_OTHER, (int)st);
    return rt_send(c, (int)st, "application/json", b.p);
}

/* ==== Node registration ==== */

/* Adds or refreshes a node; returns its index or -1. Caller holds mu. */
static int rt_node_upsert_locked(router *r, const router_node_cfg *cfg, int registered) {
    for (int i = 0; i < r->n_nodes; i++) {
        rt_node *n = &r->nodes[i];
        if (!strcmp(n->cfg.addr, cfg->addr) && n->cfg.role == cfg->role) {
            snprintf(n->cfg.model, sizeof n->cfg.model, "%s", cfg->model);
            if (registered) { n->registered = 1; n->last_heartbeat_ms = rt_now_ms(); }
            return i;
        }
    }
    if (r->n_nodes >= ROUTER_MAX_NODES) return -1;
    rt_node *n = &r->nodes[r->n_nodes];
    memset(n, 0, sizeof *n);
    n->cfg = *cfg;
    n->registered = registered;
    n->last_heartbeat_ms = rt_now_ms();
    return r->n_nodes++;
}

/* A registered name or address ends up in URLs, metrics labels and logs:
 * printable, no spaces, no quotes or backslashes. */
static int rt_reg_token_ok(const char *s, size_t len, size_t max) {
    if (len == 0 || len >= max || strlen(s) != len) return 0;
    for (; *s; s++)
        if ((unsigned char)*s <= ' ' || *s == 0x7f || *s == '"' || *s == '\\') return 0;
    return 1;
}

/* {"role", "model", "addr"} into *nc; 0, or -1 with a message. */
static int rt_reg_parse(const char *body, size_t len, router_node_cfg *nc, char *err, size_t errlen) {
    json_t *o = json_loadb(body ? body : "", len, JSON_REJECT_DUPLICATES, NULL);
    json_t *role = json_object_get(o, "role"), *model = json_object_get(o, "model"), *addr = json_object_get(o, "addr");
    const char *rs = json_string_value(role), *a = json_string_value(addr);
    const char *colon = a ? strrchr(a, ':') : NULL;
    int rc = -1;
    memset(nc, 0, sizeof *nc);
    nc->role = rs && !strcmp(rs, "decode") ? ROUTER_NODE_DECODE : rs && !strcmp(rs, "prefill") ? ROUTER_NODE_PREFILL : 0;
    if (!json_is_object(o)) rt_errf(err, errlen, "the body must be a JSON object");
    else if (!nc->role) rt_errf(err, errlen, "\"role\" must be \"decode\" or \"prefill\"");
    else if (!json_is_string(model) || !rt_reg_token_ok(json_string_value(model), json_string_length(model), sizeof nc->model))
        rt_errf(err, errlen, "\"model\" must be a non-empty printable name without spaces, under %zu bytes", sizeof nc->model);
    else if (!json_is_string(addr) || !rt_reg_token_ok(a, json_string_length(addr), sizeof nc->addr) || !colon ||
             colon == a || strspn(colon + 1, "0123456789") != strlen(colon + 1) || !colon[1] || strlen(colon + 1) > 5)
        rt_errf(err, errlen, "\"addr\" must be HOST:PORT");
    else {
        snprintf(nc->model, sizeof nc->model, "%s", json_string_value(model));
        snprintf(nc->addr, sizeof nc->addr, "%s", a);
        rc = 0;
    }
    json_decref(o);
    return rc;
}

/* POST /v1/nodes/register: signed (node_auth.h, registration key), never
 * replayed (nonce cache), never touching a statically configured node. */
static enum MHD_Result rt_register(router *r, struct MHD_Connection *c, rt_conn *cc) {
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
    if (rt_reg_parse(cc->body, cc->len, &nc, err, sizeof err)) {
        api_error_set(&e, 400, "invalid_request_error", NULL, NULL, "Bad registration: %s.", err);
        return rt_send_error(r, c, RT_EP_OTHER, &e);
    }
    const char *role = nc.role == ROUTER_NODE_DECODE ? "decode" : "prefill";
    pthread_mutex_lock(&r->mu);
    int i = -1, is_static = 0;
    for (int k = 0; k < r->n_nodes; k++)
        if (r->nodes[k].cfg.role == nc.role && !strcmp(r->nodes[k].cfg.addr, nc.addr)) i = k;
    is_static = i >= 0 && !r->nodes[i].registered;
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

/* ==== Request dispatch ==== */

static int rt_route(const char *method, const char *url, int *ep, int *post) {
    *post = !strcmp(method, "POST");
    if (!strcmp(url, "/v1/chat/completions")) { *ep = RT_EP_CHAT; return 1; }
    if (!strcmp(url, "/v1/completions")) { *ep = RT_EP_COMPLETIONS; return 1; }
    if (!strcmp(url, "/v1/nodes/register") || !strcmp(url, "/tokenize") || !strcmp(url, "/detokenize")) {
        *ep = RT_EP_OTHER;
        return 1;
    }
    *ep = !strncmp(url, "/v1/models", 10) ? RT_EP_MODELS : RT_EP_OTHER;
    return 0;   /* GET endpoints */
}

static int rt_authorized(router *r, struct MHD_Connection *c, const char *url) {
    if (!r->cfg.api_key[0] || !strncmp(url, "/health", 7) || !strcmp(url, "/metrics") ||
        !strcmp(url, "/v1/nodes/register"))
        return 1;
    const char *h = MHD_lookup_connection_value(c, MHD_HEADER_KIND, "Authorization");
    size_t kl = strlen(r->cfg.api_key);
    return h && !strncmp(h, "Bearer ", 7) && strlen(h + 7) == kl && !CRYPTO_memcmp(h + 7, r->cfg.api_key, kl);
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
    int known_get = !strcmp(url, "/v1/models") || (!strncmp(url, "/v1/models/", 11) && url[11]) ||
                    !strcmp(url, "/health") || !strcmp(url, "/metrics");
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
    if (post && cl && strtoull(cl, NULL, 10) > r->cfg.max_body_bytes) {
        api_error_set(&e, 413, "invalid_request_error", "request_too_large", NULL,
                      "The request body (%s bytes) exceeds %zu bytes.", cl, r->cfg.max_body_bytes);
        return rt_send_error(r, c, ep, &e);
    }
    rt_conn *cc = calloc(1, sizeof *cc);
    if (!cc) return MHD_NO;
    cc->ep = ep;
    *con_cls = cc;
    return MHD_YES;
}

static enum MHD_Result rt_handler(void *cls, struct MHD_Connection *c, const char *url, const char *method,
                                  const char *version, const char *upload_data, size_t *upload_size, void **con_cls) {
    router *r = cls;
    if (!*con_cls) return rt_first_call(r, c, url, method, con_cls);
    rt_conn *cc = *con_cls;
    if (*upload_size) {
        if (!cc->too_big && cc->len + *upload_size > r->cfg.max_body_bytes) {
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
    if (!strcmp(url, "/v1/nodes/register")) return rt_register(r, c, cc);
    return rt_generate(r, c, cc);
}

static void rt_completed(void *cls, struct MHD_Connection *c, void **con_cls, enum MHD_RequestTerminationCode tc) {
    rt_conn *cc = *con_cls;
    if (!cc) return;
    free(cc->body);
    free(cc);
    *con_cls = NULL;
}

/* ==== Health checks ==== */

static size_t rt_sink(char *p, size_t sz, size_t nm, void *ud) {
    strbuf *b = ud;
    size_t n = sz * nm;
    if (b->len + n > (1u << 20)) return 0;   /* a health reply is tiny */
    return strbuf_put(b, p, n) ? 0 : n;
}

/* err (NULL: not wanted): libcurl's reason when no reply came. */
static long rt_http_get(const char *addr, const char *path, int timeout_ms, strbuf *out, char *err, size_t errlen) {
    char url[256], cerr[CURL_ERROR_SIZE] = "";
    snprintf(url, sizeof url, "http://%s%s", addr, path);
    CURL *h = curl_easy_init();
    if (!h) { if (err) snprintf(err, errlen, "out of memory"); return -1; }
    curl_easy_setopt(h, CURLOPT_ERRORBUFFER, cerr);
    curl_easy_setopt(h, CURLOPT_URL, url);
    curl_easy_setopt(h, CURLOPT_WRITEFUNCTION, rt_sink);
    curl_easy_setopt(h, CURLOPT_WRITEDATA, out);
    curl_easy_setopt(h, CURLOPT_NOSIGNAL, 1L);
    curl_easy_setopt(h, CURLOPT_TIMEOUT_MS, (long)timeout_ms);
    curl_easy_setopt(h, CURLOPT_PROXY, "");
    long code = -1;
    CURLcode rc = curl_easy_perform(h);
    if (rc == CURLE_OK) curl_easy_getinfo(h, CURLINFO_RESPONSE_CODE, &code);
    else if (err) snprintf(err, errlen, "%s", cerr[0] ? cerr : curl_easy_strerror(rc));
    curl_easy_cleanup(h);
    return code;
}

static long rt_http_post(const char *addr, const char *path, const char *body, size_t len, int timeout_ms, strbuf *out) {
    char url[256];
    snprintf(url, sizeof url, "http://%s%s", addr, path);
    CURL *h = curl_easy_init();
    struct curl_slist *hd = curl_slist_append(NULL, "Content-Type: application/json");
    long code = -1;
    if (h && hd) {
        curl_easy_setopt(h, CURLOPT_URL, url);
        curl_easy_setopt(h, CURLOPT_POSTFIELDS, body ? body : "");
        curl_easy_setopt(h, CURLOPT_POSTFIELDSIZE, (long)len);
        curl_easy_setopt(h, CURLOPT_HTTPHEADER, hd);
        curl_easy_setopt(h, CURLOPT_WRITEFUNCTION, rt_sink);
        curl_easy_setopt(h, CURLOPT_WRITEDATA, out);
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
static int rt_count_tokens(router *r, const char *addr, const api_request *req, char *err, size_t errlen) {
    char *body = api_upstream_body(req, "local", NULL);
    if (!body) { rt_errf(err, errlen, "out of memory"); return -1; }
    strbuf b = {0};
    double t0 = rt_now_ms();
    long st = rt_http_post(addr, "/v1/tokenize", body, strlen(body), r->cfg.tokenize_timeout_ms, &b);
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
    int queue, slots, queue_max;
    double prefill_tps, decode_tps;
    char chat_format[16];
    char err[256];               /* why the probe failed */
} rt_probe;

static void rt_probe_decode(const char *addr, int timeout_ms, rt_probe *p) {
    strbuf b = {0};
    long code = rt_http_get(addr, "/health", timeout_ms, &b, p->err, sizeof p->err);
    json_t *o = b.p ? json_loadb(b.p, b.len, 0, NULL) : NULL;
    p->ok = code == 200 && json_is_object(o);
    if (!p->ok && code >= 0) snprintf(p->err, sizeof p->err, "GET /health answered HTTP %ld%s", code, code == 200 ? " without a JSON object" : "");
    const char *model = json_string_value(json_object_get(o, "model"));
    if (model) snprintf(p->desc, sizeof p->desc, "%s", model);
    const char *cf = json_string_value(json_object_get(o, "chat_format"));
    snprintf(p->chat_format, sizeof p->chat_format, "%s", cf ? cf : "");
    json_decref(o);
    free(b.p);
    p->queue = -1;
    p->prefill_tps = p->decode_tps = -1;
    if (!p->ok) return;
    strbuf s = {0};
    if (rt_http_get(addr, "/v1/stats", timeout_ms, &s, NULL, 0) == 200 && s.p) {
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
            }
            else snprintf(err, errlen, "a %s node, not a prefill node", wire_role_name(hello.role));
        }
    }
    wire_conn_close(&wc);
}

/* One probe of every node. startup: the round before the router serves,
 * which logs every configured node as reachable or not (with the reason);
 * later rounds log only changes. */
static void rt_health_round(router *r, int startup) {
    int n;
    router_node_cfg cfgs[ROUTER_MAX_NODES];
    pthread_mutex_lock(&r->mu);
    n = r->n_nodes;
    for (int i = 0; i < n; i++) cfgs[i] = r->nodes[i].cfg;
    pthread_mutex_unlock(&r->mu);
    int timeout = r->cfg.health_interval_ms < 1000 ? 1000 : r->cfg.health_interval_ms;
    for (int i = 0; i < n && !r->stopping; i++) {
        rt_probe p;
        memset(&p, 0, sizeof p);
        if (cfgs[i].role == ROUTER_NODE_DECODE) rt_probe_decode(cfgs[i].addr, timeout, &p);
        else rt_probe_prefill(cfgs[i].addr, timeout, &p);
        pthread_mutex_lock(&r->mu);
        rt_node *nd = &r->nodes[i];
        double now = rt_now_ms();
        int expired = nd->registered && now - nd->last_heartbeat_ms > r->cfg.heartbeat_ttl_ms;
        if (p.ok && !expired) {
            if (!nd->up) log_info(NULL, "%s node %s (model %s) %s: %s", cfgs[i].role == ROUTER_NODE_DECODE ? "decode" : "prefill",
                                  cfgs[i].addr, cfgs[i].model, startup ? "reachable at start-up" : "is up", p.desc);
            nd->up = 1;
            nd->fails = 0;
            snprintf(nd->desc, sizeof nd->desc, "%s", p.desc);
            snprintf(nd->chat_format, sizeof nd->chat_format, "%s", p.chat_format);
            if (p.queue >= 0) { nd->queue_depth = p.queue; nd->inflight_at_report = nd->inflight; }
            if (cfgs[i].role == ROUTER_NODE_DECODE) {
                nd->slots = p.slots;
                nd->queue_max = p.queue_max;
                nd->queue_known = p.queue_max >= 0;
            }
            if (p.prefill_tps > 0) nd->prefill_tps = p.prefill_tps;
            if (p.decode_tps > 0) nd->decode_tps = p.decode_tps;
        } else {
            nd->fails++;
            nd->checks_failed++;
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
    }
}

static void *rt_health_main(void *arg) {
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
    httpd_limits lim = { .max_conns = conn_limit, .max_conns_per_ip = (unsigned)cfg->max_conns_per_ip,
                         .request_deadline_ms = cfg->request_deadline_ms, .idle_timeout_s = 60 };
    if (httpd_start(&r->http, &lim, fd, rt_handler, r, rt_completed, r, herr, sizeof herr)) {
        rt_errf(err, errlen, "%s: %s", cfg->listen, herr);
        router_stop(r);
        return -1;
    }
    r->port = httpd_port(r->http);
    rt_health_round(r, 1);   /* know who is up before the first request */
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

/* ==== CLI ==== */

void router_usage(FILE *f) {
    fprintf(f,
        "usage: tandem serve --role router (--config FILE | --decode MODEL=HOST:PORT ... |\n"
        "                                   --secret-file FILE) [options]\n"
        "  nodes come from --config, --decode/--prefill, or register themselves (needs the secret)\n"
        "  --config FILE          JSON config (docs/router.md): listen, nodes, secret, limits, split\n"
        "  --listen HOST:PORT     address (default 127.0.0.1:8000; port 0 = any free port)\n"
        "  --decode MODEL=HOST:PORT    a decode node serving MODEL (repeatable)\n"
        "  --prefill MODEL=HOST:PORT   a prefill node for MODEL (repeatable)\n"
        "  --split auto|always|never   prefill placement policy (default auto: cost model)\n"
        "  --secret-file FILE     shared secret (node registration); or env TANDEM_SECRET\n"
        "  --api-key-file FILE    require 'Authorization: Bearer <key>'; or env TANDEM_API_KEY\n"
        "  --port-file FILE       write the bound port there once listening\n"
        "  --max-concurrent N     generation requests in flight (default 64)\n"
        "  --health-interval-ms N (default 1000)\n"
        "  --quiet                no per-request log lines\n"
        "  --log-level LEVEL      error, warn, info (default) or debug; or env TANDEM_LOG_LEVEL\n");
}

static void rt_usage(void) { router_usage(stderr); }

#define RT_CMD "tandem serve"

/* --decode / --prefill MODEL=HOST:PORT. */
static int rt_cli_node(router_config *c, const char *opt, const char *role, const char *v) {
    char buf[300], err[256];
    if (cliopt_str(RT_CMD, opt, v, &v)) return -1;
    const char *eq = strchr(v, '=');
    if (!eq || eq == v || strlen(v) >= sizeof buf) {
        fprintf(stderr, RT_CMD ": %s: '%s' is not MODEL=HOST:PORT (at most %zu bytes)\n", opt, v, sizeof buf - 1);
        return -1;
    }
    snprintf(buf, sizeof buf, "%s", v);
    buf[eq - v] = 0;
    if (router_config_add_node(c, role, buf, buf + (eq - v) + 1, err, sizeof err)) {
        fprintf(stderr, RT_CMD ": %s: %s\n", opt, err);
        return -1;
    }
    return 0;
}

/* A key file is a line of text; a bigger file is the wrong one, refused unread. */
#define RT_MAX_KEY_FILE 4096

/* The text of the file at path, trailing whitespace stripped, into out: 1
 * to outlen - 1 bytes. 0, or -1 with a message. */
static int rt_cli_file_str(const char *path, char *out, size_t outlen, char *err, size_t errlen) {
    size_t n = 0;
    char *s = cliopt_read_text(path, RT_MAX_KEY_FILE, &n, err, errlen);
    if (!s) return -1;
    while (n && (s[n - 1] == '\n' || s[n - 1] == '\r' || s[n - 1] == ' ')) s[--n] = 0;
    int bad = n == 0 || n >= outlen;
    if (bad) snprintf(err, errlen, "the key in %s is not 1 to %zu bytes", path, outlen - 1);
    else snprintf(out, outlen, "%s", s);
    free(s);
    return bad ? -1 : 0;
}

/* --api-key-file FILE: the key is the file's text, 1 to 255 bytes. */
static int rt_cli_api_key(router_config *c, const char *opt, const char *v) {
    char err[600];
    if (cliopt_str(RT_CMD, opt, v, &v)) return -1;
    if (!rt_cli_file_str(v, c->api_key, sizeof c->api_key, err, sizeof err)) return 0;
    fprintf(stderr, RT_CMD ": %s: %s\n", opt, err);
    return -1;
}

static int rt_cli_config(router_config *c, const char *opt, const char *v) {
    char err[256];
    if (cliopt_str(RT_CMD, opt, v, &v)) return -1;
    if (!router_config_load(c, v, err, sizeof err)) return 0;
    fprintf(stderr, RT_CMD ": %s: %s\n", opt, err);
    return -1;
}

/* the order of enum router_split */
static const char *const rt_cli_splits[] = { "auto", "always", "never", NULL };
static const char *const rt_cli_roles[] = { "router", NULL };

/* Parses the options; 0, or -1 after printing what is wrong (cliopt.h:
 * each bad value is named with its valid range). */
static int rt_cli_parse(int argc, char **argv, router_config *c, const char **port_file) {
    const char *listen = NULL, *secret_file = NULL;
    for (int i = 0; i < argc; i++) {
        const char *a = argv[i], *v = i + 1 < argc ? argv[i + 1] : NULL;
        int bad = 0, k;
        if (!strcmp(a, "--quiet")) { c->quiet = 1; continue; }
        if (!strcmp(a, "--role")) bad = cliopt_choice(RT_CMD, a, v, rt_cli_roles, &k);
        else if (!strcmp(a, "--config")) bad = rt_cli_config(c, a, v);
        else if (!strcmp(a, "--listen")) bad = cliopt_str(RT_CMD, a, v, &listen);
        else if (!strcmp(a, "--decode")) bad = rt_cli_node(c, a, "decode", v);
        else if (!strcmp(a, "--prefill")) bad = rt_cli_node(c, a, "prefill", v);
        else if (!strcmp(a, "--split")) { bad = cliopt_choice(RT_CMD, a, v, rt_cli_splits, &k); if (!bad) c->split = k; }
        else if (!strcmp(a, "--secret-file")) bad = cliopt_str(RT_CMD, a, v, &secret_file);
        else if (!strcmp(a, "--api-key-file")) bad = rt_cli_api_key(c, a, v);
        else if (!strcmp(a, "--port-file")) bad = cliopt_str(RT_CMD, a, v, port_file);
        /* the same ranges as the config file's keys */
        else if (!strcmp(a, "--max-concurrent")) bad = cliopt_int(RT_CMD, a, v, 1, 100000, &c->max_concurrent);
        else if (!strcmp(a, "--health-interval-ms")) bad = cliopt_int(RT_CMD, a, v, 50, 600000, &c->health_interval_ms);
        else { fprintf(stderr, RT_CMD ": unknown router option %s\n", a); rt_usage(); return -1; }
        if (bad) return -1;   /* cliopt or the helper said what is wrong */
        i++;
    }
    if (listen) snprintf(c->listen, sizeof c->listen, "%s", listen);
    char err[256];
    if (secret_file || (!c->secret && getenv("TANDEM_SECRET"))) {
        router_config_free(c);
        if (cliopt_load_secret(secret_file, &c->secret, &c->secret_len, err, sizeof err)) {
            fprintf(stderr, RT_CMD ": %s\n", err);
            return -1;
        }
    }
    const char *k = getenv("TANDEM_API_KEY");
    if (!c->api_key[0] && k && *k) snprintf(c->api_key, sizeof c->api_key, "%s", k);
    return 0;
}

int router_cli(int argc, char **argv) {
    router_config c;
    router_config_default(&c);
    const char *port_file = NULL;
    if (rt_cli_parse(argc, argv, &c, &port_file)) { router_config_free(&c); return 2; }
    if (c.n_nodes == 0 && !c.secret) {   /* it would listen with nothing to route to, and no way to learn any */
        fprintf(stderr, "tandem serve: the router has no nodes: give --decode MODEL=HOST:PORT, --config FILE, "
                "or a shared secret (--secret-file / TANDEM_SECRET) for nodes to register\n");
        router_config_free(&c);
        return 2;
    }
    volatile int *stop = cliopt_stop_on_signals();
    router *r = NULL;
    char err[512];
    if (router_start(&r, &c, err, sizeof err)) {
        log_error(NULL, "%s", err);
        router_config_free(&c);
        return 1;
    }
    log_info(NULL, "listening on port %d (%s), %d node(s), split policy %s%s", router_port(r), c.listen, c.n_nodes,
           c.split == ROUTER_SPLIT_AUTO ? "auto" : c.split == ROUTER_SPLIT_ALWAYS ? "always" : "never",
           c.api_key[0] ? ", API key required" : "");
    if (port_file) {
        FILE *f = fopen(port_file, "w");
        if (f) { fprintf(f, "%d\n", router_port(r)); fclose(f); }
    }
    while (!*stop) usleep(100 * 1000);
    log_info(NULL, "shutting down");
    router_stop(r);
    router_config_free(&c);
    return 0;
}

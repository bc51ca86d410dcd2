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
 */
#include "node/node_decode.h"

#include <errno.h>
#include <fcntl.h>
#include <math.h>
#include <netdb.h>
#include <pthread.h>
#include <signal.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <sys/types.h>
#include <time.h>
#include <unistd.h>

#include <jansson.h>
#include <microhttpd.h>

#include "base/cliopt.h"
#include "engine/fingerprint.h"
#include "engine/generate.h"
#include "engine/gguf.h"
#include "engine/grammar.h"
#include "node/chain.h"
#include "node/handoff.h"
#include "engine/kvcache.h"
#include "node/kvstore.h"
#include "node/prefix_report.h"
#include "node/node_drain.h"
#include "node/scheduler.h"
#include "base/prefix_hash.h"
#include "base/strbuf.h"
#include "net/httpd.h"
#include "base/log.h"
#include "base/logsafe.h"
#include "base/metrics.h"
#include "node/draft.h"
#include "node/draft_remote.h"
#include "node/spec_report.h"
#include "net/node_auth.h"
#include "net/node_register.h"
#include "base/platform.h"
#include "engine/sampler.h"
#include "api/tok_api.h"
#include "net/prefill_rate.h"
#include "engine/tokenizer.h"
#include "base/unicode.h"
#include "api/extensions.h"
#include "api/tools.h"

/* ==== Constants ==== */

/* Clients tracked at once: far more than the slots and queue can hold
 * requests of (a request past them is refused anyway). */
#define DN_MAX_CLIENTS 1024
/* Default share of slots + queue one client may hold: two busy clients
 * can fill the node, one cannot lock everyone else out. */
#define DN_DEFAULT_CLIENT_SHARE 50
/* The router names the client of a signed request (its API key's name or
 * its address) in this header, at most DN_CLIENT_MAX_LEN bytes. */
#define DN_CLIENT_HDR "X-Tandem-Client"
#define DN_CLIENT_MAX_LEN 128
#define DN_MAX_STOP 8              /* stop strings per request */
#define DN_MAX_STOP_LEN 256        /* bytes per stop string */
#define DN_MAX_PEERS 16            /* cached prefill-node connections (configured + overrides) */
#define DN_EMA_ALPHA 0.25          /* moving averages: recent requests dominate, one outlier fades in ~8 */
#define DN_STALE_RETRY_MS 1000.0   /* a reused connection failing faster than this was probably closed idle */
#define DN_MAX_TOKENS_LIMIT 1000000
#define DN_STREAM_BLOCK 4096       /* MHD's buffer for streamed responses */
#define DN_MAX_MESSAGES 1024      /* chat messages per request */
#define DN_MIN_REUSE 32            /* shared tokens worth truncating another session's cache for */
#define DN_MAX_DEFAULT_SLOTS 8     /* default --parallel ceiling (memory permitting) */
#define DN_MAX_CHOICES 8           /* "n": choices per request, one slot each (the router's API_MAX_N) */

enum { DN_PF_AUTO = 0, DN_PF_REMOTE, DN_PF_LOCAL };

/* ==== Small helpers ==== */

/* A JSON string of arbitrary bytes: invalid UTF-8 becomes U+FFFD (a token
 * can end in the middle of a character; JSON cannot carry raw bytes). */
static json_t *dn_json_text(const char *s, size_t n) {
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

/* ==== Node state ==== */

/* A connection to a prefill node, lent to one request at a time. */
typedef struct {
    char addr[256];
    handoff_client *c;
    int in_use;
    uint64_t last_used;
    prefix_held held;            /* the prompt its session on the prefill node holds (prefix_report.h) */
} dn_peer;

typedef struct {
    uint64_t requests, ok, bad, busy, failed, cancelled;
    uint64_t prompt_tokens, completion_tokens, reused_positions;
    uint64_t remote_prefills, local_prefills, fallbacks;
    uint64_t positions_received, kv_bytes, wire_bytes;
    double prefill_tps_local, prefill_tps_remote, decode_tps, ttft_ms, handoff_gbps;
} dn_stats;

/* /metrics families (metrics.h; docs/router.md lists them). */
typedef struct {
    metrics *reg;
    char model[128];             /* every series' "model" label */
    metrics_family *requests, *prompt_tokens, *completion_tokens, *reused_tokens, *prefills, *fallbacks, *kv_received;
    metrics_family *queue, *ttft, *e2e, *prefill, *tpot;
    metrics_family *slots, *slots_busy, *queued, *queue_cap, *kv_tokens, *kv_capacity, *kv_usage, *steps, *batched;
    kvstore_metrics store;       /* with --kv-cache-ram / --kv-cache-dir */
    spec_metrics spec;           /* speculative decoding (spec_report.h) */
} dn_metrics;

typedef struct {
    model *m;
    const decode_node_opts *o;
    const tokenizer *tok;
    int n_ctx, n_vocab, n_slots, queue_max, min_split, timeout_ms;
    uint32_t kv_dtype, wire_dtype;
    uint64_t prefix_seed;        /* block hashes of the prefix report (prefix_report.h) */
    int prefix_ok;               /* the seed is known (the model's fingerprint was taken) */
    const char *role;
    char desc[512];
    volatile int stopping;
    sched *sc;                   /* continuous batching: slots, queue, the model's thread */
    kvstore *store;              /* KV prefix store (memory, disk), or NULL */
    draft_src *draft;            /* speculative drafts (draft.h), or NULL */
    /* prefill-node connections (pmu) */
    pthread_mutex_t pmu;
    dn_peer peers[DN_MAX_PEERS];
    chain_pool *chains;          /* layer-split chains' connection sets (chain.h) */
    uint64_t tick;
    unsigned rr;
    /* counters (smu) */
    pthread_mutex_t smu;
    dn_stats st;
    dn_metrics mt;
    /* the vocabulary index for constrained decoding, built at the first
     * request that needs it (gmu) */
    pthread_mutex_t gmu;
    grammar_vocab *gvocab;
    /* request authentication (node_auth.h): on when the node has a secret */
    int auth;
    node_auth_key key;
    node_auth_replay *replay;
    /* requests in flight per client (cmu): at most client_cap each */
    pthread_mutex_t cmu;
    struct { uint64_t id; int n; } clients[DN_MAX_CLIENTS];
    int client_cap;
} dnode;

static void dn_ema(double *avg, double x) {
    if (!(x > 0) || !isfinite(x)) return;
    *avg = *avg > 0 ? (1 - DN_EMA_ALPHA) * *avg + DN_EMA_ALPHA * x : x;
}

/* ==== Metrics ==== */

static int dn_metrics_counters(dn_metrics *m, char *err, size_t errlen) {
    static const char *const lm[] = {"model", NULL};
    metrics *g = m->reg;
    return !(m->requests = metrics_counter(g, "tandem_decode_requests_total",
                                           "POST /v1/generate requests by outcome: ok, error, cancelled (client went away), "
                                           "rejected (4xx), busy (503).", (const char *[]){"model", "outcome", NULL}, err, errlen)) ||
           !(m->prompt_tokens = metrics_counter(g, "tandem_decode_prompt_tokens_total", "Prompt tokens of admitted requests.",
                                                lm, err, errlen)) ||
           !(m->reused_tokens = metrics_counter(g, "tandem_decode_prompt_tokens_reused_total",
                                                "Prompt positions taken from a cached prefix instead of computed.", lm, err, errlen)) ||
           !(m->completion_tokens = metrics_counter(g, "tandem_decode_completion_tokens_total", "Generated tokens.",
                                                    lm, err, errlen)) ||
           !(m->prefills = metrics_counter(g, "tandem_decode_prefills_total", "Prompts prefilled, by where: local or remote.",
                                           (const char *[]){"model", "mode", NULL}, err, errlen)) ||
           !(m->fallbacks = metrics_counter(g, "tandem_decode_prefill_fallbacks_total",
                                            "Remote prefills that failed and were done locally.", lm, err, errlen)) ||
           !(m->kv_received = metrics_counter(g, "tandem_decode_kv_received_bytes_total",
                                              "KV cache bytes received from prefill nodes.", lm, err, errlen)) ||
           !(m->steps = metrics_counter(g, "tandem_decode_batch_steps_total", "Model passes of the batching scheduler.",
                                        lm, err, errlen)) ||
           !(m->batched = metrics_counter(g, "tandem_decode_batched_tokens_total", "Tokens those passes evaluated.",
                                          lm, err, errlen));
}

static int dn_metrics_histograms(dn_metrics *m, char *err, size_t errlen) {
    static const char *const lm[] = {"model", NULL};
    metrics *g = m->reg;
    return !(m->queue = metrics_histogram(g, "tandem_decode_queue_seconds", "Arrival to admission into a generation slot.",
                                          lm, metrics_buckets_latency, METRICS_N_LATENCY, err, errlen)) ||
           !(m->ttft = metrics_histogram(g, "tandem_decode_ttft_seconds", "Arrival to the first generated token.",
                                         lm, metrics_buckets_latency, METRICS_N_LATENCY, err, errlen)) ||
           !(m->e2e = metrics_histogram(g, "tandem_decode_request_duration_seconds",
                                        "Arrival to the end of the request (last byte queued), admitted requests.",
                                        lm, metrics_buckets_latency, METRICS_N_LATENCY, err, errlen)) ||
           !(m->prefill = metrics_histogram(g, "tandem_decode_prefill_seconds",
                                            "Admission to the whole prompt in the cache (local or remote).",
                                            lm, metrics_buckets_latency, METRICS_N_LATENCY, err, errlen)) ||
           !(m->tpot = metrics_histogram(g, "tandem_decode_tpot_seconds", "Time per output token after the first.",
                                         lm, metrics_buckets_fast, METRICS_N_FAST, err, errlen));
}

static int dn_metrics_gauges(dn_metrics *m, char *err, size_t errlen) {
    static const char *const lm[] = {"model", NULL};
    metrics *g = m->reg;
    return !(m->slots = metrics_gauge(g, "tandem_decode_slots", "Generation slots (sequences decoded together).",
                                      lm, err, errlen)) ||
           !(m->slots_busy = metrics_gauge(g, "tandem_decode_slots_busy", "Slots running a request now.", lm, err, errlen)) ||
           !(m->queued = metrics_gauge(g, "tandem_decode_queue_depth", "Requests waiting for a slot.", lm, err, errlen)) ||
           !(m->queue_cap = metrics_gauge(g, "tandem_decode_queue_capacity", "Requests that may wait before 503.",
                                          lm, err, errlen)) ||
           !(m->kv_tokens = metrics_gauge(g, "tandem_decode_kv_cache_tokens", "Positions held in the slots' KV caches.",
                                          lm, err, errlen)) ||
           !(m->kv_capacity = metrics_gauge(g, "tandem_decode_kv_cache_capacity_tokens",
                                            "Positions the KV caches can hold (slots x context).", lm, err, errlen)) ||
           !(m->kv_usage = metrics_gauge(g, "tandem_decode_kv_cache_usage_ratio",
                                         "kv_cache_tokens / kv_cache_capacity_tokens.", lm, err, errlen));
}

/* The families, and the series certain to occur created at zero. */
static int dn_metrics_init(dn_metrics *m, const decode_node_opts *o, char *err, size_t errlen) {
    if (o->model_name && *o->model_name) snprintf(m->model, sizeof m->model, "%s", o->model_name);
    else node_register_default_model(o->model_path ? o->model_path : "model", m->model, sizeof m->model);
    if (!(m->reg = metrics_new())) { snprintf(err, errlen, "out of memory"); return -1; }
    if (dn_metrics_counters(m, err, errlen) || dn_metrics_histograms(m, err, errlen) || dn_metrics_gauges(m, err, errlen) ||
        spec_metrics_init(&m->spec, m->reg, err, errlen))
        return -1;
    const char *const lm[] = {m->model};
    metrics_family *one[] = {m->prompt_tokens, m->reused_tokens, m->completion_tokens, m->fallbacks, m->kv_received,
                             m->queue, m->ttft, m->e2e, m->prefill, m->tpot};
    for (size_t i = 0; i < sizeof one / sizeof one[0]; i++) metrics_touch(one[i], lm);
    metrics_touch(m->requests, (const char *[]){m->model, "ok"});
    metrics_touch(m->prefills, (const char *[]){m->model, "local"});
    return 0;
}

static void dn_metrics_outcome(dn_metrics *m, const char *outcome) {
    metrics_add(m->requests, (const char *[]){m->model, outcome}, 1);
}

/* A refused POST /v1/generate: 503 busy, else rejected (4xx) or error (5xx). */
static void dn_metrics_refused(dn_metrics *m, unsigned status) {
    dn_metrics_outcome(m, status == 503 ? "busy" : status < 500 ? "rejected" : "error");
}

/* ==== Prefill-node connections ==== */

/* Lends a connection to addr: an idle one if there is one, else a new
 * entry (an unused one, else the least recently used idle one). NULL when
 * every entry is lent. */
static dn_peer *dn_peer_take(dnode *n, const char *addr, const prefix_held *want) {
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
static void dn_peer_give(dnode *n, dn_peer *p, prefix_held *held) {
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
static json_t *dn_prefix_json(dnode *n) {
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

/* ==== Requests ==== */

typedef struct {
    int32_t *prompt;
    int n_prompt;
    int max_tokens, ignore_eos, stream, mode;
    int logprobs;                /* 0: off; 1 + k: logprob and k alternatives per token */
    sampler_params sp;
    sampler_bias *bias;          /* logit_bias entries (sp.bias points here) */
    char *stop[DN_MAX_STOP];
    int n_stop;
    char node[256];
    grammar *grammar;            /* response_format: constrained decoding, or NULL */
    int min_tokens;              /* extensions.c: api_gen_limits */
    int32_t stop_ids[SCHED_MAX_STOP_IDS];
    int n_stop_ids;
    int n_choices;               /* "n": sequences sampled from the one prompt */
} dn_req;

static void dn_req_free(dn_req *r) {
    free(r->prompt);
    free(r->bias);
    for (int i = 0; i < r->n_stop; i++) free(r->stop[i]);
    grammar_free(r->grammar);
    memset(r, 0, sizeof *r);
}

static int dn_get_bool(json_t *o, const char *k, int *out, char *err, size_t errlen) {
    json_t *v = json_object_get(o, k);
    if (!v) return 0;
    if (!json_is_boolean(v)) { snprintf(err, errlen, "'%s' must be a boolean", k); return -1; }
    *out = json_is_true(v);
    return 0;
}

static int dn_get_int(json_t *o, const char *k, long long lo, long long hi, long long *out, char *err, size_t errlen) {
    json_t *v = json_object_get(o, k);
    if (!v) return 0;
    if (!json_is_integer(v) || json_integer_value(v) < lo || json_integer_value(v) > hi) {
        snprintf(err, errlen, "'%s' must be an integer in [%lld, %lld]", k, lo, hi);
        return -1;
    }
    *out = json_integer_value(v);
    return 0;
}

static int dn_get_num(json_t *o, const char *k, double lo, double hi, float *out, char *err, size_t errlen) {
    json_t *v = json_object_get(o, k);
    if (!v) return 0;
    double d = json_is_number(v) ? json_number_value(v) : NAN;
    if (!(d >= lo && d <= hi)) { snprintf(err, errlen, "'%s' must be a number in [%g, %g]", k, lo, hi); return -1; }
    *out = (float)d;
    return 0;
}

static int dn_parse_stop(json_t *o, dn_req *r, char *err, size_t errlen) {
    json_t *v = json_object_get(o, "stop");
    if (!v || json_is_null(v)) return 0;
    json_t *one = json_is_string(v) ? v : NULL;
    size_t cnt = one ? 1 : json_is_array(v) ? json_array_size(v) : 0;
    if (!one && !json_is_array(v)) { snprintf(err, errlen, "'stop' must be a string or an array of strings"); return -1; }
    if (cnt > DN_MAX_STOP) { snprintf(err, errlen, "'stop' has more than %d strings", DN_MAX_STOP); return -1; }
    for (size_t i = 0; i < cnt; i++) {
        json_t *s = one ? one : json_array_get(v, i);
        size_t len = json_is_string(s) ? json_string_length(s) : 0;
        if (!json_is_string(s) || len == 0 || len > DN_MAX_STOP_LEN || strlen(json_string_value(s)) != len) {
            snprintf(err, errlen, "'stop' entries must be non-empty strings of at most %d bytes, without NUL", DN_MAX_STOP_LEN);
            return -1;
        }
        if (!(r->stop[r->n_stop] = strndup(json_string_value(s), len))) { snprintf(err, errlen, "out of memory"); return -1; }
        r->n_stop++;
    }
    return 0;
}

/* A token covers at most max_token_bytes bytes of text (normalisation
 * only adds bytes), so text longer than n_ctx of them cannot fit: refused
 * before it is tokenized whole. */
static int dn_prompt_bytes_fit(dnode *n, size_t bytes, char *err, size_t errlen) {
    size_t per = tokenizer_max_token_bytes(n->tok), cap = (size_t)n->n_ctx * (per ? per : 1);
    if (bytes <= cap) return 1;
    snprintf(err, errlen, "the prompt has %zu bytes: more than the context of %d tokens can hold (at most %zu bytes)",
             bytes, n->n_ctx, cap);
    return 0;
}

/* "messages" (OpenAI shape: tool_calls, tool roles), with "tools" and an
 * "assistant_prefix" (a forced tool call), rendered the way the model's
 * chat template does (tools.c), then tokenized like a prompt. */
static int dn_parse_messages(dnode *n, json_t *o, json_t *a, dn_req *r, char *err, size_t errlen) {
    json_t *tools = json_object_get(o, "tools"), *pre = json_object_get(o, "assistant_prefix");
    if (json_array_size(a) > DN_MAX_MESSAGES) {
        snprintf(err, errlen, "'messages' holds more than %d messages", DN_MAX_MESSAGES);
        return -1;
    }
    if (pre && (!json_is_string(pre) || strlen(json_string_value(pre)) != json_string_length(pre))) {
        snprintf(err, errlen, "'assistant_prefix' must be a string without NUL characters");
        return -1;
    }
    chat_style st;
    if (tools_style_detect(model_get_gguf(n->m), &st, err, errlen)) return -1;
    char *text = tools_render(&st, a, json_is_null(tools) ? NULL : tools, json_string_value(pre), err, errlen);
    if (!text) return -1;
    size_t len = strlen(text);
    const tokenizer *tok = n->tok;
    int fits = dn_prompt_bytes_fit(n, len, err, errlen);
    int64_t need = fits ? tokenizer_encode(tok, text, len, 1, 1, NULL, 0) : 0;
    int rc = -1;
    if (!fits) {
        /* err says why */
    } else if (need <= 0 || need > n->n_ctx) {
        snprintf(err, errlen, need <= 0 ? "the messages render to an empty prompt"
                 : "the prompt has %lld tokens but the context holds %d", (long long)need, n->n_ctx);
    } else if (!(r->prompt = malloc(sizeof(int32_t) * (size_t)need)) ||
               tokenizer_encode(tok, text, len, 1, 1, r->prompt, need) != need) {
        snprintf(err, errlen, "tokenization failed");
    } else {
        r->n_prompt = (int)need;
        rc = 0;
    }
    free(text);
    return rc;
}

static int dn_parse_prompt(dnode *n, json_t *o, dn_req *r, char *err, size_t errlen) {
    json_t *p = json_object_get(o, "prompt"), *t = json_object_get(o, "tokens"), *ms = json_object_get(o, "messages");
    int chat = 0;
    if (dn_get_bool(o, "chat", &chat, err, errlen)) return -1;
    if (!!p + !!t + !!ms != 1) { snprintf(err, errlen, "give exactly one of 'prompt', 'tokens' and 'messages'"); return -1; }
    if (ms) {
        if (dn_parse_messages(n, o, ms, r, err, errlen)) return -1;
    } else if (p) {
        if (!json_is_string(p)) { snprintf(err, errlen, "'prompt' must be a string"); return -1; }
        const char *text = json_string_value(p);
        if (strlen(text) != json_string_length(p)) { snprintf(err, errlen, "'prompt' contains a NUL character"); return -1; }
        if (!*text) { snprintf(err, errlen, "'prompt' is empty"); return -1; }
        if (!dn_prompt_bytes_fit(n, json_string_length(p), err, errlen)) return -1;
        if (!(r->prompt = tools_tokenize_prompt(n->m, text, chat, &r->n_prompt, err, errlen))) return -1;
    } else {
        size_t cnt = json_is_array(t) ? json_array_size(t) : 0;
        if (!json_is_array(t)) { snprintf(err, errlen, "'tokens' must be an array of token ids"); return -1; }
        if (cnt == 0) { snprintf(err, errlen, "'tokens' is empty"); return -1; }
        if (cnt > (size_t)n->n_ctx) {
            snprintf(err, errlen, "the prompt has %zu tokens but the context holds %d", cnt, n->n_ctx);
            return -1;
        }
        if (!(r->prompt = malloc(sizeof(int32_t) * cnt))) { snprintf(err, errlen, "out of memory"); return -1; }
        for (size_t i = 0; i < cnt; i++) {
            json_t *e = json_array_get(t, i);
            if (!json_is_integer(e) || json_integer_value(e) < 0 || json_integer_value(e) >= n->n_vocab) {
                snprintf(err, errlen, "'tokens'[%zu] must be a token id in [0, %d)", i, n->n_vocab);
                return -1;
            }
            r->prompt[i] = (int32_t)json_integer_value(e);
        }
        r->n_prompt = (int)cnt;
    }
    if (r->n_prompt > n->n_ctx) {
        snprintf(err, errlen, "the prompt has %d tokens but the context holds %d", r->n_prompt, n->n_ctx);
        return -1;
    }
    return 0;
}

static int dn_parse_prefill(dnode *n, json_t *o, dn_req *r, char *err, size_t errlen) {
    json_t *v = json_object_get(o, "prefill"), *nd = json_object_get(o, "prefill_node");
    r->mode = DN_PF_AUTO;
    if (v) {
        const char *s = json_is_string(v) ? json_string_value(v) : "";
        if (!strcmp(s, "auto")) r->mode = DN_PF_AUTO;
        else if (!strcmp(s, "remote")) r->mode = DN_PF_REMOTE;
        else if (!strcmp(s, "local")) r->mode = DN_PF_LOCAL;
        else { snprintf(err, errlen, "'prefill' must be \"auto\", \"remote\" or \"local\""); return -1; }
    }
    if (nd && !json_is_null(nd)) {
        size_t len = json_is_string(nd) ? json_string_length(nd) : 0;
        if (!json_is_string(nd) || len == 0 || len >= sizeof r->node || !strchr(json_string_value(nd), ':')) {
            snprintf(err, errlen, "'prefill_node' must be a \"host:port\" string");
            return -1;
        }
        /* Naming the peer the node connects to is the router's privilege:
         * only a node that authenticates its requests accepts it. */
        if (!n->auth) {
            snprintf(err, errlen, "'prefill_node' is accepted only from an authenticated router: this node has no "
                     "shared secret (configure its prefill nodes with --prefill-node)");
            return -1;
        }
        snprintf(r->node, sizeof r->node, "%s", json_string_value(nd));
    }
    int have_node = r->node[0] || n->o->n_prefill_nodes > 0;
    if (n->o->local_only && (r->mode == DN_PF_REMOTE || r->node[0])) {
        snprintf(err, errlen, "this node runs with --role local and uses no prefill node");
        return -1;
    }
    if (r->mode == DN_PF_REMOTE && !have_node) {
        snprintf(err, errlen, "'prefill' is \"remote\" but no prefill node is configured or given");
        return -1;
    }
    return 0;
}

static int dn_parse_sampling(json_t *o, dn_req *r, char *err, size_t errlen) {
    long long v;
    r->sp = sampler_defaults();
    v = 128;
    if (dn_get_int(o, "max_tokens", 0, DN_MAX_TOKENS_LIMIT, &v, err, errlen)) return -1;
    r->max_tokens = (int)v;
    if (dn_get_num(o, "temperature", 0, 1e6, &r->sp.temp, err, errlen)) return -1;
    v = r->sp.top_k;
    if (dn_get_int(o, "top_k", -1, 1000000000, &v, err, errlen)) return -1;
    r->sp.top_k = (int)v;
    if (dn_get_num(o, "top_p", 0, 1, &r->sp.top_p, err, errlen)) return -1;
    if (dn_get_num(o, "min_p", 0, 1, &r->sp.min_p, err, errlen)) return -1;
    v = 0;
    if (dn_get_int(o, "seed", 0, INT64_MAX, &v, err, errlen)) return -1;
    /* No seed: a fresh one per request, so that unseeded calls differ. */
    r->sp.seed = json_object_get(o, "seed") ? (uint64_t)v : sampler_fresh_seed();
    if (json_object_get(o, "logprobs")) {
        v = 0;
        if (dn_get_int(o, "logprobs", 0, SCHED_MAX_TOP_LOGPROBS, &v, err, errlen)) return -1;
        r->logprobs = 1 + (int)v;
    }
    if (dn_get_bool(o, "ignore_eos", &r->ignore_eos, err, errlen)) return -1;
    if (dn_get_bool(o, "stream", &r->stream, err, errlen)) return -1;
    return 0;
}

/* "presence_penalty", "frequency_penalty" (-2..2, OpenAI), "repetition_penalty"
 * (llama-server's name, > 0; 1 = off) with "repeat_last_n". */
static int dn_parse_penalties(json_t *o, dn_req *r, char *err, size_t errlen) {
    if (dn_get_num(o, "presence_penalty", -2, 2, &r->sp.presence_penalty, err, errlen) ||
        dn_get_num(o, "frequency_penalty", -2, 2, &r->sp.frequency_penalty, err, errlen) ||
        dn_get_num(o, "repetition_penalty", 0.01, 100, &r->sp.repeat_penalty, err, errlen))
        return -1;
    long long v = 0;
    if (dn_get_int(o, "repeat_last_n", 1, 1 << 20, &v, err, errlen)) return -1;
    r->sp.repeat_last_n = (int)v;
    return 0;
}

/* "logit_bias": {"token id": bias (-100..100)} as OpenAI sends it; -100
 * bans the token outright. */
static int dn_parse_logit_bias(dnode *n, json_t *o, dn_req *r, char *err, size_t errlen) {
    json_t *lb = json_object_get(o, "logit_bias");
    if (!lb || json_is_null(lb)) return 0;
    if (!json_is_object(lb) || json_object_size(lb) > 1024) {
        snprintf(err, errlen, "'logit_bias' must be an object of at most 1024 \"token id\": bias entries");
        return -1;
    }
    if (!(r->bias = calloc(json_object_size(lb) + 1, sizeof *r->bias))) { snprintf(err, errlen, "out of memory"); return -1; }
    const char *key;
    json_t *val;
    json_object_foreach(lb, key, val) {
        char *end;
        long id = strtol(key, &end, 10);
        double b = json_is_number(val) ? json_number_value(val) : NAN;
        if (end == key || *end || id < 0 || id >= n->n_vocab || !(b >= -100 && b <= 100)) {
            snprintf(err, errlen, "'logit_bias' entries must map a token id in [0, %d) to a number in [-100, 100]",
                     n->n_vocab);
            return -1;
        }
        r->bias[r->sp.n_bias++] = (sampler_bias){ (int32_t)id, b <= -100 ? -INFINITY : (float)b };
    }
    r->sp.bias = r->bias;
    return 0;
}

/* The constraint ("response_format", "grammar", "regex" or "choice"),
 * compiled to a grammar that masks every token that cannot continue a valid
 * output (extensions.c, grammar.h), and "min_tokens" / "stop_token_ids". */
static int dn_parse_response_format(dnode *n, json_t *o, dn_req *r, char *err, size_t errlen) {
    if (api_constraint_compile(o, &r->grammar, err, errlen)) return -1;
    return api_gen_limits(o, n->n_vocab, &r->min_tokens, r->stop_ids, &r->n_stop_ids, err, errlen);
}

/* "n" (1..DN_MAX_CHOICES, at most the node's slots so that every choice can
 * run at once, and its queue): n > 1 only streamed, each line tagged with
 * its "index". */
static int dn_parse_choices(dnode *n, json_t *o, dn_req *r, char *err, size_t errlen) {
    long long v = 1;
    if (dn_get_int(o, "n", 1, DN_MAX_CHOICES, &v, err, errlen)) return -1;
    r->n_choices = (int)v;
    if (v > n->n_slots) {
        snprintf(err, errlen, "'n' is %lld but this node decodes at most %d sequences at once (--parallel %d)",
                 v, n->n_slots, n->n_slots);
        return -1;
    }
    /* every choice passes through the queue (the siblings wait there for
     * choice 0's prompt): a queue shorter than n could never take them */
    if (v > n->queue_max) {
        snprintf(err, errlen, "'n' is %lld but this node queues at most %d requests (--queue %d)", v, n->queue_max,
                 n->queue_max);
        return -1;
    }
    if (v > 1 && !r->stream) {
        snprintf(err, errlen, "'n' > 1 needs \"stream\": true");
        return -1;
    }
    return 0;
}

/* 0, or -1 with a message for a 400 response. */
static int dn_parse_request(dnode *n, const char *body, size_t len, dn_req *r, char *err, size_t errlen) {
    memset(r, 0, sizeof *r);
    json_error_t je;
    json_t *o = json_loadb(body ? body : "", len, JSON_REJECT_DUPLICATES, &je);
    if (!o) { snprintf(err, errlen, "invalid JSON: %s (line %d, column %d)", je.text, je.line, je.column); return -1; }
    int rc = -1;
    if (!json_is_object(o)) { snprintf(err, errlen, "the request body must be a JSON object"); goto out; }
    if (dn_parse_sampling(o, r, err, errlen) || dn_parse_penalties(o, r, err, errlen) ||
        dn_parse_logit_bias(n, o, r, err, errlen) || dn_parse_response_format(n, o, r, err, errlen) ||
        dn_parse_stop(o, r, err, errlen) || dn_parse_choices(n, o, r, err, errlen) ||
        dn_parse_prefill(n, o, r, err, errlen) || dn_parse_prompt(n, o, r, err, errlen))
        goto out;
    /* "max_tokens_strict" (the router's, for a client's explicit max_tokens):
     * a completion asked to be longer than the context leaves is refused, as
     * OpenAI and vLLM do; otherwise the output stops at the context's end */
    if (json_is_true(json_object_get(o, "max_tokens_strict")) && r->n_prompt + r->max_tokens > n->n_ctx) {
        snprintf(err, errlen, "the prompt has %d tokens and max_tokens is %d: together more than the context of %d "
                 "tokens (reduce the prompt or max_tokens)", r->n_prompt, r->max_tokens, n->n_ctx);
        goto out;
    }
    rc = 0;
out:
    json_decref(o);
    if (rc) dn_req_free(r);
    return rc;
}

/* ==== Generation jobs ==== */

/* One request on its connection thread: the scheduler job plus what the
 * request reports (prefill mode, node, fallback) and its stream state.
 * With n > 1 choices this is choice 0 and holds the siblings: jobs of
 * their own on the same prompt that copy its KV once it is computed. */
typedef struct dn_job {
    dnode *n;
    sched_job *sj;
    const sched_view *v;         /* latest snapshot */
    int n_prompt, stream, max_tokens;
    char addr[256];              /* prefill node chosen at submission, or "" */
    /* prefill report */
    int remote;
    char node[256], fallback[512];
    handoff_stats hs;
    double t_arrive;
    uint64_t client;             /* dn_client_id; its share is given back when the job is freed */
    uint32_t rid_num;            /* request id (log.h): the router's X-Request-Id, or our own */
    char rid[LOG_ID_CHARS + 1];
    /* streaming */
    strbuf out;
    size_t out_off;
    int sent, done_sent;
    /* choices (n > 1) */
    int index;                   /* this choice's index; -1: n = 1 (lines carry no "index") */
    int fin_sent;                /* this choice's final line is out */
    int n_sib;
    struct dn_job *sib[DN_MAX_CHOICES - 1];
} dn_job;

static double dn_now(void) { return gen_now_ms(); }

/* The model's vocabulary index for grammars (built once: ~0.2 s on a
 * 151,936-token vocabulary). NULL with a message. */
static const grammar_vocab *dn_grammar_vocab(dnode *n, char *err, size_t errlen) {
    pthread_mutex_lock(&n->gmu);
    if (!n->gvocab) n->gvocab = grammar_vocab_new(n->tok, err, errlen);
    const grammar_vocab *v = n->gvocab;
    pthread_mutex_unlock(&n->gmu);
    return v;
}

/* Which prefill node this request uses, or NULL for local prefill. */
static const char *dn_pick_node(dnode *n, const dn_req *r) {
    if (n->o->local_only || r->mode == DN_PF_LOCAL) return NULL;
    if (r->node[0]) return r->node;
    if (n->o->n_prefill_nodes == 0) return NULL;
    if (r->mode == DN_PF_AUTO && r->n_prompt < n->min_split) return NULL;
    pthread_mutex_lock(&n->pmu);
    const char *a = n->o->prefill_nodes[n->rr++ % (unsigned)n->o->n_prefill_nodes];
    pthread_mutex_unlock(&n->pmu);
    return a;
}

/* Positions [start_pos, n-1) from a prefill node into the job's slot; on
 * failure the session is back at start_pos. One retry when a reused
 * connection fails at once (the prefill node drops idle connections). */
static int dn_remote_prefill(dn_job *j, session *s, const int32_t *prompt, char *err, size_t errlen) {
    dnode *n = j->n;
    if (chain_is_spec(j->addr)) {   /* a layer-split chain: HOST:PORT/A:B,... (chain.h) */
        handoff_opts ho = { .wire_dtype = n->wire_dtype, .zstd = n->o->zstd, .timeout_ms = n->timeout_ms,
                            .secret = n->o->secret, .secret_len = n->o->secret_len,
                            .node_id = n->o->node_id ? n->o->node_id : "decode" };
        chain_opts co = { .act_dtype = n->o->act_dtype };
        memset(&j->hs, 0, sizeof j->hs);
        return chain_pool_prefill(n->chains, j->addr, n->m, n->kv_dtype, &ho, &co, j->rid_num, s, prompt, j->n_prompt,
                                  j->v->start_pos, &j->hs, err, errlen);
    }
    prefix_held want = prefix_held_make(prompt, j->n_prompt - 1, n->prefix_seed);
    dn_peer *p = dn_peer_take(n, j->addr, &want);
    if (!p) { prefix_held_clear(&want); snprintf(err, errlen, "every prefill-node connection is in use"); return -1; }
    handoff_opts ho = { .wire_dtype = n->wire_dtype, .zstd = n->o->zstd, .timeout_ms = n->timeout_ms,
                        .secret = n->o->secret, .secret_len = n->o->secret_len,
                        .node_id = n->o->node_id ? n->o->node_id : "decode" };
    int rc = -1, start = j->v->start_pos;
    for (int attempt = 0; attempt < 2; attempt++) {
        int fresh = 0;
        if (!p->c) {
            if (handoff_connect(&p->c, j->addr, n->m, n->kv_dtype, &ho, err, errlen)) { p->c = NULL; break; }
            fresh = 1;
        }
        double t0 = dn_now();
        memset(&j->hs, 0, sizeof j->hs);
        handoff_set_log_id(p->c, j->rid_num);
        if (!handoff_prefill(p->c, s, prompt, j->n_prompt, start, &j->hs, err, errlen)) { rc = 0; break; }
        handoff_close(p->c);
        p->c = NULL;
        session_reset(s, start);
        if (fresh || dn_now() - t0 > DN_STALE_RETRY_MS || n->stopping) break;
        log_warn(j->rid, "connection to prefill node %s failed at once (%s); reconnecting", j->addr, err);
    }
    dn_peer_give(n, p, &want);   /* on success its session holds positions [0, n - 1) */
    return rc;
}

/* The scheduler lent us the slot: fill it from the prefill node, or give it
 * back for local prefill with the reason. */
static void dn_job_remote(dn_job *j) {
    dnode *n = j->n;
    char herr[512];
    snprintf(j->node, sizeof j->node, "%s", j->addr);
    if (!dn_remote_prefill(j, sched_remote_session(j->sj), sched_job_prompt(j->sj), herr, sizeof herr)) {
        j->remote = 1;
    } else {
        snprintf(j->fallback, sizeof j->fallback, "%s", herr);
        log_warn(j->rid, "remote prefill on %s failed, prefilling locally: %s", j->addr, herr);
    }
    sched_remote_done(n->sc, j->sj, j->remote);
}

/* Waits for more than `have` tokens or the end, running a remote prefill
 * when the scheduler asks for one; gives up waiting when the node stops. */
static const sched_view *dn_job_wait(dn_job *j, int have) {
    for (;;) {
        j->v = sched_wait(j->n->sc, j->sj, have, 100);
        if (j->v->state == SJ_REMOTE) { dn_job_remote(j); continue; }
        if (j->v->state == SJ_DONE || j->v->n_gen > have || j->n->stopping) return j->v;
    }
}

/* A finished job's tokens and times (seconds), then its outcome and
 * end-to-end time (last, so a scrape that sees them sees the rest). */
static void dn_metrics_job(dn_job *j, const char *outcome, double prefill_ms, double gen_ms) {
    dn_metrics *m = &j->n->mt;
    const sched_view *v = j->v;
    const char *const lm[] = {m->model};
    metrics_add(m->completion_tokens, lm, v->n_gen);
    if (v->t_admit > 0) {
        metrics_add(m->prompt_tokens, lm, j->n_prompt);
        metrics_add(m->reused_tokens, lm, v->start_pos);
        metrics_add(m->prefills, (const char *[]){m->model, j->remote ? "remote" : "local"}, 1);
        metrics_observe(m->queue, lm, (v->t_admit - j->t_arrive) / 1e3);
    }
    if (v->t_prompt_done > 0) metrics_observe(m->prefill, lm, prefill_ms / 1e3);
    if (j->remote) metrics_add(m->kv_received, lm, (double)j->hs.kv_bytes);
    if (j->fallback[0]) metrics_add(m->fallbacks, lm, 1);
    if (v->n_gen > 0) metrics_observe(m->ttft, lm, (v->t_first - j->t_arrive) / 1e3);
    if (v->n_gen > 1 && gen_ms > 0) metrics_observe(m->tpot, lm, gen_ms / 1e3 / (v->n_gen - 1));
    dn_metrics_outcome(m, outcome);
    if (v->t_admit > 0) metrics_observe(m->e2e, lm, (dn_now() - j->t_arrive) / 1e3);
}

static void dn_count_job(dn_job *j) {
    dnode *n = j->n;
    const sched_view *v = j->v;
    int cancelled = v->state != SJ_DONE, failed = !cancelled && v->finish && !strcmp(v->finish, "error");
    if (cancelled) log_debug(j->rid, "client went away after %d tokens; generation stopped", v->n_gen);
    double prefill_ms = v->t_prompt_done > 0 ? v->t_prompt_done - v->t_admit : 0;
    double gen_ms = v->n_gen > 1 ? dn_now() - v->t_first : 0;
    pthread_mutex_lock(&n->smu);
    n->st.completion_tokens += (uint64_t)v->n_gen;
    if (j->index <= 0) {   /* a sibling choice's request is counted with choice 0 */
        if (cancelled) n->st.cancelled++;
        else if (failed) n->st.failed++;
        else n->st.ok++;
    }
    if (v->t_admit > 0) {
        n->st.prompt_tokens += (uint64_t)j->n_prompt;
        n->st.reused_positions += (uint64_t)v->start_pos;
    }
    if (j->remote) {
        n->st.remote_prefills++;
        n->st.positions_received += (uint64_t)j->hs.n_sent;
        n->st.kv_bytes += j->hs.kv_bytes;
        n->st.wire_bytes += j->hs.wire_bytes;
        if (j->hs.prefill_ms_remote > 0)
            dn_ema(&n->st.prefill_tps_remote, j->hs.n_computed_remote * 1e3 / j->hs.prefill_ms_remote);
        if (j->hs.total_ms > 0) dn_ema(&n->st.handoff_gbps, j->hs.wire_bytes / (j->hs.total_ms * 1e6));
    } else if (v->t_admit > 0) {
        n->st.local_prefills++;
        /* a one-token "prefill" measures decode speed, not prefill speed */
        if (v->computed_local >= 8 && prefill_ms > 0) dn_ema(&n->st.prefill_tps_local, v->computed_local * 1e3 / prefill_ms);
    }
    if (j->fallback[0]) n->st.fallbacks++;
    if (v->n_gen > 1 && gen_ms > 0) dn_ema(&n->st.decode_tps, (v->n_gen - 1) * 1e3 / gen_ms);
    if (v->n_gen > 0) dn_ema(&n->st.ttft_ms, v->t_first - j->t_arrive);
    pthread_mutex_unlock(&n->smu);
    dn_metrics_job(j, cancelled ? "cancelled" : failed ? "error" : "ok", prefill_ms, gen_ms);
}

/* Where the request's cached positions came from: the deepest tier used. */
static const char *dn_cache_tier(const sched_view *v) {
    return v->store_disk_tokens ? "disk" : v->store_ram_tokens ? "ram" : v->start_pos ? "slot" : "none";
}

/* The request's one INFO line: tokens, where the prompt came from, times,
 * the model (its /metrics label). */
static void dn_log_job(dn_job *j) {
    const sched_view *v = j->v;
    const char *finish = v->state != SJ_DONE ? "cancelled" : v->finish ? v->finish : "stop";
    char spec[96];
    spec_log_fields(spec, sizeof spec, draft_kind(j->n->draft), v);
    log_info(j->rid, "done finish=%s prompt=%d cached=%d tier=%s store_ram=%d store_disk=%d store_ms=%.1f "
             "computed_local=%d prefill=%s%s%s completion=%d queue_ms=%.1f ttft_ms=%.1f total_ms=%.1f model=%s%s%s%s%s%s",
             finish, j->n_prompt, v->start_pos, dn_cache_tier(v), v->store_ram_tokens, v->store_disk_tokens,
             v->store_ms, v->computed_local, j->remote ? "remote" : "local", j->remote ? "@" : "",
             j->remote ? j->node : "", v->n_gen, v->t_admit > 0 ? v->t_admit - j->t_arrive : 0.0,
             v->n_gen > 0 ? v->t_first - j->t_arrive : 0.0, dn_now() - j->t_arrive, j->n->mt.model,
             j->fallback[0] ? " fallback=" : "", j->fallback, v->error ? " error=" : "", v->error ? v->error : "", spec);
}

/* Counts the outcome, hands the job back to the scheduler (cancelling it
 * if it still runs: the client went away), frees the request. */
static void dn_client_put(dnode *n, uint64_t id);

static void dn_job_free(dn_job *j) {
    if (!j) return;
    if (j->client) dn_client_put(j->n, j->client);
    for (int i = 0; i < j->n_sib; i++) dn_job_free(j->sib[i]);
    if (j->sj) {
        j->v = sched_wait(j->n->sc, j->sj, INT32_MAX, 0);
        dn_count_job(j);
        dn_log_job(j);
        sched_release(j->n->sc, j->sj);
    }
    free(j->out.p);
    free(j);
}

/* ==== Result JSON ==== */

static json_t *dn_prefill_json(dn_job *j) {
    const sched_view *v = j->v;
    double prefill_ms = v->t_prompt_done > 0 ? v->t_prompt_done - v->t_admit : 0.0;
    json_t *p = json_object();
    json_object_set_new(p, "mode", json_string(j->remote ? "remote" : "local"));
    if (j->node[0]) json_object_set_new(p, "node", json_string(j->node));
    if (j->fallback[0]) json_object_set_new(p, "fallback_reason", dn_json_text(j->fallback, strlen(j->fallback)));
    json_object_set_new(p, "start_pos", json_integer(v->start_pos));
    json_object_set_new(p, "reused_from_other_session", json_boolean(v->reused_from_other));
    json_object_set_new(p, "cache_tier", json_string(dn_cache_tier(v)));
    json_object_set_new(p, "store_ram_tokens", json_integer(v->store_ram_tokens));
    json_object_set_new(p, "store_disk_tokens", json_integer(v->store_disk_tokens));
    json_object_set_new(p, "store_ms", json_real(v->store_ms));
    json_object_set_new(p, "positions_received", json_integer(j->remote ? j->hs.n_sent : 0));
    json_object_set_new(p, "computed_remote", json_integer(j->remote ? j->hs.n_computed_remote : 0));
    json_object_set_new(p, "computed_local", json_integer(v->computed_local));
    json_object_set_new(p, "kv_bytes", json_integer(j->remote ? (json_int_t)j->hs.kv_bytes : 0));
    json_object_set_new(p, "wire_bytes", json_integer(j->remote ? (json_int_t)j->hs.wire_bytes : 0));
    json_object_set_new(p, "prefill_ms", json_real(prefill_ms));
    if (j->remote) {
        json_object_set_new(p, "remote_prefill_ms", json_real(j->hs.prefill_ms_remote));
        json_object_set_new(p, "handoff_ms", json_real(j->hs.total_ms));
        json_object_set_new(p, "transfer_tail_ms", json_real(j->hs.transfer_tail_ms));
    }
    json_object_set_new(p, "queue_ms", json_real(v->t_admit > 0 ? v->t_admit - j->t_arrive : 0.0));
    json_object_set_new(p, "ttft_ms", json_real(v->n_gen > 0 ? v->t_first - j->t_arrive : 0.0));
    return p;
}

/* Fields shared by the final stream line and the non-stream body. */
static void dn_result_fields(dn_job *j, json_t *o) {
    const sched_view *v = j->v;
    json_object_set_new(o, "finish_reason", json_string(v->finish && strcmp(v->finish, "cancelled") ? v->finish : "stop"));
    json_t *u = json_object();
    json_object_set_new(u, "prompt_tokens", json_integer(j->n_prompt));
    json_object_set_new(u, "completion_tokens", json_integer(v->n_gen));
    json_object_set_new(u, "prompt_tokens_details", json_pack("{s:i}", "cached_tokens", v->start_pos));
    json_object_set_new(o, "usage", u);
    json_object_set_new(o, "prefill", dn_prefill_json(j));
    spec_result_json(o, draft_kind(j->n->draft), v);
    if (v->n_gen > 1) {
        double ms = dn_now() - v->t_first;
        json_object_set_new(o, "decode_tps", json_real(ms > 0 ? (v->n_gen - 1) * 1e3 / ms : 0.0));
    }
    if (v->error) json_object_set_new(o, "error", dn_json_text(v->error, strlen(v->error)));
}

static char *dn_dump(json_t *o, size_t *len) {
    char *s = o ? json_dumps(o, JSON_COMPACT) : NULL;
    json_decref(o);
    if (s && len) *len = strlen(s);
    return s;
}

/* ==== HTTP responses ==== */

static enum MHD_Result dn_send_body(struct MHD_Connection *c, unsigned status, char *body, size_t len,
                                    const char *ctype) {
    if (!body) {
        static const char oom[] = "{\"error\":{\"message\":\"out of memory\",\"type\":\"server_error\"}}";
        struct MHD_Response *r = MHD_create_response_from_buffer(sizeof oom - 1, (void *)oom, MHD_RESPMEM_PERSISTENT);
        if (!r) return MHD_NO;
        MHD_add_response_header(r, MHD_HTTP_HEADER_CONTENT_TYPE, "application/json");
        enum MHD_Result rc = MHD_queue_response(c, MHD_HTTP_INTERNAL_SERVER_ERROR, r);
        MHD_destroy_response(r);
        return rc;
    }
    struct MHD_Response *r = MHD_create_response_from_buffer(len, body, MHD_RESPMEM_MUST_FREE);
    if (!r) { free(body); return MHD_NO; }
    MHD_add_response_header(r, MHD_HTTP_HEADER_CONTENT_TYPE, ctype);
    enum MHD_Result rc = MHD_queue_response(c, status, r);
    MHD_destroy_response(r);
    return rc;
}

static enum MHD_Result dn_send_json(struct MHD_Connection *c, unsigned status, json_t *o) {
    size_t len = 0;
    char *s = dn_dump(o, &len);
    return dn_send_body(c, status, s, len, "application/json");
}

static enum MHD_Result dn_send_error(dnode *n, struct MHD_Connection *c, unsigned status, const char *type,
                                     const char *msg) {
    pthread_mutex_lock(&n->smu);
    if (status == 503) n->st.busy++;
    else if (status >= 400 && status < 500) n->st.bad++;
    else n->st.failed++;
    pthread_mutex_unlock(&n->smu);
    json_t *e = json_object();
    json_object_set_new(e, "message", dn_json_text(msg, strlen(msg)));
    json_object_set_new(e, "type", json_string(type));
    json_t *o = json_object();
    json_object_set_new(o, "error", e);
    return dn_send_json(c, status, o);
}

/* ==== Endpoints ==== */

static enum MHD_Result dn_handle_health(dnode *n, struct MHD_Connection *c) {
    json_t *o = json_object();
    json_object_set_new(o, "status", json_string(n->stopping ? "stopping" : "ok"));
    json_object_set_new(o, "model", dn_json_text(n->desc, strlen(n->desc)));
    json_object_set_new(o, "role", json_string(n->role));
    json_object_set_new(o, "n_ctx", json_integer(n->n_ctx));
    chat_style cs;
    char cerr[128];
    json_object_set_new(o, "chat_format", json_string(tools_style_detect(model_get_gguf(n->m), &cs, cerr, sizeof cerr)
                                                      ? "none" : tools_style_name(&cs)));
    json_object_set_new(o, "chat_template", json_string(n->o->chat_source ? n->o->chat_source : "model"));
    json_t *a = json_array();
    for (int i = 0; i < n->o->n_prefill_nodes; i++) json_array_append_new(a, json_string(n->o->prefill_nodes[i]));
    json_object_set_new(o, "prefill_nodes", a);
    return dn_send_json(c, 200, o);
}

static enum MHD_Result dn_handle_stats(dnode *n, struct MHD_Connection *c) {
    dn_stats s;
    sched_stats ss;
    pthread_mutex_lock(&n->smu);
    s = n->st;
    pthread_mutex_unlock(&n->smu);
    sched_get_stats(n->sc, &ss);
    json_t *o = json_object();
    json_object_set_new(o, "role", json_string(n->role));
    json_object_set_new(o, "model", dn_json_text(n->desc, strlen(n->desc)));
    struct { const char *k; uint64_t v; } cnt[] = {
        { "requests", s.requests }, { "requests_ok", s.ok }, { "requests_bad", s.bad },
        { "requests_busy", s.busy }, { "requests_failed", s.failed }, { "requests_cancelled", s.cancelled },
        { "prompt_tokens", s.prompt_tokens }, { "completion_tokens", s.completion_tokens },
        { "reused_positions", s.reused_positions }, { "remote_prefills", s.remote_prefills },
        { "local_prefills", s.local_prefills }, { "fallbacks", s.fallbacks },
        { "positions_received", s.positions_received }, { "kv_bytes", s.kv_bytes }, { "wire_bytes", s.wire_bytes },
    };
    for (size_t i = 0; i < sizeof cnt / sizeof cnt[0]; i++)
        json_object_set_new(o, cnt[i].k, json_integer((json_int_t)cnt[i].v));
    json_object_set_new(o, "prefill_tps_local", json_real(s.prefill_tps_local));
    json_object_set_new(o, "prefill_tps_remote", json_real(s.prefill_tps_remote));
    json_object_set_new(o, "decode_tps", json_real(s.decode_tps));
    json_object_set_new(o, "ttft_ms", json_real(s.ttft_ms));
    json_object_set_new(o, "handoff_gbps", json_real(s.handoff_gbps));
    json_object_set_new(o, "busy", json_integer(ss.slots_busy > 0));
    json_object_set_new(o, "slots", json_integer(ss.slots));
    json_object_set_new(o, "slots_busy", json_integer(ss.slots_busy));
    json_object_set_new(o, "queued", json_integer(ss.queued));
    json_object_set_new(o, "queue_max", json_integer(ss.queue_max));
    json_object_set_new(o, "sessions", json_integer(ss.slots));
    json_object_set_new(o, "sessions_used", json_integer(ss.sessions_used));
    json_object_set_new(o, "batch_steps", json_integer((json_int_t)ss.steps));
    json_object_set_new(o, "batched_tokens", json_integer((json_int_t)ss.batched_tokens));
    json_object_set_new(o, "n_ctx", json_integer(n->n_ctx));
    if (n->prefix_ok) json_object_set_new(o, "prefix", dn_prefix_json(n));
    spec_stats_json(o, draft_kind(n->draft), &ss);
    draft_remote_stats_json(o, draft_get_remote(n->draft));
    return dn_send_json(c, 200, o);
}

/* GET /metrics: the scheduler's gauges copied in, then the registry's text.
 * Open like /health: counts and timings only. */
static enum MHD_Result dn_handle_metrics(dnode *n, struct MHD_Connection *c) {
    dn_metrics *m = &n->mt;
    const char *const lm[] = {m->model};
    sched_stats ss;
    sched_get_stats(n->sc, &ss);
    metrics_set(m->slots, lm, ss.slots);
    metrics_set(m->slots_busy, lm, ss.slots_busy);
    metrics_set(m->queued, lm, ss.queued);
    metrics_set(m->queue_cap, lm, ss.queue_max);
    metrics_set(m->kv_tokens, lm, (double)ss.cached_tokens);
    metrics_set(m->kv_capacity, lm, (double)ss.capacity_tokens);
    metrics_set(m->kv_usage, lm, ss.capacity_tokens ? (double)ss.cached_tokens / (double)ss.capacity_tokens : 0.0);
    metrics_set(m->steps, lm, (double)ss.steps);
    metrics_set(m->batched, lm, (double)ss.batched_tokens);
    kvstore_metrics_update(n->store, &m->store, m->model);
    spec_metrics_set(&m->spec, m->model, draft_kind(n->draft), &ss);
    size_t len = 0;
    char *text = metrics_render(m->reg, &len);
    return dn_send_body(c, 200, text, len, METRICS_CONTENT_TYPE);
}

static void dn_emit_line(strbuf *out, json_t *o) {
    size_t len = 0;
    char *s = dn_dump(o, &len);
    if (s) { strbuf_put(out, s, len); strbuf_put(out, "\n", 1); }
    free(s);
}

/* A token's text for a logprob entry (raw token bytes, invalid UTF-8 replaced). */
static json_t *dn_token_text(dnode *n, int32_t id) {
    char buf[512];
    int w = tokenizer_token_bytes(n->tok, id, 1, buf, sizeof buf);
    return dn_json_text(buf, w > 0 ? (size_t)w : 0);
}

/* {"logprob", "top_logprobs": [{"id","text","logprob"}...]} members of token k. */
static void dn_logprob_fields(dnode *n, const sched_view *v, int k, json_t *o) {
    const sched_logprob *lp = &v->lp[k];
    json_object_set_new(o, "logprob", json_real(lp->logprob));
    json_object_set_new(o, "token_text", dn_token_text(n, v->gen[k]));
    json_t *a = json_array();
    for (int t = 0; t < lp->n_top; t++) {
        json_t *e = json_object();
        json_object_set_new(e, "id", json_integer(lp->top_id[t]));
        json_object_set_new(e, "text", dn_token_text(n, lp->top_id[t]));
        json_object_set_new(e, "logprob", json_real(lp->top_logprob[t]));
        json_array_append_new(a, e);
    }
    json_object_set_new(o, "top_logprobs", a);
}

/* Lines (into out) for the tokens of choice j published since the last
 * call (its snapshot j->v), then its final line once it is done. */
static void dn_stream_emit(dn_job *j, strbuf *out) {
    const sched_view *v = j->v;
    /* each token line carries the text that became final with it (text that
     * may still start a stop string waits; a stop string is never sent) */
    for (; j->sent < v->n_gen; j->sent++) {
        size_t a = j->sent ? v->stable_end[j->sent - 1] : 0, b = v->stable_end[j->sent];
        json_t *o = json_object();
        if (j->index >= 0) json_object_set_new(o, "index", json_integer(j->index));
        json_object_set_new(o, "token", json_integer(v->gen[j->sent]));
        json_object_set_new(o, "text", dn_json_text(v->text + a, b - a));
        if (v->lp) dn_logprob_fields(j->n, v, j->sent, o);
        dn_emit_line(out, o);
    }
    if (v->state != SJ_DONE && !j->n->stopping) return;
    size_t end = v->n_gen ? v->stable_end[v->n_gen - 1] : 0;
    json_t *o = json_object();
    if (j->index >= 0) json_object_set_new(o, "index", json_integer(j->index));
    json_object_set_new(o, "done", json_true());
    if (v->text_keep > end) json_object_set_new(o, "text", dn_json_text(v->text + end, v->text_keep - end));
    if (v->state != SJ_DONE) {
        static const sched_view stopping = { .state = SJ_DONE, .finish = "error", .error = "the server is shutting down" };
        sched_view cp = *v;
        cp.finish = stopping.finish;
        cp.error = stopping.error;
        j->v = &cp;
        dn_result_fields(j, o);
        j->v = v;
    } else {
        dn_result_fields(j, o);
    }
    dn_emit_line(out, o);
    j->fin_sent = 1;
}

/* Lines for what the scheduler published since the last call: one choice,
 * or all of them (n > 1: they decode in the same steps, so waiting for the
 * first unfinished one and then taking every choice's news loses nothing). */
static void dn_stream_fill(dn_job *j) {
    if (!j->n_sib) {
        dn_job_wait(j, j->sent);
        dn_stream_emit(j, &j->out);
        j->done_sent = j->fin_sent;
        return;
    }
    dn_job *w = NULL;
    for (int i = -1; i < j->n_sib && !w; i++) {
        dn_job *c = i < 0 ? j : j->sib[i];
        if (!c->fin_sent) w = c;
    }
    dn_job_wait(w, w->sent);
    int all = 1;
    for (int i = -1; i < j->n_sib; i++) {
        dn_job *c = i < 0 ? j : j->sib[i];
        if (c->fin_sent) continue;
        if (c != w) c->v = sched_wait(j->n->sc, c->sj, INT32_MAX, 0);
        dn_stream_emit(c, &j->out);
        all &= c->fin_sent;
    }
    j->done_sent = all;
}

/* MHD's content reader: blocks (thread per connection) until there is
 * something to send. */
static ssize_t dn_stream_read(void *cls, uint64_t pos, char *buf, size_t max) {
    dn_job *j = cls;
    while (j->out_off == j->out.len) {
        j->out.len = j->out_off = 0;
        if (j->done_sent) return MHD_CONTENT_READER_END_OF_STREAM;
        dn_stream_fill(j);
    }
    size_t k = j->out.len - j->out_off;
    if (k > max) k = max;
    memcpy(buf, j->out.p + j->out_off, k);
    j->out_off += k;
    return (ssize_t)k;
}

static void dn_stream_free(void *cls) { dn_job_free(cls); }

static enum MHD_Result dn_generate_full(dn_job *j, struct MHD_Connection *c) {
    const sched_view *v = j->v;
    while (v->state != SJ_DONE && !j->n->stopping) v = dn_job_wait(j, v->n_gen);
    json_t *o = json_object();
    json_t *toks = json_array();
    for (int i = 0; i < v->n_gen; i++) json_array_append_new(toks, json_integer(v->gen[i]));
    json_object_set_new(o, "tokens", toks);
    json_object_set_new(o, "text", dn_json_text(v->text ? v->text : "", v->text_keep));
    if (v->lp) {
        json_t *lps = json_array();
        for (int i = 0; i < v->n_gen; i++) {
            json_t *e = json_object();
            json_object_set_new(e, "token", json_integer(v->gen[i]));
            dn_logprob_fields(j->n, v, i, e);
            json_array_append_new(lps, e);
        }
        json_object_set_new(o, "logprobs", lps);
    }
    dn_result_fields(j, o);
    unsigned status = v->finish && !strcmp(v->finish, "error") ? 500 : 200;
    dn_job_free(j);
    return dn_send_json(c, status, o);
}

/* Choice i (> 0) of a request: the body parsed again (the prompt, stop
 * strings and grammar are each job's own), sampled with seed0 + i (a given
 * seed replays every choice; temperature > 0 makes them differ), never
 * prefilled remotely: the scheduler holds it until choice 0 has computed
 * the prompt, then copies those KV rows. 0, or the HTTP status with err. */
static unsigned dn_sibling_submit(dnode *n, dn_job *j, const char *body, size_t len, int i, uint64_t seed0,
                                  char *err, size_t errlen, const char **type) {
    dn_req r;
    if (dn_parse_request(n, body, len, &r, err, errlen)) { *type = "invalid_request_error"; return 400; }
    dn_job *c = calloc(1, sizeof *c);
    const grammar_vocab *gv = r.grammar ? dn_grammar_vocab(n, err, errlen) : NULL;
    if (!c || (r.grammar && !gv)) {
        free(c);
        dn_req_free(&r);
        *type = "server_error";
        if (!gv) snprintf(err, errlen, "out of memory");
        return 500;
    }
    c->n = n;
    c->t_arrive = j->t_arrive;
    c->n_prompt = r.n_prompt;
    c->stream = r.stream;
    c->max_tokens = r.max_tokens;
    c->index = i;
    r.sp.seed = (seed0 + (uint64_t)i) & (uint64_t)INT64_MAX;
    sched_req sr = { .prompt = r.prompt, .n_prompt = r.n_prompt, .max_tokens = r.max_tokens,
                     .ignore_eos = r.ignore_eos, .min_tokens = r.min_tokens, .n_stop_ids = r.n_stop_ids, .sp = r.sp, .n_stop = r.n_stop, .logprobs = r.logprobs,
                     .grammar = r.grammar, .gvocab = gv, .sibling = 1 };
    for (int k = 0; k < r.n_stop; k++) sr.stop[k] = r.stop[k];
    memcpy(sr.stop_ids, r.stop_ids, sizeof sr.stop_ids);
    sampler_bias *bias = r.bias;
    memset(&r, 0, sizeof r);
    int a = sched_submit(n->sc, &sr, &c->sj);
    free(bias);
    if (a) {
        free(c);
        *type = a == -1 ? "busy" : "unavailable";
        if (a == -1) snprintf(err, errlen, "too many requests waiting to queue choice %d; try again later", i);
        else snprintf(err, errlen, "the server is shutting down");
        return 503;
    }
    j->sib[j->n_sib++] = c;
    return 0;
}

/* Parses the request and hands it to the scheduler; *out receives the job.
 * Returns 0, or the HTTP status of the error already described in err. */
static unsigned dn_job_submit(dnode *n, const char *body, size_t len, double t_arrive, uint64_t client, dn_job **out,
                              const char **type, char *err, size_t errlen) {
    dn_req r;
    *out = NULL;
    if (dn_parse_request(n, body, len, &r, err, errlen)) { *type = "invalid_request_error"; return 400; }
    dn_job *j = calloc(1, sizeof *j);
    if (!j) { dn_req_free(&r); *type = "server_error"; snprintf(err, errlen, "out of memory"); return 500; }
    j->n = n;
    j->t_arrive = t_arrive;
    j->n_prompt = r.n_prompt;
    j->stream = r.stream;
    j->max_tokens = r.max_tokens;
    const char *addr = dn_pick_node(n, &r);
    if (addr) snprintf(j->addr, sizeof j->addr, "%s", addr);
    const grammar_vocab *gv = NULL;
    if (r.grammar && !(gv = dn_grammar_vocab(n, err, errlen))) {
        dn_req_free(&r);
        free(j);
        *type = "server_error";
        return 500;
    }
    sched_req sr = { .prompt = r.prompt, .n_prompt = r.n_prompt, .max_tokens = r.max_tokens,
                     .ignore_eos = r.ignore_eos, .min_tokens = r.min_tokens, .n_stop_ids = r.n_stop_ids, .sp = r.sp, .n_stop = r.n_stop, .want_remote = addr != NULL,
                     .logprobs = r.logprobs, .grammar = r.grammar, .gvocab = gv, .client = client };
    for (int i = 0; i < r.n_stop; i++) sr.stop[i] = r.stop[i];
    memcpy(sr.stop_ids, r.stop_ids, sizeof sr.stop_ids);
    sampler_bias *bias = r.bias;      /* copied by the job's sampler */
    int r_choices = r.n_choices;
    uint64_t seed0 = r.sp.seed;
    memset(&r, 0, sizeof r);          /* the scheduler owns the prompt, stop strings and grammar now */
    int a = sched_submit(n->sc, &sr, &j->sj);
    free(bias);
    if (a) {
        free(j);
        *type = a == -1 ? "busy" : "unavailable";
        snprintf(err, errlen, a == -1 ? "too many requests waiting; try again later" : "the server is shutting down");
        return 503;
    }
    j->index = r_choices > 1 ? 0 : -1;
    for (int i = 1; i < r_choices; i++) {
        unsigned st = dn_sibling_submit(n, j, body, len, i, seed0, err, errlen, type);
        if (st) { dn_job_free(j); return st; }
    }
    *out = j;
    return 0;
}

/* The request id (log.h): the router's X-Request-Id when it is one, else
 * a fresh one (a client calling the node directly). */
static uint32_t dn_request_id(struct MHD_Connection *c, char *out) {
    uint32_t id;
    if (log_id_parse(MHD_lookup_connection_value(c, MHD_HEADER_KIND, "X-Request-Id"), &id)) id = log_id_new();
    log_id_format(id, out);
    return id;
}

/* A generation request refused before it became a job: its one log line. */
static enum MHD_Result dn_refuse(dnode *n, struct MHD_Connection *c, unsigned status, const char *type,
                                 const char *msg) {
    char rid[LOG_ID_CHARS + 1];
    dn_request_id(c, rid);
    log_refused(rid, (int)status, msg);
    dn_metrics_refused(&n->mt, status);
    return dn_send_error(n, c, status, type, msg);
}

/* ==== Client shares ==== */

/* Who asked, for the per-client share: on a node with a secret the
 * router's X-Tandem-Client header (the request is signed, so only the
 * router can set it; without it the share does not apply: the router
 * alone is no one client); on a node without one, the peer's address when
 * --client-share was given (by default not: a node used directly is
 * mostly one application on one address). 0 = unknown. */
static uint64_t dn_client_id(dnode *n, struct MHD_Connection *c) {
    uint64_t h = 1469598103934665603ull;   /* FNV-1a */
    const unsigned char *p;
    size_t len;
    httpd_addr a;
    if (n->auth) {
        const char *v = MHD_lookup_connection_value(c, MHD_HEADER_KIND, DN_CLIENT_HDR);
        if (!v || !*v || (len = strlen(v)) > DN_CLIENT_MAX_LEN) return 0;
        p = (const unsigned char *)v;
        h = (h ^ 'k') * 1099511628211ull;
    } else {
        if (!n->o->client_share) return 0;   /* by address only when asked: one local app is one address */
        const union MHD_ConnectionInfo *ci = MHD_get_connection_info(c, MHD_CONNECTION_INFO_CLIENT_ADDRESS);
        if (!ci || httpd_addr_of(ci->client_addr, &a)) return 0;
        p = (const unsigned char *)&a;
        len = sizeof a;
        h = (h ^ 'a') * 1099511628211ull;
    }
    for (size_t i = 0; i < len; i++) h = (h ^ p[i]) * 1099511628211ull;
    return h ? h : 1;
}

/* Takes one of id's share: 0, or -1 when it holds client_cap requests. */
static int dn_client_take(dnode *n, uint64_t id) {
    pthread_mutex_lock(&n->cmu);
    int free_ = -1, rc = 0, i;
    for (i = 0; i < DN_MAX_CLIENTS; i++) {
        if (n->clients[i].n && n->clients[i].id == id) break;
        if (!n->clients[i].n && free_ < 0) free_ = i;
    }
    if (i < DN_MAX_CLIENTS) rc = n->clients[i].n >= n->client_cap ? -1 : (n->clients[i].n++, 0);
    else if (free_ >= 0) n->clients[free_].id = id, n->clients[free_].n = 1;
    pthread_mutex_unlock(&n->cmu);
    return rc;   /* a full table (impossible past slots + queue) tracks nothing */
}

static void dn_client_put(dnode *n, uint64_t id) {
    pthread_mutex_lock(&n->cmu);
    for (int i = 0; i < DN_MAX_CLIENTS; i++)
        if (n->clients[i].n && n->clients[i].id == id) { n->clients[i].n--; break; }
    pthread_mutex_unlock(&n->cmu);
}

static enum MHD_Result dn_handle_generate(dnode *n, struct MHD_Connection *c, const char *body, size_t len) {
    double t_arrive = dn_now();
    char err[512];
    const char *type = "";
    dn_job *j;
    pthread_mutex_lock(&n->smu);
    n->st.requests++;
    pthread_mutex_unlock(&n->smu);
    uint64_t cid = n->client_cap ? dn_client_id(n, c) : 0;
    if (cid && dn_client_take(n, cid)) {
        snprintf(err, sizeof err, "this client already has %d requests running or waiting here, its share "
                 "(--client-share); try again later", n->client_cap);
        return dn_refuse(n, c, 429, "rate_limit_error", err);
    }
    unsigned status = dn_job_submit(n, body, len, t_arrive, cid, &j, &type, err, sizeof err);
    if (status) {
        if (cid) dn_client_put(n, cid);
        return dn_refuse(n, c, status, type, err);
    }
    j->client = cid;
    j->rid_num = dn_request_id(c, j->rid);
    /* Until the first token (or the end) nothing is sent, so a failure
     * before then is an HTTP error the router can retry elsewhere. */
    const sched_view *v = dn_job_wait(j, 0);
    if (v->state == SJ_DONE && v->n_gen == 0 && v->finish && !strcmp(v->finish, "error")) {
        snprintf(err, sizeof err, "%s", v->error ? v->error : "generation failed");
        log_warn(j->rid, "prefill failed: %s", err);
        dn_job_free(j);
        return dn_send_error(n, c, 500, "server_error", err);
    }
    if (!j->stream) return dn_generate_full(j, c);
    struct MHD_Response *resp = MHD_create_response_from_callback(MHD_SIZE_UNKNOWN, DN_STREAM_BLOCK,
                                                                  dn_stream_read, j, dn_stream_free);
    if (!resp) { dn_job_free(j); return MHD_NO; }
    MHD_add_response_header(resp, MHD_HTTP_HEADER_CONTENT_TYPE, "application/x-ndjson");
    MHD_add_response_header(resp, MHD_HTTP_HEADER_CACHE_CONTROL, "no-cache");
    enum MHD_Result rc = MHD_queue_response(c, 200, resp);
    MHD_destroy_response(resp);   /* MHD holds its own reference; dn_stream_free runs when it lets go */
    return rc;
}

/* POST /v1/cache/save and /v1/cache/load: a generation body names the
 * prefix (a rubric). save computes it if the store lacks it (one greedy
 * token, through a prefill node when the body asks for one), then writes
 * its blocks to disk and answers when they are there; load reads them from
 * disk into memory ahead of the requests that will use them. */
static enum MHD_Result dn_handle_cache(dnode *n, struct MHD_Connection *c, int save, const char *body, size_t len) {
    char err[512];
    if (!n->store) return dn_send_error(n, c, 400, "invalid_request_error", "this node has no KV store (--kv-cache-ram, --kv-cache-dir)");
    dn_req r;
    if (dn_parse_request(n, body, len, &r, err, sizeof err)) return dn_send_error(n, c, 400, "invalid_request_error", err);
    int n_prompt = r.n_prompt, have = kvstore_probe(n->store, r.prompt, n_prompt), done;
    if (!save) done = kvstore_warm(n->store, r.prompt, n_prompt);
    else {
        if (have < n_prompt / 64 * 64) {   /* compute it: the finished job puts its blocks in the store */
            json_t *o = json_loadb(body, len, 0, NULL);
            json_object_set_new(o, "max_tokens", json_integer(1));
            json_object_del(o, "stream");
            json_object_del(o, "n");
            size_t bl = 0;
            char *b = dn_dump(o, &bl);
            dn_job *j = NULL;
            const char *type = "";
            unsigned st = b ? dn_job_submit(n, b, bl, dn_now(), 0, &j, &type, err, sizeof err) : 500;
            free(b);
            if (st) { dn_req_free(&r); return dn_send_error(n, c, st, type, st == 500 && !j ? "out of memory" : err); }
            j->rid_num = dn_request_id(c, j->rid);
            dn_job_wait(j, INT32_MAX);
            dn_job_free(j);
        }
        done = kvstore_save(n->store, r.prompt, n_prompt);
    }
    dn_req_free(&r);
    if (done < 0) return dn_send_error(n, c, 400, "invalid_request_error", "this node's KV store has no disk tier (--kv-cache-dir)");
    log_info(NULL, "kv store: %s a prefix of %d tokens: %d positions %s", save ? "saved" : "loaded", n_prompt, done,
             save ? "on disk" : "in memory");
    return dn_send_json(c, 200, json_pack("{s:i, s:i, s:s}", "prompt_tokens", n_prompt, "stored_tokens", done,
                                          "tier", save ? "disk" : "ram"));
}

/* POST /v1/tokenize with a generation request's prompt ("prompt" and
 * "chat", "messages" with "tools" and "assistant_prefix", or "tokens") in
 * place of "content": the ids /v1/generate would evaluate, template
 * included (the router counts a prompt's tokens this way). 1 = not such a
 * body (tok_api.c answers), else the status sent. */
static int dn_tokenize_prompt(dnode *n, struct MHD_Connection *c, const char *body, size_t len, enum MHD_Result *mr) {
    json_t *o = json_loadb(body ? body : "", len, JSON_REJECT_DUPLICATES, NULL);
    int mine = json_is_object(o) && !json_object_get(o, "content") &&
               (json_object_get(o, "prompt") || json_object_get(o, "messages") || json_object_get(o, "tokens"));
    if (!mine) { json_decref(o); return 1; }
    dn_req r;
    char err[512];
    memset(&r, 0, sizeof r);
    if (dn_parse_prompt(n, o, &r, err, sizeof err)) {
        json_decref(o);
        dn_req_free(&r);
        *mr = dn_send_error(n, c, 400, "invalid_request_error", err);
        return 400;
    }
    json_decref(o);
    json_t *ids = json_array();
    for (int i = 0; i < r.n_prompt; i++) json_array_append_new(ids, json_integer(r.prompt[i]));
    dn_req_free(&r);
    *mr = dn_send_json(c, 200, json_pack("{s:o}", "tokens", ids));
    return 200;
}

/* POST /v1/tokenize and /v1/detokenize (tok_api.c). */
static enum MHD_Result dn_handle_tokens(dnode *n, struct MHD_Connection *c, int detok, const char *body, size_t len) {
    char err[256], *out = NULL;
    enum MHD_Result mr;
    if (!detok && dn_tokenize_prompt(n, c, body, len, &mr) != 1) return mr;
    int st = detok ? tokapi_detokenize(n->tok, body, len, &out, err, sizeof err)
                   : tokapi_tokenize(n->tok, body, len, &out, err, sizeof err);
    if (st != 200) return dn_send_error(n, c, (unsigned)st, st == 400 ? "invalid_request_error" : "server_error", err);
    return dn_send_body(c, 200, out, strlen(out), "application/json");
}

/* ==== Signed endpoints and token-request bounds ==== */

/* Body bytes a POST /v1/tokenize may carry per context token. English
 * text averages about 4 bytes a token; the costliest realistic text,
 * non-Latin script sent JSON-escaped, is 6 body bytes ("\uXXXX") for a
 * character of about one token, and a whitespace run or a code token
 * rarely passes 16. 24 leaves room above all of them, while a body past
 * n_ctx x 24 bytes cannot fit the context: it is refused unread (413),
 * since tokenizing costs about 53 bytes of memory per input byte (an 8 MB
 * body took 423 MB). */
#define DN_TOK_BODY_PER_TOKEN 24
/* Added to that bound: the JSON around a prompt (keys, "messages"
 * framing, "tools" of a small context) in a model with a tiny n_ctx. */
#define DN_TOK_BODY_SLACK (64 << 10)

/* Endpoints that do work for the router, signed when the node has a
 * secret: all but /health and /metrics (counts and timings, open like
 * the liveness answer). */
static int dn_needs_signature(const char *url) {
    return !strcmp(url, "/v1/generate") || !strcmp(url, "/v1/tokenize") || !strcmp(url, "/v1/detokenize") ||
           !strcmp(url, "/v1/stats") || !strcmp(url, "/v1/cache/save") || !strcmp(url, "/v1/cache/load");
}

/* The body limit of one request: /v1/tokenize's bound by the context,
 * else --max-body-bytes. */
static size_t dn_body_cap(const dnode *n, const char *url) {
    size_t all = (size_t)n->o->max_body_bytes;
    if (strcmp(url, "/v1/tokenize")) return all;
    size_t cap = (size_t)n->n_ctx * DN_TOK_BODY_PER_TOKEN + DN_TOK_BODY_SLACK;
    return cap < all ? cap : all;
}

/* A refused generation request is logged and counted (dn_refuse); the
 * others are only answered. */
typedef enum MHD_Result (*dn_refuse_fn)(dnode *, struct MHD_Connection *, unsigned, const char *, const char *);
static dn_refuse_fn dn_refuser(const char *url) { return strcmp(url, "/v1/generate") ? dn_send_error : dn_refuse; }

/* Per-connection request state: the uploaded body. */
typedef struct {
    strbuf body;
    size_t cap;                  /* dn_body_cap of this request */
    int too_big;
} dn_conn;

static enum MHD_Result dn_on_request(void *cls, struct MHD_Connection *c, const char *url, const char *method,
                                     const char *version, const char *upload, size_t *upload_size, void **con_cls) {
    dnode *n = cls;
    dn_conn *cc = *con_cls;
    char aerr[256];
    if (!cc) {
        if (!(cc = calloc(1, sizeof *cc))) return MHD_NO;
        *con_cls = cc;
        cc->cap = dn_body_cap(n, url);
        /* headers in: refuse an unsigned request, or one announcing a body
         * past its bound, before reading its body */
        if (n->auth && dn_needs_signature(url) &&
            node_auth_check_request(c, &n->key, n->replay, method, url, NULL, 0, aerr, sizeof aerr))
            return dn_refuser(url)(n, c, 401, "authentication_error", aerr);
        const char *cl = MHD_lookup_connection_value(c, MHD_HEADER_KIND, MHD_HTTP_HEADER_CONTENT_LENGTH);
        char *end = NULL;
        unsigned long long want = cl ? strtoull(cl, &end, 10) : 0;
        if (cl && end != cl && want > cc->cap) {
            snprintf(aerr, sizeof aerr, "request body of %llu bytes: more than %zu (%s)", want, cc->cap,
                     strcmp(url, "/v1/tokenize") ? "--max-body-bytes" : "what the context can hold");
            return dn_refuser(url)(n, c, 413, "invalid_request_error", aerr);
        }
        return MHD_YES;
    }
    if (*upload_size) {
        if (cc->body.len + *upload_size > cc->cap) cc->too_big = 1;
        else if (strbuf_put(&cc->body, upload, *upload_size)) cc->too_big = 1;
        *upload_size = 0;
        return MHD_YES;
    }
    int get = !strcmp(method, "GET") || !strcmp(method, "HEAD"), post = !strcmp(method, "POST");
    if (!strcmp(url, "/health")) return get ? dn_handle_health(n, c) : dn_send_error(n, c, 405, "invalid_request_error", "use GET");
    if (!strcmp(url, "/metrics")) return get ? dn_handle_metrics(n, c) : dn_send_error(n, c, 405, "invalid_request_error", "use GET");
    if (!dn_needs_signature(url))
        return dn_send_error(n, c, 404, "not_found", "no such endpoint (try POST /v1/generate, GET /health, GET /v1/stats, GET /metrics)");
    dn_refuse_fn refuse = dn_refuser(url);
    int want_post = strcmp(url, "/v1/stats") != 0;
    if (want_post ? !post : !get) return refuse(n, c, 405, "invalid_request_error", want_post ? "use POST" : "use GET");
    if (cc->too_big) return refuse(n, c, 413, "invalid_request_error", "request body too large");
    if (n->auth) {
        if (node_auth_check_request(c, &n->key, n->replay, method, url, cc->body.p ? cc->body.p : "", cc->body.len,
                                    aerr, sizeof aerr))
            return refuse(n, c, 401, "authentication_error", aerr);
        httpd_trust_peer(c);   /* the router: its address gets the reserved connections (httpd.h) */
    }
    if (!strcmp(url, "/v1/stats")) return dn_handle_stats(n, c);
    if (!strcmp(url, "/v1/generate")) return dn_handle_generate(n, c, cc->body.p, cc->body.len);
    if (!strncmp(url, "/v1/cache/", 10)) return dn_handle_cache(n, c, url[10] == 's', cc->body.p, cc->body.len);
    return dn_handle_tokens(n, c, url[4] == 'd', cc->body.p, cc->body.len);   /* /v1/tokenize, /v1/detokenize */
}

static void dn_on_completed(void *cls, struct MHD_Connection *c, void **con_cls, enum MHD_RequestTerminationCode toe) {
    dn_conn *cc = *con_cls;
    if (!cc) return;
    free(cc->body.p);
    free(cc);
    *con_cls = NULL;
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


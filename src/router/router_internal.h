/* router_internal.h - what the router's files share: the node table entry,
 * the router itself, one request, a batch of several prompts, a client
 * connection, the upstream reader; and router.c's small helpers. Private to
 * src/router/ (like engine/model_internal.h): nothing outside includes it.
 * Each file's own functions for the others are in its header beside it:
 *
 *   router.c            start/stop, HTTP plumbing, dispatch, metrics families
 *   router_config.c     config file and command line
 *   router_nodes.c      cost model, node picking, health checks (router_nodes.h)
 *   router_request.c    a request's life: plan, attempts, learning, log (router_request.h)
 *   router_stream.c     upstream reading, tool calls, replies and SSE (router_stream.h)
 *   router_batch.c      several prompts; rt_generate (router_batch.h)
 *   router_endpoints.c  models, health, metrics, tokens, registration (router_endpoints.h)
 *
 * The rule of every router file: the registry, the measured rates and the
 * metrics live under one mutex (router.mu); no lock is held across I/O.
 */
#ifndef TANDEM_ROUTER_INTERNAL_H
#define TANDEM_ROUTER_INTERNAL_H

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


/* ==== Registry ==== */

/* A client's X-Request-Id: up to 64 characters [A-Za-z0-9._:-] (a UUID,
 * a trace id); longer or other ones are not echoed. */
#define RT_CLIENT_ID_MAX 64
/* The X-Request-Id a reply carries: the client's, else the router's. */
#define RT_ECHO_ID(q) ((q)->client_rid[0] ? (q)->client_rid : (q)->rid)

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
    int n_ctx;                   /* the node's context (a decode node's /health "n_ctx", a prefill node's HELLO "; ctx N"); 0 = not reported */
    unsigned long long requests, failures, checks_failed;
    char desc[400];
    double hold_ms;              /* how long a request holds a slot here (moving average; 0 = not yet measured) */
    double probe_ms;             /* health probe round trip (moving average): its timeout adapts to it */
    struct rc_node *cache;       /* what it holds (router_cache.c), or NULL */
} rt_node;

/* ==== Metrics ==== */

/* Families of the router's /metrics (metrics.h; docs/router.md lists
 * them). Series are created when first observed: a (decision, reason) pair
 * is exported once a request took it. Histograms are in seconds and carry
 * the request's model (a name some decode node serves). */
enum { RT_EP_CHAT, RT_EP_COMPLETIONS, RT_EP_MODELS, RT_EP_OTHER, RT_EP_RESPONSES, RT_EP_N };
static const char *const rt_ep_names[RT_EP_N] = {"chat", "completions", "models", "other", "responses"};
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
    volatile int draining;       /* router_drain: no new generation request */
    atomic_int cut;              /* router_drain's deadline passed: streams end with an error event */
    pthread_t health;
    int health_started;
    rt_metrics m;
    long long started_unix;
};

/* ==== Upstream reader (router_stream.c) ==== */

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
    atomic_int *cut;             /* set: the router's drain deadline passed (router.cut; NULL: never) */
} rt_up;

/* What rt_up_line returns. */
enum { RT_LINE = 1, RT_EOF = 0, RT_FAIL = -1, RT_TIMEOUT = -2, RT_GONE = -3, RT_CUT = -4 };

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
    char client_rid[RT_CLIENT_ID_MAX + 1];   /* the client's X-Request-Id when it is not a log id
                                              * (echoed, and on the router's line), else "" */
    char client[64];             /* the client's address, sent as X-Tandem-Client for the node's share */
    long long created;
    int client_fd;
    /* chosen nodes */
    int decode_idx, prefill_idx;
    char decode_addr[128], prefill_addr[128];
    router_decision dec;
    int n_prompt;                /* prompt tokens the plan was made for */
    int count_exact;             /* counted by the decode node's tokenizer (else a byte estimate) */
    char count_note[200];        /* "tokenizer", "token ids" or "byte estimate: why" */
    struct rc_prompt *rcp;       /* the prompt's ids and block hashes (router_cache.c), or NULL */
    int counted;                 /* n_prompt counted before the pick (cache-aware routing) */
    int planned;                 /* the pick made the plan too (q->dec, prefill_idx) */
    int tried[ROUTER_MAX_NODES];
    int attempts;
    int busy;                    /* attempts a node refused as full (503/429) */
    rt_up up;
    int have_up;
    /* progress */
    double t_start, t_first, t_last;
    int n_tokens;                /* choice 0's tokens (TTFT, TPOT) */
    int cut;                     /* ended by the router's drain deadline (router_ops.c) */
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
static inline int rt_kid_index(const rt_req *q) { return q->index_base / q->batch->parent->req.n; }
/* ==== HTTP plumbing ==== */

typedef struct {
    int ep;
    char *body;
    size_t len, cap;
    size_t limit;                /* body bytes this request may carry (rt_first_call) */
    int too_big;
    int handled;
    struct rt_responses *responses;   /* POST /v1/responses: the request as translated (router_responses.c) */
} rt_conn;

/* Seconds a client told 429 should wait: about one health interval, after
 * which the router knows the nodes' queues afresh. */
#define RT_RETRY_AFTER "1"

/* ==== Small helpers (router.c) ==== */

double rt_now_ms(void);
void rt_errf(char *err, size_t errlen, const char *fmt, ...) __attribute__((format(printf, 3, 4)));
void rt_ewma(double *avg, double x);
void rt_count_request(router *r, int ep, int status);
enum MHD_Result rt_send(struct MHD_Connection *c, int status, const char *ctype, char *body);
/* A JSON response (body taken) with Retry-After on 429/503; NULL on out of memory. */
struct MHD_Response *rt_response_json(int status, char *body);
enum MHD_Result rt_send_error(router *r, struct MHD_Connection *c, int ep, const api_error *e);
int rt_client_fd(struct MHD_Connection *c);
/* The client's address as text ("" when not an IP connection). */
void rt_client_addr(struct MHD_Connection *c, char *out, size_t n);
int rt_key_ok(router *r, struct MHD_Connection *c);
long rt_http_get(const char *addr, const char *path, const node_auth_key *key, int timeout_ms, strbuf *out,
                 char *err, size_t errlen);
/* router_ops.c: the start-up check that every reachable configured decode
 * node accepts the router's signature (0, or -1 with a message naming the
 * nodes), the warning for an open router on every interface, and the
 * error a drain's cut ends a stream or a reply with. */
int rt_ops_check_secret(router *r, char *err, size_t errlen);
void rt_ops_warn_open(const router_config *c);
void rt_ops_cut_error(api_error *e, int n_tokens);
/* A registered node said it is leaving (draining): down at once, removed
 * by the health round once its requests here are done. Caller holds mu. */
void rt_ops_node_leaves_locked(router *r, int i);

#endif

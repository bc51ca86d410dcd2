/* node_decode_internal.h - what the decode node's files share (not part of
 * its interface: node_decode.h is). The node's state (dnode), a parsed
 * request (dn_req), a generation job (dn_job), their limits, and the dn_
 * functions one file of the node calls in another:
 *   node_decode.c          start, listen, run; prefill-node connections
 *   node_decode_request.c  POST /v1/generate bodies parsed and bounded
 *   node_decode_job.c      a generation job: submission, remote prefill,
 *                          waiting on the scheduler, result JSON, streaming
 *   node_decode_http.c     HTTP answers, endpoints, client shares, signatures
 *   node_decode_stats.c    counters, /metrics families, /v1/stats, the log line
 */

#ifndef TANDEM_NODE_DECODE_INTERNAL_H
#define TANDEM_NODE_DECODE_INTERNAL_H

#include "node/node_decode.h"

#include <pthread.h>
#include <sys/types.h>

#include <jansson.h>
#include <microhttpd.h>

#include "base/log.h"
#include "base/metrics.h"
#include "base/strbuf.h"
#include "engine/grammar.h"
#include "engine/sampler.h"
#include "engine/tokenizer.h"
#include "net/node_auth.h"
#include "node/chain.h"
#include "node/draft.h"
#include "node/handoff.h"
#include "node/kvstore.h"
#include "node/prefix_report.h"
#include "node/scheduler.h"
#include "node/spec_report.h"

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

/* ==== node_decode.c ==== */

json_t *dn_json_text(const char *s, size_t n);
dn_peer *dn_peer_take(dnode *n, const char *addr, const prefix_held *want);
void dn_peer_give(dnode *n, dn_peer *p, prefix_held *held);
json_t *dn_prefix_json(dnode *n);

/* ==== node_decode_request.c ==== */

void dn_req_free(dn_req *r);
int dn_parse_prompt(dnode *n, json_t *o, dn_req *r, char *err, size_t errlen);
int dn_parse_request(dnode *n, const char *body, size_t len, dn_req *r, char *err, size_t errlen);

/* ==== node_decode_job.c ==== */

double dn_now(void);
const sched_view *dn_job_wait(dn_job *j, int have);
void dn_job_free(dn_job *j);
char *dn_dump(json_t *o, size_t *len);
ssize_t dn_stream_read(void *cls, uint64_t pos, char *buf, size_t max);
void dn_stream_free(void *cls);
enum MHD_Result dn_generate_full(dn_job *j, struct MHD_Connection *c);
unsigned dn_job_submit(dnode *n, const char *body, size_t len, double t_arrive, uint64_t client, dn_job **out,
                       const char **type, char *err, size_t errlen);

/* ==== node_decode_http.c ==== */

enum MHD_Result dn_send_body(struct MHD_Connection *c, unsigned status, char *body, size_t len,
                             const char *ctype);
enum MHD_Result dn_send_json(struct MHD_Connection *c, unsigned status, json_t *o);
void dn_client_put(dnode *n, uint64_t id);
enum MHD_Result dn_on_request(void *cls, struct MHD_Connection *c, const char *url, const char *method,
                              const char *version, const char *upload, size_t *upload_size, void **con_cls);
void dn_on_completed(void *cls, struct MHD_Connection *c, void **con_cls, enum MHD_RequestTerminationCode toe);

/* ==== node_decode_stats.c ==== */

int dn_metrics_init(dn_metrics *m, const decode_node_opts *o, char *err, size_t errlen);
void dn_metrics_refused(dn_metrics *m, unsigned status);
void dn_count_job(dn_job *j);
const char *dn_cache_tier(const sched_view *v);
void dn_log_job(dn_job *j);
enum MHD_Result dn_handle_stats(dnode *n, struct MHD_Connection *c);
enum MHD_Result dn_handle_metrics(dnode *n, struct MHD_Connection *c);

#endif /* TANDEM_NODE_DECODE_INTERNAL_H */

/* router.h - `tandem serve --role router`: the OpenAI-compatible front door.
 *
 * The router loads no model. It keeps a registry of nodes (from a config
 * file, the command line, or nodes that register themselves and send
 * heartbeats), checks their health, and for every request picks the healthy
 * decode node serving the requested model with the least expected time to
 * first token (router_cache.c: the wait for a slot, per slot, and the
 * prefill the prefixes it holds leave; 429 when all are full), decides from a
 * cost model whether the prompt is prefilled on that decode node ("local")
 * or on a prefill node ("split"), and forwards the request to the decode
 * node's POST /v1/generate (libcurl), turning its NDJSON stream into
 * OpenAI responses or SSE (http_api_render.c). HTTP via libmicrohttpd.
 * docs/router.md describes the config file, endpoints, metrics and the
 * cost model.
 */
#ifndef TANDEM_ROUTER_H
#define TANDEM_ROUTER_H

#include <stddef.h>
#include <stdint.h>

#include "api/http_api.h"

#define ROUTER_MAX_NODES 64

enum router_role { ROUTER_NODE_DECODE = 1, ROUTER_NODE_PREFILL = 2 };
enum router_split { ROUTER_SPLIT_AUTO = 0, ROUTER_SPLIT_ALWAYS = 1, ROUTER_SPLIT_NEVER = 2 };

typedef struct {
    int role;                    /* enum router_role */
    char addr[128];              /* host:port */
    char model[128];             /* the name clients use in "model" */
} router_node_cfg;

typedef struct {
    char listen[128];            /* default 127.0.0.1:8000; port 0 = any free port */
    char api_key[256];           /* "" = no authentication */
    char *secret;                /* shared secret: signs requests to decode nodes, verifies registrations; may be NULL */
    size_t secret_len;
    int split;                   /* enum router_split */
    int min_split_tokens;        /* auto: prompts shorter than this stay local */
    double link_gbps;            /* link rate assumed until measured */
    double default_prefill_tps;  /* prefill rate assumed for a node that reports none */
    int tokenize_timeout_ms;     /* bound on counting a prompt's tokens on a decode node */
    api_limits lim;
    size_t max_body_bytes;
    int max_concurrent;          /* generation requests in flight; more get 429 */
    int request_timeout_ms;      /* whole request */
    int idle_timeout_ms;         /* no line from the decode node for this long after its first token = node failure */
    int connect_timeout_ms;
    int max_attempts;            /* decode nodes tried per request */
    int cache_aware;             /* route by the prefixes nodes hold (router_cache.c); 0: by capacity alone */
    int health_interval_ms;
    int down_after;              /* consecutive failed checks that mark a node down */
    int heartbeat_ttl_ms;        /* registered node with no heartbeat for this long is down */
    int quiet;                   /* no per-request log lines */
    int max_conns;               /* HTTP connections in all (httpd.h) */
    int max_conns_per_ip;        /* HTTP connections per client address; 0 = a 16th of max_conns */
    int reg_private_only;        /* registration_addresses "private": loopback and private networks only */
    int request_deadline_ms;     /* a request's headers + body must arrive within this */
    int metrics_auth;            /* /metrics needs the API key too (config "metrics_auth", --metrics-auth) */
    int drain_timeout_ms;        /* SIGTERM/SIGINT: how long requests in flight may finish (router_ops.c) */
    router_node_cfg nodes[ROUTER_MAX_NODES];
    int n_nodes;
} router_config;

/* Defaults for everything (no nodes). */
void router_config_default(router_config *c);
/* Reads a JSON config file into c (on top of what c holds). 0 or -1 with message. */
int router_config_load(router_config *c, const char *path, char *err, size_t errlen);
/* Adds a node; "role" is "decode" or "prefill". 0 or -1 with message. */
int router_config_add_node(router_config *c, const char *role, const char *model, const char *addr,
                           char *err, size_t errlen);
void router_config_free(router_config *c);

/* ==== Cost model (pure; unit-tested) ==== */
typedef struct {
    int n_prompt;                /* prompt tokens */
    const char *count_note;      /* how n_prompt was counted, for the reason ("tokenizer", "byte estimate: ...") */
    double decode_prefill_tps;   /* the decode node's own prefill rate */
    double prefill_prefill_tps;  /* the prefill node's rate */
    int decode_tps_assumed;      /* the rates are default_prefill_tps, not reported by the nodes */
    int prefill_tps_assumed;
    double link_bytes_per_s;
    double kv_bytes_per_token;   /* 0 = unknown */
    double handoff_overhead_ms;  /* measured fixed cost of a split (connect, last layer, ...) */
    int decode_queue;            /* requests ahead on the decode node */
    int prefill_queue;           /* requests ahead on the prefill node */
    int have_prefill;            /* a healthy prefill node serves the model (and takes a prompt this long) */
    int prefill_too_short;       /* with have_prefill 0: one serves it, but its context is below n_prompt */
    int policy;                  /* enum router_split */
    int min_split_tokens;
    /* prompt positions already held (router_cache.c; 0 = none known): by the
     * decode node (neither computed nor sent), and by the prefill node's
     * session for that decode node (not computed, still sent) */
    int cached_decode, cached_prefill;
} router_cost_in;

typedef struct {
    int split;                   /* 1: prefill on the prefill node */
    double est_local_ms, est_split_ms;
    const char *key;             /* short reason for metrics: policy, short_prompt, no_prefill_node, prefill_context, cost */
    char reason[320];
} router_decision;

void router_decide(const router_cost_in *in, router_decision *d);

/* A health probe's timeout (ms) for a node whose probes took probe_ms on
 * average (0: not measured): at least the interval and 1 s, RT_PROBE_SLACK
 * times probe_ms when longer, at most 30 s (router_nodes.c). */
int router_probe_timeout_ms(int interval_ms, double probe_ms);

/* ==== Server ==== */
typedef struct router router;

/* Starts the HTTP server and the health thread. 0 or -1 with message.
 * The router copies what it needs from cfg (secret included). */
int router_start(router **out, const router_config *cfg, char *err, size_t errlen);
int router_port(const router *r);
/* Graceful end (router_ops.c): stops accepting, lets the requests in flight
 * finish for up to cfg.drain_timeout_ms, then ends every stream still
 * running with an error event and [DONE] (a reply not begun gets 503).
 * Call router_stop after it. */
void router_drain(router *r);
void router_stop(router *r);

/* `tandem serve --role router [options]` (argv as given to serve). */
int router_cli(int argc, char **argv);
/* The router's options (tandem serve --role router --help). */
#include <stdio.h>
void router_usage(FILE *f);

/* A registered node's address: HOST:PORT only, no link-local or unspecified
 * address; private_only: loopback and private IP addresses only (no names).
 * 0, or -1 with a message (router_endpoints.c; fuzz/fuzz_router_addr.c). */
int router_check_addr(const char *addr, int private_only, char *err, size_t errlen);

#endif

/* node_decode.h - the decode node: an HTTP server that owns the sessions,
 * samples tokens and (optionally) offloads prompt prefill to prefill nodes.
 *
 * Endpoints (JSON via jansson, HTTP via libmicrohttpd):
 *   POST /v1/generate   generation request; streamed as NDJSON if "stream"
 *   GET  /health        {"status":"ok","model":...,"role":"decode"|"local"}
 *   GET  /v1/stats      counters and moving-average speeds (router cost model), and
 *                       "prefix": the block hashes of the prefixes it holds
 *                       (prefix_report.h; cache-aware routing)
 *   GET  /metrics       Prometheus text (docs/router.md lists the families)
 *   POST /v1/cache/save a generation body names a prefix (a rubric): computed
 *                       (one token) unless the KV store has it, its blocks
 *                       written to disk; {"prompt_tokens","stored_tokens","tier"}
 *   POST /v1/cache/load the same body: its blocks read from disk into memory
 *                       (`tandem cache save|load` is the CLI form)
 *
 * Authentication: a node with a shared secret takes POST /v1/generate
 * only when signed by a router (node_auth.h, key label "tandem decode-api
 * v1"): anything else gets 401. "prefill_node" (the peer the node will
 * connect to) is refused outright by a node without a secret. GET /health,
 * GET /v1/stats and GET /metrics stay open (they act on nothing and carry
 * counts and timings, no prompt, text or key).
 *
 * POST /v1/generate body: exactly one of "prompt" (string; "chat": true
 * wraps it as one user message), "messages" ([{"role","content"}], rendered
 * with the model's chat template) or "tokens" (ids); "max_tokens" (128),
 * "temperature", "top_k", "top_p", "min_p", "seed" (sampler defaults: greedy;
 * no seed: a fresh one per request),
 * "ignore_eos", "stop" (string or up to 8 strings), "logprobs" (0..20: each
 * token's log-probability under the model and that many top alternatives,
 * as "logprob" and "top_logprobs": [{"id","text","logprob"}] on each token
 * line, or a "logprobs" array in the non-stream object), "n" (1..8, at most
 * the node's slots and its queue; > 1 only with "stream": that many choices sampled from
 * the prompt, computed once: choice i > 0 copies choice 0's KV rows and
 * samples with seed + i; every line then carries its choice's "index" and
 * each choice ends with its own "done" line), "prefill": "auto" |
 * "remote" | "local", "prefill_node": "host:port", "stream"; at most one
 * constraint: "response_format" (text, json_object, json_schema), "grammar"
 * (GBNF), "regex", "choice" (strings); "min_tokens" (end tokens and stop ids
 * masked until then), "stop_token_ids" (up to 64 ids ending the output),
 * "max_tokens_strict" (true: a prompt plus max_tokens beyond the context is
 * a 400 instead of stopping at its end; the router sets it for a client's
 * explicit max_tokens) (api/extensions.h). Answer: NDJSON
 * lines {"token","text"} then {"done":true, "finish_reason", "usage",
 * "prefill": {"mode", "node", "fallback_reason", "start_pos",
 * "positions_received", "computed_remote", "computed_local", "kv_bytes",
 * "wire_bytes", "prefill_ms", "ttft_ms", ...}, "speculative": {"source",
 * "drafted", "accepted"} (with --lookup / --draft-model), "error"}; or, not streamed,
 * one object with "tokens", "text" and the same fields. A stop string ends
 * generation and is never part of the text: a streamed line's "text" is what
 * became final with its token (text that could still be the start of a stop
 * string is held back and sent with a later line or the final one), and the
 * non-stream "text" is cut before the stop string. Errors: 400/404/405/413 {"error":{"message","type"}}, 503
 * when the queue is full or the node is stopping.
 *
 * Continuous batching (scheduler.h): up to n_sessions requests generate
 * together, one token each per model pass, while newly admitted prompts are
 * evaluated in the same passes within a per-step budget; further requests
 * wait in a bounded queue, beyond which they get 503. Each slot keeps its
 * KV cache and token list after its request ends; a request starts from the
 * longest cached prefix of any slot (copying rows from another slot when
 * that one shares more), so only the missing span is prefilled (locally or
 * by a prefill node). A remote prefill that fails falls back to local
 * prefill for that request. With kv_cache_ram / kv_cache_dir, finished
 * sequences' rows also go to a KV store (kvstore.h: memory, then disk), and
 * a request continues the slot's prefix with stored blocks; the final line's
 * usage carries "prompt_tokens_details": {"cached_tokens": start_pos} and
 * its prefill object "cache_tier" (none, slot, ram, disk),
 * "store_ram_tokens" and "store_disk_tokens".
 */
#ifndef TANDEM_NODE_DECODE_H
#define TANDEM_NODE_DECODE_H

#include <stddef.h>
#include <stdint.h>

#include "engine/model.h"

#define DECODE_MAX_PREFILL_NODES 16

typedef struct {
    const char *listen;          /* host:port; port 0 picks a free port (default 127.0.0.1:8080) */
    const char *port_file;       /* if set, the bound port is written here once listening */
    int local_only;              /* --role local: never use a prefill node */
    const char *prefill_nodes[DECODE_MAX_PREFILL_NODES];
    int n_prefill_nodes;
    const void *secret;          /* shared secret for the prefill nodes' handshake */
    size_t secret_len;
    const char *node_id;         /* our name in HELLO (default "decode") */
    const char *model_path;      /* for /health */
    const char *model_name;      /* the "model" label of /metrics (default: the file name without .gguf) */
    int n_ctx;                   /* per-session context (default: the model's, at most 4096) */
    uint32_t kv_dtype;           /* cache type (default GGML_TYPE_F16) */
    uint32_t wire_dtype;         /* handoff wire type (default: the cache type) */
    uint32_t act_dtype;          /* a chain's hidden states on the wire: F32 (0, default), F16 or BF16 */
    int zstd;                    /* ask prefill nodes for zstd frames */
    int timeout_ms;              /* handoff: no frame for this long -> fall back (default 10000) */
    int handoff_deadline_ms;     /* --handoff-deadline-ms: a handoff's total limit (0 = it grows with
                                  * the prompt, net/deadline.h) */
    int n_sessions;              /* --parallel: slots decoded together, one KV cache each
                                  * (default: what half the free memory holds, at most 8) */
    int prefill_budget;          /* prompt tokens per step while other slots decode (default 256) */
    int lookup;                  /* --lookup N: speculative drafts from prompt lookup (draft.h), 0: off */
    model *draft_model;          /* --draft-model: loaded by the caller, freed after decode_node_run */
    int draft_max;               /* --draft-max: drafts per step from the draft model (default 8) */
    int draft_fixed;             /* --draft-fixed: always the most drafts (no adaptation) */
    const char *draft_node;      /* --draft-node HOST:PORT: drafts from a draft node (draft_remote.h) */
    int draft_timeout_ms;        /* --draft-timeout-ms: a draft node exchange's deadline (default 100) */
    int queue_max;               /* requests that may wait for the model (default 16) */
    int min_split_tokens;        /* "auto" uses a prefill node from this prompt length (default 32) */
    int max_body_bytes;          /* request body limit (default 8 MiB) */
    int max_conns;               /* HTTP connections in all (default 4 x (queue_max + slots + 32) + 64) */
    int client_share;            /* percent of slots + queue one client may hold (default 50; 100 = no share) */
    int max_conns_per_ip;        /* per address other than the router's (default: httpd.h shares) */
    int request_deadline_ms;     /* a request's headers + body must arrive within this (default 10000) */
    uint64_t kv_cache_ram;       /* KV store (kvstore.h): memory tier bytes (0: none) */
    const char *kv_cache_dir;    /* its disk tier (NULL: none) */
    uint64_t kv_cache_disk;      /* the disk tier's budget (0: 4 GiB) */
    const char *chat_source;     /* /health "chat_template": "model", "option" (--chat-template) or
                                  * "fallback" (ChatML for a model without one); NULL = "model" */
    volatile int *port_out;      /* if set, receives the bound port once listening */
    volatile int *stop;          /* set non-zero (e.g. from a signal handler) to shut down */
    int drain_timeout_ms;        /* then: requests in flight may finish this long (node_drain.h; 0 = cut at once) */
    struct node_register *reg;   /* the registration to take back when draining (NULL: none) */
} decode_node_opts;

/* Serves until *o->stop is set; 0 on clean shutdown, -1 with a message. */
int decode_node_run(model *m, const decode_node_opts *o, char *err, size_t errlen);
/* Parse and validate one POST /v1/generate body exactly as the running node
 * would (JSON, types, ranges, prompt tokenization and context limit), without
 * serving it: 0, or -1 with the 400 message. The fuzz target's entry. */
int decode_node_check_request(model *m, const decode_node_opts *o, const char *body, size_t len,
                              char *err, size_t errlen);

/* `tandem serve --role decode|local ...`: parses the options (argv as given
 * to `serve`, "--role X" is skipped), loads the model, handles SIGINT and
 * SIGTERM, and runs the node. Returns the process exit status. */
int decode_node_cli(int argc, char **argv, int local_only);
/* The decode and local roles' options (tandem serve --role decode --help). */
#include <stdio.h>
void decode_node_usage(FILE *f);

#endif

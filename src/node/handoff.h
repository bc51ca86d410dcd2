/* handoff.h - moving a prompt's KV cache from a prefill node to a decode node.
 *
 * Decode side (handoff.c): a handoff_client is one authenticated connection
 * to a prefill node. handoff_prefill() sends the prompt and writes the KV
 * frames into the caller's session as they arrive, so that afterwards the
 * session holds positions [0, n - 1): the caller evaluates the last prompt
 * token itself and gets the first token's logits with nothing recomputed.
 *
 * Prefill side (node_prefill.c): prefill_node_run() accepts decode nodes,
 * computes each request's KV with a per-layer hook that queues frames for a
 * sender thread, so layer L is on the wire while layers L+1.. compute.
 */
#ifndef TANDEM_HANDOFF_H
#define TANDEM_HANDOFF_H

#include <stddef.h>
#include <stdint.h>

#include "engine/model.h"
#include "net/wire.h"

typedef struct {
    uint32_t wire_dtype;        /* GGML_TYPE_F16 (default: the cache type), BF16 or Q8_0 */
    int zstd;                   /* compress frames with zstd if the peer can */
    int timeout_ms;             /* stall timeout: no frame for this long -> the transfer fails
                                 * (default 10000) */
    int deadline_ms;            /* one handoff_prefill may take this long in all, whatever the peer
                                 * sends (PINGs do not extend it); 0 (default): it grows with the
                                 * positions asked for, deadline_prefill_ms (net/deadline.h) */
    const void *secret;         /* shared secret for the handshake (high entropy: see docs/wire-protocol.md) */
    size_t secret_len;
    const char *node_id;        /* our name in HELLO */
    /* Optional: polled between frames; non-zero = the caller abandoned the
     * request (its client went away): the transfer is cancelled (CANCEL to
     * the prefill node) and handoff_prefill fails with "cancelled". */
    int (*abandoned)(void *ud);
    void *abandoned_ud;
} handoff_opts;

typedef struct {
    int start_pos;              /* positions the decode node already had */
    int n_sent;                 /* positions received from the prefill node */
    int n_computed_remote;      /* prompt positions the prefill node computed */
    int n_computed_local;       /* set by the caller: positions the decode node computed (1) */
    double prefill_ms_remote;   /* compute time reported by the prefill node */
    double total_ms;            /* request sent -> last frame written into the cache */
    double transfer_tail_ms;    /* DONE's arrival after the prefill node finished computing (exposed transfer) */
    uint64_t kv_bytes, wire_bytes;
} handoff_stats;

typedef struct handoff_client handoff_client;

int handoff_connect(handoff_client **out, const char *hostport, model *m, uint32_t kv_dtype,
                    const handoff_opts *o, char *err, size_t errlen);
void handoff_close(handoff_client *c);
/* The peer's description (node id and model), for messages. */
const char *handoff_peer(const handoff_client *c);

/* The request id (log.h) of the following handoff_prefill calls: it travels
 * in the low 32 bits of the wire request id, for the prefill node's log. */
void handoff_set_log_id(handoff_client *c, uint32_t id);

/* Fill s (whose cache holds [0, start_pos) already, and tokens[0..start_pos)
 * match) with positions [start_pos, n - 1). 0 on success; -1 on any failure
 * (peer died, stalled, sent a bad frame, refused): then the session is reset
 * to start_pos, the connection is unusable, and err says what happened. */
int handoff_prefill(handoff_client *c, session *s, const int32_t *tokens, int n, int start_pos,
                    handoff_stats *st, char *err, size_t errlen);

/* ==== For the layer-split chain (chain.c) ==== */
wire_conn *handoff_conn(handoff_client *c);
const char *handoff_peer_desc(const handoff_client *c);   /* the peer HELLO's model_desc */
uint32_t handoff_caps(const handoff_client *c);           /* capabilities both ends have */
uint32_t handoff_wire_dtype(const handoff_client *c);
int handoff_timeout_ms(const handoff_client *c);
/* The total deadline (ms) of a transfer of n_positions: the explicit
 * handoff_opts.deadline_ms, else deadline_prefill_ms(n_positions). */
int handoff_deadline_for(const handoff_client *c, int n_positions);
int handoff_is_broken(const handoff_client *c);
int handoff_poll_abandoned(handoff_client *c);
/* Sends a REQUEST with the next request id (returned; 0 on failure, the
 * connection then broken); extra_flags are ORed into the request's flags. */
uint64_t handoff_send_request(handoff_client *c, const int32_t *tokens, int n, int start_pos, int end_pos,
                              uint32_t extra_flags, char *err, size_t errlen);
/* Ends a request in flight: ERROR(code) when code != 0, else CANCEL; the
 * connection is shut and marked broken. */
void handoff_abort(handoff_client *c, uint64_t req, uint32_t code, const char *why);

/* ==== Shared by both sides ==== */
/* A node's HELLO: caps, KV dtype, node id, model_fingerprint() and a model
 * description ("file (arch, layers, n_embd, weight type), KV type").
 * The handshake draws the nonce. */
int handoff_hello_init(wire_hello *h, model *m, uint32_t kv_dtype, uint32_t role, const char *node_id,
                       char *err, size_t errlen);
/* Converts n_rows rows of dim elements between KV types (via f32; tmp holds dim floats). */
void handoff_convert_rows(uint32_t src_type, const void *src, uint32_t dst_type, void *dst,
                          int n_rows, int dim, float *tmp);

/* ==== Prefill node ==== */
typedef struct {
    const char *listen;         /* host:port (host defaults to 127.0.0.1) */
    const void *secret;
    size_t secret_len;
    const char *node_id;
    int n_ctx;                  /* per-request context (default 4096) */
    uint32_t kv_dtype;          /* cache type (default F16) */
    int timeout_ms;             /* per-frame I/O deadline (default 10000) */
    volatile int *stop;         /* set non-zero (e.g. from a signal handler) to shut down */
    const char *port_file;      /* if set, the bound port is written there once listening */
    int max_conns;              /* authenticated connections (default 16) */
    int max_preauth;            /* connections still in their handshake (default 16); when full,
                                 * the oldest is dropped for a new one */
    int handshake_ms;           /* a handshake must complete within this (default 2000) */
    int idle_ms;                /* an authenticated connection with no REQUEST for this long is
                                 * closed; PINGs do not count (default 300000) */
    int request_ms;             /* one request (queue wait, compute and send) may take this long
                                 * in all; 0 (default): it grows with the request's positions,
                                 * deadline_prefill_ms (net/deadline.h) */
    volatile int *port_out;     /* if set, receives the bound port once listening */
    /* GET /metrics (Prometheus text) over HTTP on an address of its own (the
     * node's port speaks the wire protocol): off unless metrics_listen is
     * set. Open like the decode node's /metrics: counts and timings only. */
    const char *metrics_listen;     /* host:port (port 0 = any free port) */
    const char *metrics_port_file;  /* if set, the bound metrics port is written there */
    const char *model_name;         /* the "model" label (default: the node's model file name) */
    const char *model_path;         /* for that default */
    /* Fault injection for tests only: sleep this long before each KV frame;
     * corrupt one payload byte of the Nth KV frame of every request after
     * its CRC was computed (a checksum error); flip one sealed byte of the
     * Nth KV frame and fix its CRC (an authentication tag error). 0 = off. */
    int debug_frame_delay_ms;
    int debug_layer_delay_ms;   /* sleep this long after each layer's computation, holding the model (a slow node) */
    int debug_corrupt_frame;
    int debug_tamper_frame;
    /* KV prefix store (kvstore.h), as on decode nodes: a request's prompt
     * continues the connection's cached prefix with stored blocks, and the
     * computed prompt's blocks are put there */
    uint64_t kv_cache_ram;
    const char *kv_cache_dir;
    uint64_t kv_cache_disk;
    int debug_act_stall;        /* a slice: send nothing more after the Nth ACT frame of a request */
    int chain_min_chunks;       /* a slice: --chain-chunks, the fewest chunks it cuts a request into (chain_chunk_rows) */
    int drain_timeout_ms;           /* on stop: handoffs in flight may finish this long (node_drain.h) */
    struct node_register *reg;      /* the registration to take back when draining (NULL: none) */
    /* --draft-model: a draft node too (draft_serve.h): DRAFT frames are
     * answered with this model's drafts, draft_slots sequences at once
     * (default 8); its HELLO then carries the DRAFT capability */
    model *draft_model;
    int draft_slots;
} prefill_node_opts;

/* Serves until *o->stop is set; 0 on clean shutdown, -1 with a message. */
int prefill_node_run(model *m, const prefill_node_opts *o, char *err, size_t errlen);

#endif

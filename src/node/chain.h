/* chain.h - layer-split (pipelined) prefill over a chain of slice nodes
 * (issue 41; docs/layer-split.md).
 *
 * A chain spec names the slice owners in layer order:
 *   "host:port/0:14,host2:port/14:28"   or, sharing block 3, "h:p/0:3.5,h2:p/3.5:8"
 * Each is a prefill node started with --layers A:B. The decode node sends
 * every node the same REQUEST; node 1 embeds the tokens and computes its
 * layers chunk by chunk, sending each chunk's hidden states (ACT frames) to
 * the decode node, which relays them on its own sealed connection to node
 * 2, and so on, so node k computes chunk c while node k-1 computes c + 1.
 * Every node streams the KV rows of its own layers to the decode node,
 * which stores them by layer and checks that every layer and position
 * arrived exactly once before the session is used.
 *
 * Prefill side helpers (node_prefill.c): the incoming hidden states of a
 * request, and sending a chunk's outgoing ones.
 */
#ifndef TANDEM_CHAIN_H
#define TANDEM_CHAIN_H

#include <stddef.h>
#include <stdint.h>

#include "engine/model.h"
#include "net/chain_spec.h"
#include "net/wire.h"
#include "net/wire_act.h"
#include "node/handoff.h"

/* REQUEST flags bits 1-2 (only with WIRE_CAP_SLICE in both HELLOs): the
 * dtype of the ACT frames the request's slices send: 0 F32, 1 F16, 2 BF16. */
#define CHAIN_REQ_ACT_SHIFT 1
#define CHAIN_REQ_ACT_MASK (3u << CHAIN_REQ_ACT_SHIFT)
uint32_t chain_act_dtype_from_flags(uint32_t flags);   /* UINT32_MAX for the unused value 3 */
uint32_t chain_act_flags(uint32_t dtype);

/* ==== Specs ====
 * chain_spec, chain_spec_parse and chain_spec_desc_layers (a slice's HELLO)
 * are in net/chain_spec.h, shared with the router. */

/* ==== Decode side ==== */
typedef struct {
    uint32_t act_dtype;         /* GGML_TYPE_F32 (default), F16 or BF16 */
} chain_opts;

/* One prefill over connected slice nodes cs[0..n) (handoff_connect each,
 * in the spec's order): fills s with positions [start_pos, n_tok - 1) as
 * handoff_prefill does. Refuses before any work a set whose slices (as the
 * nodes advertise them) do not cover the model's layers exactly once in
 * order, or that differ from the spec's. On any failure no position is
 * kept (the session is back at start_pos), every connection is ended, and
 * err names the node and what happened. */
int chain_prefill(handoff_client **cs, const chain_spec *spec, const chain_opts *o, session *s,
                  const int32_t *tokens, int n_tok, int start_pos, handoff_stats *st, char *err, size_t errlen);

/* A decode node's cached connection sets, one per spec in use (thread-safe). */
typedef struct chain_pool chain_pool;
chain_pool *chain_pool_new(void);
void chain_pool_free(chain_pool *p);
/* chain_prefill over the set for `spec` (connecting what is not yet
 * connected, with ho); one retry with fresh connections when a reused set
 * fails. */
int chain_pool_prefill(chain_pool *p, const char *spec, model *m, uint32_t kv_dtype, const handoff_opts *ho,
                       const chain_opts *co, uint32_t log_id, session *s, const int32_t *tokens, int n_tok,
                       int start_pos, handoff_stats *st, char *err, size_t errlen);

/* ==== Prefill side ==== */
/* A slice's rows per chunk for a request computing `span` positions: its
 * -b (n_batch), halved while that leaves fewer than min_chunks chunks
 * and the half keeps at least CHAIN_MIN_ROWS rows. A pipeline of k nodes
 * over c chunks costs about (c + k - 1) / c of its slowest slice's compute
 * (the bubble: the later slices' last chunks), so more, smaller chunks pay
 * until their rows no longer fill the matmul tiles. Every slice of a chain
 * gets the same REQUEST, so slices with the same -b pick the same rows (and
 * differing ones stay correct: a slice computes a chunk once all its rows
 * have arrived, however they were cut). */
#define CHAIN_MIN_CHUNKS 16   /* the default of a slice's --chain-chunks */
/* Rows below which a chunk loses per-row speed (one core, CPU seconds of
 * `tandem bench -p 1024`: the Qwen3-0.6B shape Q8_0 the same at 128, 256
 * and 512 rows; docs/bench.md). */
#define CHAIN_MIN_ROWS 128
/* A MoE model's experts each see rows * n_expert_used / n_expert of a
 * chunk, and every chunk reads every expert's weights. The 30B-A3B shape's
 * slices, CPU seconds in a chain (docs/bench.md, "Layer-split balance"):
 * 256 rows (16 per expert) cost what 512 do, 128 rows (8) 5-10% more. (An
 * earlier 1.7x at 128 rows was a loaded machine's wall time.) A slice keeps
 * at least this many rows per expert: 256 rows for 128 experts, 8 used. */
#define CHAIN_MIN_EXPERT_ROWS 16
/* The fewest rows for a model's chunks: CHAIN_MIN_ROWS, or for n_expert
 * experts of which n_used are picked per row, enough for
 * CHAIN_MIN_EXPERT_ROWS each. */
int chain_min_rows(int n_expert, int n_used);
int chain_chunk_rows(int n_batch, int span, int min_chunks, int min_rows);

/* The hidden states a slice (layer_lo > 0) has received for a request:
 * rows [p0, end) of dim floats, filled in order. */
typedef struct {
    float *rows;
    int started, p0, end;       /* end: positions [p0, end) received */
    int limit;                  /* positions beyond this are refused (the request's end_pos) */
    int dim;
    size_t cap_rows;
} chain_act_in;

/* Takes one ACT payload: dim must match, the first frame sets p0, every
 * later one must start where the previous ended, nothing beyond limit.
 * 0, or -1 with a message. */
int chain_act_take(chain_act_in *a, const uint8_t *p, size_t n, char *err, size_t errlen);
void chain_act_free(chain_act_in *a);
/* Sends positions [pos0, pos0 + n) of rows (n x dim f32) as ACT frames in
 * dtype, as many as the frame limit needs; fb is scratch. */
int chain_act_send(wire_conn *c, uint64_t req, uint32_t wire_flags, uint32_t dtype, int pos0, int n, int dim,
                   const float *rows, wire_buf *fb, char *err, size_t errlen);

#endif

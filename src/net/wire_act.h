/* wire_act.h - the ACT frame of the layer-split prefill (issue 41;
 * docs/wire-protocol.md section 4.9): one chunk's hidden states leaving the
 * last layer of one slice of the model, on their way to the next slice.
 *
 * A slice node that does not end the model sends them to the decode node,
 * which relays them, unchanged in content, on its own sealed connection to
 * the next slice's node. Both hops are sealed frames of an authenticated
 * connection, with the request's id, so a forged, altered or replayed frame
 * is refused like any other (tag, sequence number, request id).
 *
 *   off size field
 *     0    4 pos0    first position of the rows
 *     4    4 n       rows (positions), at least 1
 *     8    4 dtype   F32 (0), F16 (1) or BF16 (30): the rows' element type
 *    12    4 dim     elements per row (the model's n_embd)
 *    16  n*dim*elt  the rows, position-major
 */
#ifndef TANDEM_WIRE_ACT_H
#define TANDEM_WIRE_ACT_H

#include <stddef.h>
#include <stdint.h>

#include "net/wire.h"

#define WIRE_ACT_FIXED 16u

typedef struct {
    uint32_t pos0, n;
    uint32_t dtype;             /* GGML_TYPE_F32, F16 or BF16 */
    uint32_t dim;
    const uint8_t *rows;        /* n * dim elements (points into the payload) */
} wire_act;

/* Bytes of one element of an ACT dtype; 0 for any other type. */
uint32_t wire_act_elt_bytes(uint32_t dtype);
/* Rows per frame that keep the payload within WIRE_MAX_PAYLOAD (>= 1 for any
 * dim the models allow). */
uint32_t wire_act_max_rows(uint32_t dtype, uint32_t dim);
/* Appends an ACT payload of n rows of dim f32 values, converted to dtype. */
int wire_encode_act(wire_buf *b, uint32_t pos0, uint32_t n, uint32_t dtype, uint32_t dim, const float *rows);
/* Checks dtype, n >= 1, dim >= 1, pos0 + n < 2^31 and the exact length. */
int wire_decode_act(const uint8_t *p, size_t n, wire_act *a, char *err, size_t errlen);
/* The frame's rows as f32 into out (a->n * a->dim floats). */
void wire_act_rows_f32(const wire_act *a, float *out);

/* ==== Slice bounds ====
 * A slice's layers "A:B" (end exclusive), as `--layers`, chain specs and a
 * slice's HELLO (model_desc "...; layers A:B") write them. A bound is a
 * block number L, or "L.5": the middle of block L, after its attention
 * (and its K/V) and before its feed-forward, so that two slices can share a
 * block (docs/layer-split.md, "Balance"). In code a bound is in half
 * blocks: 2L or 2L + 1. A slice owns the K/V of the blocks whose attention
 * it computes: [(A + 1) / 2, (B + 1) / 2) in half blocks A, B. */
#define WIRE_LAYERS_MAX 1024   /* blocks: more make a chain pointless here */
/* Parses "A:B" at s: 0 with *lo < *hi in half blocks (each <= 2 *
 * WIRE_LAYERS_MAX) and *used the characters read, or -1. */
int wire_layers_parse(const char *s, int *lo, int *hi, int *used);
/* One bound in half blocks as written: "3", "3.5". */
void wire_bound_format(char *buf, size_t len, int bound);
/* "A:B" of half-block bounds lo, hi ("3:7", "0:3.5"). */
void wire_layers_format(char *buf, size_t len, int lo, int hi);
/* The first block whose attention lies at or past a bound (half blocks in,
 * a block out): a slice [lo, hi) owns the K/V of blocks
 * [wire_layers_kv(lo), wire_layers_kv(hi)). */
static inline int wire_layers_kv(int bound) { return (bound + 1) / 2; }

#endif

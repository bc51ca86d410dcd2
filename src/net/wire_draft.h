/* wire_draft.h - the DRAFT and DRAFTS frames of remote speculative drafting
 * (issue 42, --draft-node; docs/wire-protocol.md section 4.10).
 *
 * A decode node asks a draft node (a prefill node started with
 * --draft-model, which says so with the DRAFT capability in its HELLO) for
 * drafts of several sequences in one DRAFT frame; the draft node answers
 * with one DRAFTS frame carrying the same sequences in the same order. The
 * frame header's req_id is the exchange number (the decode node's counter,
 * never 0), echoed by the answer.
 *
 * DRAFT (type 11), decode -> draft node:
 *   off size field
 *     0    4 n_seq     sequences in this frame, 1..WIRE_DRAFT_MAX_SEQ
 *   then n_seq entries:
 *     0    4 seq       the decode node's sequence id (its slot)
 *     4    4 keep      tokens of the sequence's history the draft node keeps
 *                      (0 opens or restarts the sequence; > 0 must not exceed
 *                      what it holds: a rejected draft is never part of it)
 *     8    4 k         drafts wanted, 1..WIRE_DRAFT_MAX_K
 *    12    4 n         tokens appended after the kept ones (n >= 1 when keep
 *                      is 0: the last one is the token to be evaluated next)
 *    16  4*n tokens    u32 ids, each < the model's vocabulary
 *
 * DRAFTS (type 12), draft node -> decode:
 *     0    4 n_seq     as asked
 *   then n_seq entries:
 *     0    4 seq       as asked, same order
 *     4    4 status    0 ok; 1 unknown (keep > 0 for a sequence the draft node
 *                      does not hold, or holds fewer tokens of: the decode
 *                      node sends the whole history next time); 2 full (the
 *                      history and k exceed the draft node's context)
 *     8    4 n         drafts, 0..k asked (0 unless status is 0)
 *    12  4*n tokens    u32 ids, each < the vocabulary
 */
#ifndef TANDEM_WIRE_DRAFT_H
#define TANDEM_WIRE_DRAFT_H

#include <stddef.h>
#include <stdint.h>

#include "net/wire.h"

/* Sequences per frame: a decode node's slots (--parallel is at most 64). */
#define WIRE_DRAFT_MAX_SEQ 64u
/* Drafts per sequence and step (engine/spec.h's SPEC_MAX_DRAFT). */
#define WIRE_DRAFT_MAX_K 16u
/* Tokens one DRAFT frame may carry in all: a full restart of 64 sequences
 * of 16384 tokens each; bounds what a peer makes the draft node copy. */
#define WIRE_DRAFT_MAX_TOKENS (64u * 16384u)
#define WIRE_DRAFT_MAX_BYTES (4u + WIRE_DRAFT_MAX_SEQ * 16u + 4u * WIRE_DRAFT_MAX_TOKENS)
#define WIRE_DRAFTS_MAX_BYTES (4u + WIRE_DRAFT_MAX_SEQ * (12u + 4u * WIRE_DRAFT_MAX_K))

enum wire_draft_status { WIRE_DRAFT_OK = 0, WIRE_DRAFT_UNKNOWN = 1, WIRE_DRAFT_FULL = 2 };

typedef struct {
    uint32_t seq, keep, k, n;
    const uint8_t *tokens;      /* n little-endian u32 (points into the payload) */
} wire_draft_ask;

typedef struct {
    uint32_t seq, status, n;
    const uint8_t *tokens;
} wire_draft_reply;

/* Builders: begin writes n_seq, each add appends an entry (the caller keeps
 * the count it announced). 0, or -1 on out-of-memory or a bound. */
int wire_draft_begin(wire_buf *b, uint32_t n_seq);
int wire_draft_add_ask(wire_buf *b, uint32_t seq, uint32_t keep, uint32_t k, uint32_t n, const int32_t *tokens);
int wire_draft_add_reply(wire_buf *b, uint32_t seq, uint32_t status, uint32_t n, const int32_t *tokens);

/* Decoders: every count, bound, token id (< n_vocab) and the exact length
 * checked; out has room for WIRE_DRAFT_MAX_SEQ entries. 0 or -1 with a
 * message. */
int wire_draft_decode_ask(const uint8_t *p, size_t n, uint32_t n_vocab, wire_draft_ask *out, uint32_t *n_seq,
                          char *err, size_t errlen);
int wire_draft_decode_reply(const uint8_t *p, size_t n, uint32_t n_vocab, wire_draft_reply *out, uint32_t *n_seq,
                            char *err, size_t errlen);
uint32_t wire_draft_token(const uint8_t *tokens, uint32_t i);

#endif

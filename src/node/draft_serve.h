/* draft_serve.h - the draft node's side of --draft-node (issue 42): a
 * prefill node started with --draft-model FILE answers DRAFT frames
 * (net/wire_draft.h) from decode nodes with drafts of its draft model.
 *
 * It keeps one history per (connection, sequence id), in a fixed number of
 * slots (--draft-slots, default 8), each with the draft model's own KV
 * session (draft.h: the rows it holds are kept as long as they are a prefix
 * of the next question's history, so a rejected draft's row is rolled back
 * and only the tokens accepted since the last exchange are evaluated). A
 * sequence opens with keep = 0; a DRAFT that keeps more than the draft node
 * holds of it (or names a sequence it does not hold) is answered "unknown"
 * and the decode node sends the whole history next time. When every slot is
 * taken, the least recently asked one is given to the newcomer. A slot's
 * history, the drafts' count and every token id are bounded before anything
 * is copied (wire_draft_decode_ask); a malformed DRAFT is answered with
 * ERROR and the connection closes, its sequences dropped.
 *
 * The draft model must share the node's model's vocabulary (checked at
 * start-up, draft.h); the node's HELLO carries its model's fingerprint and
 * the DRAFT capability, so a decode node that completes the handshake knows
 * the drafts are token ids of its own vocabulary.
 *
 * Threading: any connection thread; one answer at a time (a mutex).
 */
#ifndef TANDEM_DRAFT_SERVE_H
#define TANDEM_DRAFT_SERVE_H

#include <stddef.h>
#include <stdint.h>

#include "engine/model.h"
#include "net/wire.h"

typedef struct draft_server draft_server;

/* n_slots sequences at once (1..64), each of at most n_ctx tokens. -1 with
 * a message when the draft model's vocabulary differs or memory is short. */
int draft_server_create(draft_server **out, model *target, model *dm, int n_slots, int n_ctx, uint32_t kv_dtype,
                        char *err, size_t errlen);
void draft_server_free(draft_server *ds);
/* Answers the DRAFT frame in c->rx (header h) with DRAFTS. 0; -1 when the
 * frame was refused (an ERROR was sent: close the connection) or the answer
 * could not be sent; err says why. */
int draft_server_answer(draft_server *ds, unsigned conn_id, wire_conn *c, const wire_header *h, char *err,
                        size_t errlen);
/* The connection closed: its sequences' slots are free. */
void draft_server_conn_gone(draft_server *ds, unsigned conn_id);
/* Exchanges answered, drafts sent (for the log). */
void draft_server_counts(draft_server *ds, uint64_t *exchanges, uint64_t *drafts);

#endif

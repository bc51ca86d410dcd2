/* wire_draft.c - DRAFT and DRAFTS frames (see wire_draft.h,
 * docs/wire-protocol.md 4.10). */
#include "net/wire_draft.h"

#include <stdlib.h>
#include <string.h>

#include "net/wire_internal.h"

/* ==== Bytes ==== */

uint32_t wire_draft_token(const uint8_t *tokens, uint32_t i) { return get_u32(tokens + 4 * (size_t)i); }

static uint8_t *wd_grow(wire_buf *b, size_t add, size_t limit) {
    size_t need = b->len + add;
    if (need > limit) return NULL;
    if (need > b->cap) {
        size_t cap = b->cap ? b->cap : 256;
        while (cap < need) cap *= 2;
        uint8_t *p = realloc(b->data, cap);
        if (!p) return NULL;
        b->data = p;
        b->cap = cap;
    }
    uint8_t *p = b->data + b->len;
    b->len = need;
    return p;
}

/* ==== Builders ==== */

int wire_draft_begin(wire_buf *b, uint32_t n_seq) {
    if (n_seq < 1 || n_seq > WIRE_DRAFT_MAX_SEQ) return -1;
    uint8_t *p = wd_grow(b, 4, WIRE_DRAFT_MAX_BYTES);
    if (!p) return -1;
    put_u32(p, n_seq);
    return 0;
}

static int wd_add(wire_buf *b, const uint32_t *head, int n_head, uint32_t n, const int32_t *tokens, size_t limit) {
    uint8_t *p = wd_grow(b, 4 * (size_t)n_head + 4 * (size_t)n, limit);
    if (!p) return -1;
    for (int i = 0; i < n_head; i++) put_u32(p + 4 * i, head[i]);
    for (uint32_t i = 0; i < n; i++) put_u32(p + 4 * ((size_t)n_head + i), (uint32_t)tokens[i]);
    return 0;
}

int wire_draft_add_ask(wire_buf *b, uint32_t seq, uint32_t keep, uint32_t k, uint32_t n, const int32_t *tokens) {
    if (k < 1 || k > WIRE_DRAFT_MAX_K || n > WIRE_DRAFT_MAX_TOKENS) return -1;
    const uint32_t head[4] = { seq, keep, k, n };
    return wd_add(b, head, 4, n, tokens, WIRE_DRAFT_MAX_BYTES);
}

int wire_draft_add_reply(wire_buf *b, uint32_t seq, uint32_t status, uint32_t n, const int32_t *tokens) {
    if (n > WIRE_DRAFT_MAX_K) return -1;
    const uint32_t head[3] = { seq, status, n };
    return wd_add(b, head, 3, n, tokens, WIRE_DRAFTS_MAX_BYTES);
}

/* ==== Decoders ==== */

/* Checks that n u32 token ids fit in [off, len) and are < n_vocab. */
static int wd_tokens_ok(const uint8_t *p, size_t len, size_t off, uint32_t n, uint32_t n_vocab, const char *what,
                        char *err, size_t errlen) {
    if ((uint64_t)n * 4 > len - off) {
        wire_errf(err, errlen, "%s: %u tokens overrun the payload", what, n);
        return -1;
    }
    for (uint32_t i = 0; i < n; i++) {
        uint32_t t = wire_draft_token(p + off, i);
        if (t >= n_vocab) {
            wire_errf(err, errlen, "%s: token id %u is not below the vocabulary's %u", what, t, n_vocab);
            return -1;
        }
    }
    return 0;
}

static int wd_count(const uint8_t *p, size_t n, const char *what, uint32_t *n_seq, char *err, size_t errlen) {
    if (n < 4) {
        wire_errf(err, errlen, "%s payload of %zu bytes has no sequence count", what, n);
        return -1;
    }
    *n_seq = wire_draft_token(p, 0);
    if (*n_seq < 1 || *n_seq > WIRE_DRAFT_MAX_SEQ) {
        wire_errf(err, errlen, "%s: %u sequences (1..%u)", what, *n_seq, WIRE_DRAFT_MAX_SEQ);
        return -1;
    }
    return 0;
}

/* One entry's fixed part at h (entry s of out): parsed and checked; its
 * token count into *n_tok and where its token pointer goes into *tokens. */
typedef int (*wd_entry_fn)(const uint8_t *h, uint32_t s, void *out, uint32_t *n_tok, const uint8_t ***tokens,
                           char *err, size_t errlen);

/* The walk both decoders share: the payload's size cap, the sequence
 * count, then n_seq entries of a `head`-byte fixed part (entry) and its
 * token ids below n_vocab, and nothing after the last. */
static int wd_decode(const uint8_t *p, size_t n, size_t max, const char *what, size_t head, wd_entry_fn entry,
                     uint32_t n_vocab, void *out, uint32_t *n_seq, char *err, size_t errlen) {
    if (n > max) { wire_errf(err, errlen, "%s payload of %zu bytes is too large", what, n); return -1; }
    if (wd_count(p, n, what, n_seq, err, errlen)) return -1;
    size_t off = 4;
    for (uint32_t s = 0; s < *n_seq; s++) {
        if (n - off < head) { wire_errf(err, errlen, "%s: entry %u is cut short", what, s); return -1; }
        uint32_t n_tok;
        const uint8_t **tokens;
        if (entry(p + off, s, out, &n_tok, &tokens, err, errlen)) return -1;
        off += head;
        if (wd_tokens_ok(p, n, off, n_tok, n_vocab, what, err, errlen)) return -1;
        *tokens = p + off;
        off += 4 * (size_t)n_tok;
    }
    if (off != n) { wire_errf(err, errlen, "%s: %zu bytes after the last entry", what, n - off); return -1; }
    return 0;
}

static int wd_ask_entry(const uint8_t *h, uint32_t s, void *outv, uint32_t *n_tok, const uint8_t ***tokens,
                        char *err, size_t errlen) {
    wire_draft_ask *out = outv, *a = &out[s];
    a->seq = wire_draft_token(h, 0);
    a->keep = wire_draft_token(h, 1);
    a->k = wire_draft_token(h, 2);
    a->n = wire_draft_token(h, 3);
    if (a->k < 1 || a->k > WIRE_DRAFT_MAX_K) {
        wire_errf(err, errlen, "DRAFT: sequence %u asks for %u drafts (1..%u)", a->seq, a->k, WIRE_DRAFT_MAX_K);
        return -1;
    }
    if (a->keep == 0 && a->n == 0) {
        wire_errf(err, errlen, "DRAFT: sequence %u opens with no tokens", a->seq);
        return -1;
    }
    if (a->keep > WIRE_DRAFT_MAX_TOKENS || a->n > WIRE_DRAFT_MAX_TOKENS - a->keep) {
        wire_errf(err, errlen, "DRAFT: sequence %u's history of %u + %u tokens is too long", a->seq, a->keep, a->n);
        return -1;
    }
    for (uint32_t j = 0; j < s; j++)
        if (out[j].seq == a->seq) {
            wire_errf(err, errlen, "DRAFT: sequence %u appears twice", a->seq);
            return -1;
        }
    *n_tok = a->n;
    *tokens = &a->tokens;
    return 0;
}

int wire_draft_decode_ask(const uint8_t *p, size_t n, uint32_t n_vocab, wire_draft_ask *out, uint32_t *n_seq,
                          char *err, size_t errlen) {
    return wd_decode(p, n, WIRE_DRAFT_MAX_BYTES, "DRAFT", 16, wd_ask_entry, n_vocab, out, n_seq, err, errlen);
}

static int wd_reply_entry(const uint8_t *h, uint32_t s, void *outv, uint32_t *n_tok, const uint8_t ***tokens,
                          char *err, size_t errlen) {
    wire_draft_reply *r = &((wire_draft_reply *)outv)[s];
    r->seq = wire_draft_token(h, 0);
    r->status = wire_draft_token(h, 1);
    r->n = wire_draft_token(h, 2);
    if (r->status > WIRE_DRAFT_FULL || r->n > WIRE_DRAFT_MAX_K || (r->status && r->n)) {
        wire_errf(err, errlen, "DRAFTS: sequence %u has status %u and %u drafts", r->seq, r->status, r->n);
        return -1;
    }
    *n_tok = r->n;
    *tokens = &r->tokens;
    return 0;
}

int wire_draft_decode_reply(const uint8_t *p, size_t n, uint32_t n_vocab, wire_draft_reply *out, uint32_t *n_seq,
                            char *err, size_t errlen) {
    return wd_decode(p, n, WIRE_DRAFTS_MAX_BYTES, "DRAFTS", 12, wd_reply_entry, n_vocab, out, n_seq, err, errlen);
}

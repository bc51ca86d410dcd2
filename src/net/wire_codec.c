/* wire_codec.c - the wire protocol's payload codecs (docs/wire-protocol.md
 * section 4): HELLO, AUTH, REQUEST, KV, DONE and ERROR encoded into a
 * wire_buf and decoded with every length and field checked. */

#include "net/wire.h"

#include <errno.h>
#include <math.h>
#include <string.h>

#include "engine/gguf.h"

#include "net/wire_internal.h"

/* ==== Payloads ==== */

/* Copy a C string into a fixed NUL-padded field of `size` bytes (truncating). */
static void put_fixed_str(uint8_t *p, size_t size, const char *s) {
    size_t n = s ? strnlen(s, size - 1) : 0;
    memset(p, 0, size);
    if (n) memcpy(p, s, n);
}

/* Read a fixed NUL-padded field: must contain a NUL, no control characters
 * before it, and only zero bytes after it (one canonical encoding). */
static int get_fixed_str(const uint8_t *p, size_t size, char *out, const char *what,
                         char *err, size_t errlen) {
    const uint8_t *nul = memchr(p, 0, size);
    if (!nul) {
        wire_errf(err, errlen, "%s is not NUL-terminated within %zu bytes", what, size);
        return -1;
    }
    size_t n = (size_t)(nul - p);
    for (size_t i = 0; i < n; i++)
        if (p[i] < 0x20 || p[i] == 0x7F) {
            wire_errf(err, errlen, "%s contains control character 0x%02x", what, p[i]);
            return -1;
        }
    for (size_t i = n; i < size; i++)
        if (p[i]) {
            wire_errf(err, errlen, "%s has non-zero padding", what);
            return -1;
        }
    memcpy(out, p, n + 1);
    return 0;
}

static int wire_len_exact(const char *what, size_t n, size_t want, char *err, size_t errlen) {
    if (n == want) return 0;
    wire_errf(err, errlen, "%s payload is %zu bytes, expected %zu", what, n, want);
    return -1;
}

int wire_len_min(const char *what, size_t n, size_t head, char *err, size_t errlen) {
    if (n >= head) return 0;
    wire_errf(err, errlen, "%s payload is %zu bytes, shorter than its %zu-byte head", what, n, head);
    return -1;
}

/* The dtypes a KV frame may carry, and their block size in bytes. */
static uint32_t wire_dtype_block_bytes(uint32_t dtype) {
    switch (dtype) {
    case GGML_TYPE_F16: return 2;
    case GGML_TYPE_BF16: return 2;
    case GGML_TYPE_Q8_0: return 34;   /* 32 int8 + one f16 scale */
    default: return 0;
    }
}

/* HELLO: role u32 | caps u32 | nonce[32] | fingerprint[32] | kv_dtype u32 |
 * node_id[64] | model_desc[256]  = 396 bytes. */
int wire_encode_hello(wire_buf *b, const wire_hello *h) {
    uint8_t *p = wire_buf_grow(b, WIRE_HELLO_BYTES);
    if (!p) return -1;
    put_u32(p + 0, h->role);
    put_u32(p + 4, h->caps);
    memcpy(p + 8, h->nonce, 32);
    memcpy(p + 40, h->fingerprint, 32);
    put_u32(p + 72, h->kv_dtype);
    put_fixed_str(p + 76, sizeof h->node_id, h->node_id);
    put_fixed_str(p + 140, sizeof h->model_desc, h->model_desc);
    return 0;
}

int wire_decode_hello(const uint8_t *p, size_t n, wire_hello *h, char *err, size_t errlen) {
    if (wire_len_exact("HELLO", n, WIRE_HELLO_BYTES, err, errlen)) return -1;
    wire_hello x;
    memset(&x, 0, sizeof x);
    x.role = get_u32(p + 0);
    x.caps = get_u32(p + 4);
    memcpy(x.nonce, p + 8, 32);
    memcpy(x.fingerprint, p + 40, 32);
    x.kv_dtype = get_u32(p + 72);
    if (x.role < WIRE_ROLE_PREFILL || x.role > WIRE_ROLE_ROUTER) {
        wire_errf(err, errlen, "HELLO: unknown role %u", x.role);
        return -1;
    }
    /* Unknown capability bits are ignored (a newer peer may offer more). */
    x.caps &= WIRE_CAP_ZSTD | WIRE_CAP_Q8_0 | WIRE_CAP_BF16 | WIRE_CAP_SLICE | WIRE_CAP_DRAFT;
    if (get_fixed_str(p + 76, sizeof x.node_id, x.node_id, "HELLO node_id", err, errlen)) return -1;
    if (get_fixed_str(p + 140, sizeof x.model_desc, x.model_desc, "HELLO model_desc", err, errlen))
        return -1;
    *h = x;
    return 0;
}

/* AUTH: mac[32]. */
int wire_encode_auth(wire_buf *b, const wire_auth *a) {
    uint8_t *p = wire_buf_grow(b, WIRE_AUTH_BYTES);
    if (!p) return -1;
    memcpy(p, a->mac, 32);
    return 0;
}

int wire_decode_auth(const uint8_t *p, size_t n, wire_auth *a, char *err, size_t errlen) {
    if (wire_len_exact("AUTH", n, WIRE_AUTH_BYTES, err, errlen)) return -1;
    memcpy(a->mac, p, 32);
    return 0;
}

/* REQUEST: start_pos u32 | end_pos u32 | wire_dtype u32 | flags u32 |
 * n_tokens u32 | tokens u32[n_tokens]. */
int wire_encode_request(wire_buf *b, const wire_request *r, const int32_t *tokens) {
    if (r->n_tokens > (WIRE_MAX_PAYLOAD - WIRE_REQUEST_FIXED) / 4) return -1;
    for (uint32_t i = 0; i < r->n_tokens; i++)
        if (tokens[i] < 0) return -1;
    uint8_t *p = wire_buf_grow(b, WIRE_REQUEST_FIXED + (size_t)r->n_tokens * 4);
    if (!p) return -1;
    put_u32(p + 0, r->start_pos);
    put_u32(p + 4, r->end_pos);
    put_u32(p + 8, r->wire_dtype);
    put_u32(p + 12, r->flags);
    put_u32(p + 16, r->n_tokens);
    for (uint32_t i = 0; i < r->n_tokens; i++) put_u32(p + 20 + 4 * (size_t)i, (uint32_t)tokens[i]);
    return 0;
}

int wire_decode_request(const uint8_t *p, size_t n, wire_request *r, char *err, size_t errlen) {
    if (wire_len_min("REQUEST", n, WIRE_REQUEST_FIXED, err, errlen)) return -1;
    wire_request x;
    x.start_pos = get_u32(p + 0);
    x.end_pos = get_u32(p + 4);
    x.wire_dtype = get_u32(p + 8);
    x.flags = get_u32(p + 12);
    x.n_tokens = get_u32(p + 16);
    if ((uint64_t)x.n_tokens * 4 != n - WIRE_REQUEST_FIXED) {
        wire_errf(err, errlen, "REQUEST: %u tokens need %llu bytes, payload has %zu", x.n_tokens,
                  (unsigned long long)x.n_tokens * 4 + WIRE_REQUEST_FIXED, n);
        return -1;
    }
    if (x.n_tokens == 0) {
        wire_errf(err, errlen, "REQUEST has no tokens");
        return -1;
    }
    if (x.start_pos > x.end_pos || x.end_pos > x.n_tokens) {
        wire_errf(err, errlen, "REQUEST span [%u, %u) is not inside the %u-token prompt", x.start_pos,
                  x.end_pos, x.n_tokens);
        return -1;
    }
    if (!wire_dtype_block_bytes(x.wire_dtype)) {
        wire_errf(err, errlen, "REQUEST: unsupported wire dtype %u (%s)", x.wire_dtype,
                  gguf_type_name(x.wire_dtype));
        return -1;
    }
    /* bits 1-2: the ACT dtype of a layer-split request (section 4.9; the
     * prefill node accepts them only with the SLICE capability) */
    if (x.flags & ~(uint32_t)7u) {
        wire_errf(err, errlen, "REQUEST: unknown flags 0x%x", x.flags);
        return -1;
    }
    for (uint32_t i = 0; i < x.n_tokens; i++)
        if (get_u32(p + 20 + 4 * (size_t)i) > INT32_MAX) {
            wire_errf(err, errlen, "REQUEST: token %u has id %u, beyond any vocabulary", i,
                      get_u32(p + 20 + 4 * (size_t)i));
            return -1;
        }
    x.tokens = p + WIRE_REQUEST_FIXED;
    *r = x;
    return 0;
}

uint32_t wire_request_token(const wire_request *r, uint32_t i) {
    if (!r->tokens || i >= r->n_tokens) return UINT32_MAX;
    return get_u32(r->tokens + 4 * (size_t)i);
}

/* Internal consistency of a KV head (shared by the encoder and decoder):
 * known dtype, row_bytes a whole number of blocks, n >= 1, range fits u32,
 * and the payload length 20 + 2 * n * row_bytes fits the frame limit. */
static int wire_kv_check(const wire_kv *x, uint64_t *body, char *err, size_t errlen) {
    uint32_t bb = wire_dtype_block_bytes(x->dtype);
    if (!bb) {
        wire_errf(err, errlen, "KV frame: unsupported dtype %u (%s)", x->dtype, gguf_type_name(x->dtype));
        return -1;
    }
    if (x->row_bytes == 0 || x->row_bytes % bb) {
        wire_errf(err, errlen, "KV frame: row_bytes %u is not a whole number of %s blocks", x->row_bytes,
                  gguf_type_name(x->dtype));
        return -1;
    }
    if (x->n == 0) {
        wire_errf(err, errlen, "KV frame carries no tokens");
        return -1;
    }
    if ((uint64_t)x->pos0 + x->n > INT32_MAX) {
        wire_errf(err, errlen, "KV frame: token range [%u, +%u) overflows", x->pos0, x->n);
        return -1;
    }
    uint64_t span = (uint64_t)x->n * x->row_bytes;   /* both < 2^32: no overflow in 64 bits */
    if (span > (WIRE_MAX_PAYLOAD - WIRE_KV_FIXED) / 2) {
        wire_errf(err, errlen, "KV frame: %u rows of %u bytes exceed the frame limit", x->n, x->row_bytes);
        return -1;
    }
    *body = span;
    return 0;
}

/* KV: layer u32 | pos0 u32 | n u32 | dtype u32 | row_bytes u32 |
 * K[n * row_bytes] | V[n * row_bytes]. */
int wire_encode_kv(wire_buf *b, const wire_kv *kv) {
    uint64_t span;
    if (wire_kv_check(kv, &span, NULL, 0)) return -1;
    uint8_t *p = wire_buf_grow(b, WIRE_KV_FIXED + 2 * (size_t)span);
    if (!p) return -1;
    put_u32(p + 0, kv->layer);
    put_u32(p + 4, kv->pos0);
    put_u32(p + 8, kv->n);
    put_u32(p + 12, kv->dtype);
    put_u32(p + 16, kv->row_bytes);
    memcpy(p + WIRE_KV_FIXED, kv->k, (size_t)span);
    memcpy(p + WIRE_KV_FIXED + span, kv->v, (size_t)span);
    return 0;
}

int wire_decode_kv(const uint8_t *p, size_t n, wire_kv *kv, char *err, size_t errlen) {
    if (wire_len_min("KV", n, WIRE_KV_FIXED, err, errlen)) return -1;
    wire_kv x;
    x.layer = get_u32(p + 0);
    x.pos0 = get_u32(p + 4);
    x.n = get_u32(p + 8);
    x.dtype = get_u32(p + 12);
    x.row_bytes = get_u32(p + 16);
    uint64_t span;
    if (wire_kv_check(&x, &span, err, errlen)) return -1;
    if (n - WIRE_KV_FIXED != 2 * span) {
        wire_errf(err, errlen, "KV frame size mismatch: %u rows of %u bytes need %llu bytes of K+V, payload has %zu",
                  x.n, x.row_bytes, (unsigned long long)(2 * span), n - WIRE_KV_FIXED);
        return -1;
    }
    x.k = p + WIRE_KV_FIXED;
    x.v = p + WIRE_KV_FIXED + span;
    *kv = x;
    return 0;
}

/* DONE: n_positions u32 | n_computed u32 | prefill_ms f64 | kv_bytes u64 | wire_bytes u64. */
int wire_encode_done(wire_buf *b, const wire_done *d) {
    uint8_t *p = wire_buf_grow(b, WIRE_DONE_BYTES);
    if (!p) return -1;
    uint64_t ms;
    memcpy(&ms, &d->prefill_ms, 8);
    put_u32(p + 0, d->n_positions);
    put_u32(p + 4, d->n_computed);
    put_u64(p + 8, ms);
    put_u64(p + 16, d->kv_bytes);
    put_u64(p + 24, d->wire_bytes);
    return 0;
}

int wire_decode_done(const uint8_t *p, size_t n, wire_done *d, char *err, size_t errlen) {
    if (wire_len_exact("DONE", n, WIRE_DONE_BYTES, err, errlen)) return -1;
    wire_done x;
    uint64_t ms = get_u64(p + 8);
    x.n_positions = get_u32(p + 0);
    x.n_computed = get_u32(p + 4);
    memcpy(&x.prefill_ms, &ms, 8);
    x.kv_bytes = get_u64(p + 16);
    x.wire_bytes = get_u64(p + 24);
    if (!isfinite(x.prefill_ms) || x.prefill_ms < 0) {
        wire_errf(err, errlen, "DONE: prefill_ms is not a finite non-negative number");
        return -1;
    }
    *d = x;
    return 0;
}

/* ERROR: code u32 | msg_len u32 | msg[msg_len] (UTF-8, no NUL). */
int wire_encode_error(wire_buf *b, const wire_error *e) {
    size_t ml = strnlen(e->message, WIRE_ERROR_MAX_MSG);
    uint8_t *p = wire_buf_grow(b, WIRE_ERROR_FIXED + ml);
    if (!p) return -1;
    put_u32(p + 0, e->code);
    put_u32(p + 4, (uint32_t)ml);
    memcpy(p + 8, e->message, ml);
    return 0;
}

int wire_decode_error(const uint8_t *p, size_t n, wire_error *e, char *err, size_t errlen) {
    if (wire_len_min("ERROR", n, WIRE_ERROR_FIXED, err, errlen)) return -1;
    uint32_t code = get_u32(p), ml = get_u32(p + 4);
    if (ml > WIRE_ERROR_MAX_MSG || ml != n - WIRE_ERROR_FIXED) {
        wire_errf(err, errlen, "ERROR: message length %u does not match the %zu-byte payload (max %u)", ml,
                  n, WIRE_ERROR_MAX_MSG);
        return -1;
    }
    if (code == 0) {
        wire_errf(err, errlen, "ERROR: code 0 is not an error");
        return -1;
    }
    if (memchr(p + 8, 0, ml)) {
        wire_errf(err, errlen, "ERROR: message contains a NUL byte");
        return -1;
    }
    e->code = code;
    /* Control characters become '?': the text ends up in logs and terminals. */
    for (uint32_t i = 0; i < ml; i++) {
        uint8_t ch = p[8 + i];
        e->message[i] = (char)(ch < 0x20 || ch == 0x7F ? '?' : ch);
    }
    e->message[ml] = 0;
    return 0;
}

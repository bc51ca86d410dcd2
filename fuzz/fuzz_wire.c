/* fuzz_wire.c - libFuzzer target for everything that parses bytes from a peer:
 * wire_header_decode (both modes), every wire_decode_* payload decoder (the
 * ACT frame's and the DRAFT/DRAFTS frames' too), and
 * wire_recv's frame path (header checks, CRC32C, the AES-256-GCM seal, zstd
 * decompression) over a socketpair.
 *
 * Input layout: byte 0 selects what to do with the rest.
 *   mode 0: the rest goes to every payload decoder and to wire_header_decode
 *           (before and after the handshake).
 *   mode 1: the rest is a header and a body; the sending end of a sealed
 *           pair frames and seals them with wire_send_raw (type, flags,
 *           raw_len and req_id from the input; CRC and tag made right, so the
 *           fuzzer gets past both) and the other end's wire_recv reads it.
 *   mode 2: like 1, but the body is first zstd-compressed (raw_len kept from
 *           the input, so sometimes a lie), to reach the decompression checks
 *           with real zstd frames behind a valid tag.
 *   mode 3: the rest is fed verbatim to wire_recv of a conn still in its
 *           handshake (what an unauthenticated peer can reach), then of a
 *           sealed one (its tags never verify).
 * Build: make fuzz (or see the Makefile's fuzz rule); run:
 *   build/fuzz_wire -max_total_time=60 -max_len=4096
 */
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <unistd.h>

#include <zstd.h>

#include "net/prefill_rate.h"
#include "net/wire.h"
#include "net/wire_act.h"
#include "net/wire_draft.h"

static void decode_all(const uint8_t *p, size_t n) {
    char err[256];
    wire_hello h;
    wire_auth a;
    wire_request r;
    wire_kv kv;
    wire_done d;
    wire_error e;
    if (wire_decode_hello(p, n, &h, err, sizeof err) == 0) {
        /* Decoded strings must be terminated within their fields. */
        if (strnlen(h.node_id, sizeof h.node_id) == sizeof h.node_id) abort();
        if (strnlen(h.model_desc, sizeof h.model_desc) == sizeof h.model_desc) abort();
        /* The rate a prefill node appends (the router's probe reads it):
         * none, or within its bounds. */
        double tps = prefill_rate_parse(h.model_desc);
        if (tps != -1 && !(tps > 0 && tps < 1e9)) abort();
        /* and its context: none (0), or within its bounds */
        int ctx = prefill_ctx_parse(h.model_desc);
        if (ctx < 0 || ctx > PREFILL_CTX_MAX) abort();
    }
    (void)wire_decode_auth(p, n, &a, err, sizeof err);
    if (wire_decode_request(p, n, &r, err, sizeof err) == 0) {
        uint64_t sum = 0;
        for (uint32_t i = 0; i < r.n_tokens; i++) sum += wire_request_token(&r, i);
        if (r.start_pos > r.end_pos || r.end_pos > r.n_tokens) abort();
        (void)sum;
    }
    if (wire_decode_kv(p, n, &kv, err, sizeof err) == 0) {
        /* K and V must lie inside the payload: touch their last bytes. */
        size_t span = (size_t)kv.n * kv.row_bytes;
        volatile uint8_t x = kv.k[span - 1] ^ kv.v[span - 1];
        (void)x;
        if (kv.v + span != p + n) abort();
    }
    wire_act act;
    if (wire_decode_act(p, n, &act, err, sizeof err) == 0) {
        /* the rows fill the payload exactly; read them all as f32 */
        size_t bytes = (size_t)act.n * act.dim * wire_act_elt_bytes(act.dtype);
        if (act.rows + bytes != p + n || (uint64_t)act.pos0 + act.n > 0x7fffffffu) abort();
        float *f = malloc(sizeof(float) * (size_t)act.n * act.dim);
        if (f) { wire_act_rows_f32(&act, f); free(f); }
    }
    static wire_draft_ask da[WIRE_DRAFT_MAX_SEQ];
    static wire_draft_reply dr[WIRE_DRAFT_MAX_SEQ];
    uint32_t ns = 0;
    if (wire_draft_decode_ask(p, n, 1000, da, &ns, err, sizeof err) == 0)
        for (uint32_t s = 0; s < ns; s++) {
            /* every entry's tokens inside the payload, below the vocabulary */
            if (da[s].k < 1 || da[s].k > WIRE_DRAFT_MAX_K || da[s].tokens + 4 * (size_t)da[s].n > p + n) abort();
            for (uint32_t i = 0; i < da[s].n; i++)
                if (wire_draft_token(da[s].tokens, i) >= 1000) abort();
        }
    if (wire_draft_decode_reply(p, n, 1000, dr, &ns, err, sizeof err) == 0)
        for (uint32_t s = 0; s < ns; s++) {
            if (dr[s].n > WIRE_DRAFT_MAX_K || dr[s].tokens + 4 * (size_t)dr[s].n > p + n) abort();
            for (uint32_t i = 0; i < dr[s].n; i++)
                if (wire_draft_token(dr[s].tokens, i) >= 1000) abort();
        }
    (void)wire_decode_done(p, n, &d, err, sizeof err);
    if (wire_decode_error(p, n, &e, err, sizeof err) == 0 && strnlen(e.message, sizeof e.message) == sizeof e.message)
        abort();
}

/* +1: the literal's terminator, no part of the key (an array of exactly
 * WIRE_KEY_BYTES drops it, which clang 22 and gcc 15 warn about). */
static const uint8_t key_ab[WIRE_KEY_BYTES + 1] = "fuzz-key-a-to-b-0123456789abcdef";
static const uint8_t key_ba[WIRE_KEY_BYTES + 1] = "fuzz-key-b-to-a-0123456789abcdef";

/* Reads up to 4 frames from c and decodes what arrives. */
static void drain(wire_conn *c) {
    wire_header h;
    char err[512];
    for (int i = 0; i < 4 && wire_recv(c, &h, err, sizeof err) == 0; i++) {
        if (c->rx.len != h.raw_len) abort();
        if (!c->sealed && (h.type != WIRE_HELLO && h.type != WIRE_AUTH && h.type != WIRE_ERROR)) abort();
        if (!c->sealed && h.len > WIRE_HELLO_BYTES + 200) abort();   /* pre-auth frames stay small */
        decode_all(c->rx.data, c->rx.len);
    }
}

/* Feed bytes verbatim to wire_recv through a socketpair. */
static void recv_verbatim(const uint8_t *frame, size_t n, int sealed) {
    int sv[2];
    if (socketpair(AF_UNIX, SOCK_STREAM, 0, sv)) return;
    size_t off = 0;
    while (off < n) {   /* inputs are far below the socket buffer: no blocking */
        ssize_t w = write(sv[0], frame + off, n - off);
        if (w <= 0) break;
        off += (size_t)w;
    }
    shutdown(sv[0], SHUT_WR);   /* a short frame ends in EOF, not a wait */
    wire_conn c;
    char err[256];
    wire_conn_init(&c, sv[1], 1000);
    if (sealed) wire_conn_seal(&c, key_ba, key_ab, err, sizeof err);
    drain(&c);
    wire_conn_close(&c);
    close(sv[0]);
}

/* Frame and seal (type, flags, raw_len, req_id from hdr; body as given) on
 * one end of a sealed pair, read on the other. */
static void recv_sealed(const uint8_t *hdr, const uint8_t *body, size_t blen) {
    int sv[2];
    if (socketpair(AF_UNIX, SOCK_STREAM, 0, sv)) return;
    wire_conn a, b;
    char err[256];
    wire_conn_init(&a, sv[0], 1000);
    wire_conn_init(&b, sv[1], 1000);
    wire_conn_seal(&a, key_ab, key_ba, err, sizeof err);
    wire_conn_seal(&b, key_ba, key_ab, err, sizeof err);
    uint16_t type = (uint16_t)(hdr[6] | hdr[7] << 8);
    uint32_t flags = (uint32_t)hdr[8] | (uint32_t)hdr[9] << 8 | (uint32_t)hdr[10] << 16 | (uint32_t)hdr[11] << 24;
    uint32_t raw_len = (uint32_t)hdr[16] | (uint32_t)hdr[17] << 8 | (uint32_t)hdr[18] << 16 | (uint32_t)hdr[19] << 24;
    uint64_t req_id = 0;
    for (int i = 0; i < 8; i++) req_id |= (uint64_t)hdr[24 + i] << (8 * i);
    if (wire_send_raw(&a, type, req_id, flags, raw_len, body, blen, NULL, NULL, err, sizeof err) == 0) {
        shutdown(sv[0], SHUT_WR);
        drain(&b);
    }
    wire_conn_close(&a);
    wire_conn_close(&b);
}

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size) {
    if (size < 1) return 0;
    uint8_t mode = data[0] & 3;
    const uint8_t *p = data + 1;
    size_t n = size - 1;
    if (mode == 0) {
        uint8_t *copy = malloc(n ? n : 1);   /* exact-size block: ASan sees overreads */
        memcpy(copy, p, n);
        decode_all(copy, n);
        for (int sealed = 0; sealed < 2 && n >= WIRE_HEADER_BYTES; sealed++) {
            wire_header h;
            char err[256];
            if (wire_header_decode(copy, sealed, &h, err, sizeof err) == 0) {
                uint8_t back[WIRE_HEADER_BYTES];
                wire_header_encode(&h, back);
                if (memcmp(back, copy, WIRE_HEADER_BYTES)) abort();   /* decode is exact */
                if (!sealed && (h.flags || h.len > WIRE_HELLO_BYTES + 200)) abort();
            }
        }
        free(copy);
        return 0;
    }
    if (n < WIRE_HEADER_BYTES) return 0;
    if (mode == 3) {
        recv_verbatim(p, n, 0);
        recv_verbatim(p, n, 1);
        return 0;
    }
    size_t body = n - WIRE_HEADER_BYTES;
    if (mode == 1) {
        recv_sealed(p, p + WIRE_HEADER_BYTES, body);
        return 0;
    }
    uint8_t hdr[WIRE_HEADER_BYTES];
    memcpy(hdr, p, sizeof hdr);
    hdr[8] |= WIRE_FLAG_ZSTD;
    if (p[16] & 1) {   /* half the time, tell the truth about raw_len */
        hdr[16] = (uint8_t)body; hdr[17] = (uint8_t)(body >> 8);
        hdr[18] = (uint8_t)(body >> 16); hdr[19] = (uint8_t)(body >> 24);
    }
    uint8_t *z = malloc(ZSTD_compressBound(body) + 1);
    size_t zl = ZSTD_compress(z, ZSTD_compressBound(body), p + WIRE_HEADER_BYTES, body, 1);
    if (!ZSTD_isError(zl)) recv_sealed(hdr, z, zl);
    free(z);
    return 0;
}

/* fuzz_wire.c - libFuzzer target for everything that parses bytes from a peer:
 * wire_header_decode, every wire_decode_* payload decoder, and wire_recv's
 * frame path (header checks, CRC32C, zstd decompression) over a socketpair.
 *
 * Input layout: byte 0 selects what to do with the rest.
 *   mode 0: the rest goes to every payload decoder and to wire_header_decode.
 *   mode 1: the rest is a frame; its CRC is patched to be right (so the
 *           fuzzer gets past the checksum) and it is fed to wire_recv.
 *   mode 2: like 1, but the payload is first zstd-compressed and the header
 *           marked compressed (raw_len kept from the input, so sometimes a
 *           lie), to reach the decompression checks with real zstd frames.
 *   mode 3: the rest is a frame fed to wire_recv verbatim.
 * Build: make fuzz (or see the Makefile's fuzz rule); run:
 *   build/fuzz_wire -max_total_time=60 -max_len=4096
 */
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <unistd.h>

#include <zstd.h>

#include "wire.h"

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
    (void)wire_decode_done(p, n, &d, err, sizeof err);
    if (wire_decode_error(p, n, &e, err, sizeof err) == 0 && strnlen(e.message, sizeof e.message) == sizeof e.message)
        abort();
}

/* Feed one frame to wire_recv through a socketpair, then decode its payload. */
static void recv_frame(const uint8_t *frame, size_t n) {
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
    wire_conn_init(&c, sv[1], 1000);
    wire_header h;
    char err[512];
    for (int i = 0; i < 4 && wire_recv(&c, &h, err, sizeof err) == 0; i++) {
        if (c.rx.len != h.raw_len) abort();
        decode_all(c.rx.data, c.rx.len);
    }
    wire_conn_close(&c);
    close(sv[0]);
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
        if (n >= WIRE_HEADER_BYTES) {
            wire_header h;
            char err[256];
            if (wire_header_decode(copy, &h, err, sizeof err) == 0) {
                uint8_t back[WIRE_HEADER_BYTES];
                wire_header_encode(&h, back);
                if (memcmp(back, copy, WIRE_HEADER_BYTES)) abort();   /* decode is exact */
            }
        }
        free(copy);
        return 0;
    }
    if (n < WIRE_HEADER_BYTES) return 0;
    if (mode == 3) {
        recv_frame(p, n);
        return 0;
    }
    size_t body = n - WIRE_HEADER_BYTES;
    uint8_t *frame = malloc(WIRE_HEADER_BYTES + ZSTD_compressBound(body) + 1);
    memcpy(frame, p, WIRE_HEADER_BYTES);
    size_t flen = body;
    if (mode == 2) {
        size_t z = ZSTD_compress(frame + WIRE_HEADER_BYTES, ZSTD_compressBound(body), p + WIRE_HEADER_BYTES, body, 1);
        if (ZSTD_isError(z)) { free(frame); return 0; }
        flen = z;
        frame[8] |= WIRE_FLAG_ZSTD;
        frame[12] = (uint8_t)flen; frame[13] = (uint8_t)(flen >> 8);
        frame[14] = (uint8_t)(flen >> 16); frame[15] = (uint8_t)(flen >> 24);
        if (p[16] & 1) {   /* half the time, tell the truth about raw_len */
            frame[16] = (uint8_t)body; frame[17] = (uint8_t)(body >> 8);
            frame[18] = (uint8_t)(body >> 16); frame[19] = (uint8_t)(body >> 24);
        }
    } else {
        memcpy(frame + WIRE_HEADER_BYTES, p + WIRE_HEADER_BYTES, body);
    }
    uint32_t crc = wire_crc32c(0, frame + WIRE_HEADER_BYTES, flen);
    frame[20] = (uint8_t)crc; frame[21] = (uint8_t)(crc >> 8);
    frame[22] = (uint8_t)(crc >> 16); frame[23] = (uint8_t)(crc >> 24);
    recv_frame(frame, WIRE_HEADER_BYTES + flen);
    free(frame);
    return 0;
}

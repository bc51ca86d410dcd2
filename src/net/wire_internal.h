/* wire_internal.h - what the wire protocol's files share (not part of its
 * interface: wire.h is). Little-endian helpers, the error formatter, the
 * deadline clock, and the wire_ functions one file calls in another:
 *   wire.c            names, CRC32C, HMAC/HKDF, the frame header, buffers,
 *                     framing and the AES-256-GCM seal, send and receive
 *   wire_codec.c      the payload codecs: HELLO, AUTH, REQUEST, KV, DONE, ERROR
 *   wire_tcp.c        listen, accept, connect with deadlines
 *   wire_handshake.c  the authenticated handshake and its key derivation
 */

#ifndef TANDEM_NET_WIRE_INTERNAL_H
#define TANDEM_NET_WIRE_INTERNAL_H

#include "net/wire.h"

/* ==== Little-endian helpers ==== */

static inline void put_u16(uint8_t *p, uint16_t v) { p[0] = (uint8_t)v; p[1] = (uint8_t)(v >> 8); }
static inline void put_u32(uint8_t *p, uint32_t v) {
    for (int i = 0; i < 4; i++) p[i] = (uint8_t)(v >> (8 * i));
}
static inline void put_u64(uint8_t *p, uint64_t v) {
    for (int i = 0; i < 8; i++) p[i] = (uint8_t)(v >> (8 * i));
}
static inline uint16_t get_u16(const uint8_t *p) { return (uint16_t)(p[0] | (p[1] << 8)); }
static inline uint32_t get_u32(const uint8_t *p) {
    return (uint32_t)p[0] | ((uint32_t)p[1] << 8) | ((uint32_t)p[2] << 16) | ((uint32_t)p[3] << 24);
}
static inline uint64_t get_u64(const uint8_t *p) {
    return (uint64_t)get_u32(p) | ((uint64_t)get_u32(p + 4) << 32);
}

/* ==== wire.c ==== */

void wire_errf(char *err, size_t errlen, const char *fmt, ...) __attribute__((format(printf, 3, 4)));
uint8_t *wire_buf_grow(wire_buf *b, size_t n);
int64_t wire_now_ms(void);
int64_t wire_deadline(int timeout_ms);
int wire_poll(int fd, short events, int64_t deadline);
int wire_send_locked(wire_conn *c, uint16_t type, uint64_t req_id, uint32_t flags,
                     const void *payload, size_t len, int64_t deadline, char *err, size_t errlen);

/* ==== wire_codec.c ==== */

/* 0 when a payload of n bytes holds its head of `head` bytes, else -1 with
 * "WHAT payload is N bytes, shorter than its HEAD-byte head". */
int wire_len_min(const char *what, size_t n, size_t head, char *err, size_t errlen);

#endif /* TANDEM_NET_WIRE_INTERNAL_H */

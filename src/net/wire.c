/* wire.c - tandem's node-to-node protocol: framing, checksums, payload
 * codecs, socket I/O with deadlines, the authenticated handshake, and the
 * AES-256-GCM seal on every frame after it.
 * docs/wire-protocol.md is the specification this file implements.
 */
#include "net/wire.h"

#include <errno.h>
#include <fcntl.h>
#include <limits.h>
#include <math.h>
#include <netdb.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <poll.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <sys/uio.h>
#include <time.h>
#include <unistd.h>

#include <openssl/crypto.h>
#include <openssl/evp.h>
#include <openssl/hmac.h>
#include <zstd.h>

#include "engine/gguf.h"
#include "base/platform.h"
#include "net/wire_draft.h"

#if defined(__x86_64__)
#include <nmmintrin.h>
#endif

/* Handshake deadline when the connection has no per-frame timeout: long
 * enough for a loaded machine, short enough that a silent peer is dropped. */
#define WIRE_HANDSHAKE_DEFAULT_MS 10000
/* Payloads smaller than this are never compressed: zstd's frame overhead
 * (~10 bytes) and the CPU time are not worth it. */
#define WIRE_ZSTD_MIN_BYTES 64u
/* zstd level 1: the link, not the ratio, is what we optimise; level 1
 * compresses at several hundred MB/s per core. */
#define WIRE_ZSTD_LEVEL 1
/* Deadline for a best-effort ERROR frame (wire_send_error). */
#define WIRE_ERROR_SEND_MS 1000
/* First allocation step when reading a payload (see wire_read_payload). */
#define WIRE_GROW_STEP (1u << 20)

static void wire_errf(char *err, size_t errlen, const char *fmt, ...)
    __attribute__((format(printf, 3, 4)));

static void wire_errf(char *err, size_t errlen, const char *fmt, ...) {
    if (!err || !errlen) return;
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(err, errlen, fmt, ap);
    va_end(ap);
}

/* ==== Little-endian helpers ==== */

static void put_u16(uint8_t *p, uint16_t v) { p[0] = (uint8_t)v; p[1] = (uint8_t)(v >> 8); }
static void put_u32(uint8_t *p, uint32_t v) {
    for (int i = 0; i < 4; i++) p[i] = (uint8_t)(v >> (8 * i));
}
static void put_u64(uint8_t *p, uint64_t v) {
    for (int i = 0; i < 8; i++) p[i] = (uint8_t)(v >> (8 * i));
}
static uint16_t get_u16(const uint8_t *p) { return (uint16_t)(p[0] | (p[1] << 8)); }
static uint32_t get_u32(const uint8_t *p) {
    return (uint32_t)p[0] | ((uint32_t)p[1] << 8) | ((uint32_t)p[2] << 16) | ((uint32_t)p[3] << 24);
}
static uint64_t get_u64(const uint8_t *p) {
    return (uint64_t)get_u32(p) | ((uint64_t)get_u32(p + 4) << 32);
}

/* ==== Names ==== */

const char *wire_type_name(uint32_t type) {
    static const char *const names[] = {
        "unknown", "HELLO", "AUTH", "REQUEST", "KV", "DONE", "ERROR", "CANCEL", "PING", "PONG", "ACT", "DRAFT", "DRAFTS",
    };
    return type < sizeof names / sizeof names[0] ? names[type] : "unknown";
}

const char *wire_err_name(uint32_t code) {
    static const char *const names[] = {
        "unknown", "protocol", "auth", "model", "checksum", "range",
        "dtype", "busy", "internal", "cancelled", "timeout",
    };
    return code < sizeof names / sizeof names[0] ? names[code] : "unknown";
}

const char *wire_role_name(uint32_t role) {
    switch (role) {
    case WIRE_ROLE_PREFILL: return "prefill";
    case WIRE_ROLE_DECODE: return "decode";
    case WIRE_ROLE_ROUTER: return "router";
    default: return "unknown";
    }
}

uint32_t wire_type_max_payload(uint32_t type) {
    switch (type) {
    case WIRE_HELLO: return WIRE_HELLO_BYTES;
    case WIRE_AUTH: return WIRE_AUTH_BYTES;
    case WIRE_REQUEST: return WIRE_MAX_PAYLOAD;
    case WIRE_KV: return WIRE_MAX_PAYLOAD;
    case WIRE_DONE: return WIRE_DONE_BYTES;
    case WIRE_ERROR: return WIRE_ERROR_FIXED + WIRE_ERROR_MAX_MSG;
    case WIRE_CANCEL: return 0;
    case WIRE_PING: case WIRE_PONG: return WIRE_PING_MAX;
    case WIRE_ACT: return WIRE_MAX_PAYLOAD;
    case WIRE_DRAFT: return WIRE_DRAFT_MAX_BYTES;
    case WIRE_DRAFTS: return WIRE_DRAFTS_MAX_BYTES;
    default: return 0;
    }
}

static int wire_type_known(uint32_t type) { return type >= WIRE_HELLO && type <= WIRE_DRAFTS; }

/* ==== CRC32C ==== */
/* Castagnoli polynomial, bit-reflected (the form iSCSI, ext4 and SSE4.2 use). */
#define CRC32C_POLY 0x82F63B78u

static uint32_t crc_table[8][256];
static pthread_once_t crc_once = PTHREAD_ONCE_INIT;

static void crc_table_init(void) {
    for (uint32_t i = 0; i < 256; i++) {
        uint32_t c = i;
        for (int k = 0; k < 8; k++) c = (c >> 1) ^ (CRC32C_POLY & (0u - (c & 1u)));
        crc_table[0][i] = c;
    }
    /* Slicing-by-8: table[k][i] is the CRC of byte i followed by k zero bytes. */
    for (int k = 1; k < 8; k++)
        for (int i = 0; i < 256; i++)
            crc_table[k][i] = (crc_table[k - 1][i] >> 8) ^ crc_table[0][crc_table[k - 1][i] & 0xFF];
}

/* Portable slicing-by-8 version; also the reference the hardware path is tested against. */
uint32_t wire_crc32c_sw(uint32_t crc, const void *data, size_t n) {
    pthread_once(&crc_once, crc_table_init);
    const uint8_t *p = data;
    uint32_t c = ~crc;
    while (n && ((uintptr_t)p & 7)) { c = (c >> 8) ^ crc_table[0][(c ^ *p++) & 0xFF]; n--; }
    while (n >= 8) {
        uint32_t lo = c ^ get_u32(p), hi = get_u32(p + 4);
        c = crc_table[7][lo & 0xFF] ^ crc_table[6][(lo >> 8) & 0xFF] ^
            crc_table[5][(lo >> 16) & 0xFF] ^ crc_table[4][lo >> 24] ^
            crc_table[3][hi & 0xFF] ^ crc_table[2][(hi >> 8) & 0xFF] ^
            crc_table[1][(hi >> 16) & 0xFF] ^ crc_table[0][hi >> 24];
        p += 8;
        n -= 8;
    }
    while (n--) c = (c >> 8) ^ crc_table[0][(c ^ *p++) & 0xFF];
    return ~c;
}

#if defined(__x86_64__)
/* The SSE4.2 crc32 instruction computes CRC32C; compiled for SSE4.2 here
 * alone and called only when cpuid says the CPU has it, so the build can
 * target baseline x86-64. "crc32" too: clang 22 (zig 0.17's, which the
 * macOS check uses) no longer lets sse4.2 imply it and refuses the
 * intrinsics without it; gcc 12 and clang 14 accept the name and emit the
 * same code. */
__attribute__((target("sse4.2,crc32")))
static uint32_t wire_crc32c_hw(uint32_t crc, const uint8_t *p, size_t n) {
    uint64_t c = (uint32_t)~crc;
    while (n && ((uintptr_t)p & 7)) { c = _mm_crc32_u8((uint32_t)c, *p++); n--; }
    while (n >= 8) {
        uint64_t w;
        memcpy(&w, p, 8);
        c = _mm_crc32_u64(c, w);
        p += 8;
        n -= 8;
    }
    while (n--) c = _mm_crc32_u8((uint32_t)c, *p++);
    return ~(uint32_t)c;
}
#endif

uint32_t wire_crc32c(uint32_t crc, const void *data, size_t n) {
#if defined(__x86_64__)
    if (__builtin_cpu_supports("sse4.2")) return wire_crc32c_hw(crc, data, n);
#endif
    return wire_crc32c_sw(crc, data, n);
}

/* ==== HMAC and randomness ==== */

void wire_hmac_sha256(const void *key, size_t key_len, const void *msg, size_t msg_len, uint8_t out[32]) {
    static const uint8_t empty[1];
    unsigned int olen = 32;
    /* A NULL key means "reuse the previous key" in some OpenSSL paths: never pass it. */
    uint8_t hk[32];
    if (!key || !key_len) { key = empty; key_len = 0; }
    if (!msg) { msg = empty; msg_len = 0; }
    /* HMAC replaces a key longer than the hash block by its hash (RFC 2104),
     * so doing that ourselves is exact and keeps the length within int. */
    if (key_len > INT_MAX) {
        unsigned int hl = 32;
        if (EVP_Digest(key, key_len, hk, &hl, EVP_sha256(), NULL) != 1) goto fail;
        key = hk;
        key_len = 32;
    }
    if (HMAC(EVP_sha256(), key, (int)key_len, msg, msg_len, out, &olen)) {
        OPENSSL_cleanse(hk, sizeof hk);
        return;
    }
fail:
    /* Fail closed: random output never matches the peer's MAC. */
    if (wire_random(out, 32)) memset(out, 0xA5, 32);
    OPENSSL_cleanse(hk, sizeof hk);
}

int wire_random(uint8_t *out, size_t n) { return plat_random(out, n, 0); }

/* HKDF (RFC 5869) over HMAC-SHA256: PRK = HMAC(salt, IKM), then
 * T(i) = HMAC(PRK, T(i-1) || info || i) until out_len bytes. */
int wire_hkdf_sha256(const void *salt, size_t salt_len, const void *ikm, size_t ikm_len, const void *info,
                     size_t info_len, uint8_t *out, size_t out_len) {
    if (out_len > 255 * 32 || info_len > 1024) return -1;
    uint8_t prk[32], t[32], msg[32 + 1024 + 1];
    static const uint8_t zeros[32];
    if (!salt || !salt_len) { salt = zeros; salt_len = sizeof zeros; }   /* RFC 5869: HashLen zeros */
    wire_hmac_sha256(salt, salt_len, ikm, ikm_len, prk);
    size_t done = 0, tl = 0;
    for (uint8_t i = 1; done < out_len; i++) {
        memcpy(msg, t, tl);
        if (info_len) memcpy(msg + tl, info, info_len);
        msg[tl + info_len] = i;
        wire_hmac_sha256(prk, sizeof prk, msg, tl + info_len + 1, t);
        tl = sizeof t;
        size_t n = out_len - done < sizeof t ? out_len - done : sizeof t;
        memcpy(out + done, t, n);
        done += n;
    }
    OPENSSL_cleanse(prk, sizeof prk);
    OPENSSL_cleanse(t, sizeof t);
    OPENSSL_cleanse(msg, sizeof msg);
    return 0;
}

/* ==== Header ==== */

void wire_header_encode(const wire_header *h, uint8_t out[WIRE_HEADER_BYTES]) {
    put_u32(out + 0, WIRE_MAGIC);
    put_u16(out + 4, h->version);
    put_u16(out + 6, h->type);
    put_u32(out + 8, h->flags);
    put_u32(out + 12, h->len);
    put_u32(out + 16, h->raw_len);
    put_u32(out + 20, h->crc);
    put_u64(out + 24, h->req_id);
}

/* Before the handshake completes: only the handshake's own frames, small,
 * uncompressed and connection-level, so an unauthenticated peer can make us
 * neither allocate more than a HELLO nor decompress anything. */
static int wire_header_check_plain(const wire_header *x, const char *tn, char *err, size_t errlen) {
    if (x->type != WIRE_HELLO && x->type != WIRE_AUTH && x->type != WIRE_ERROR) {
        wire_errf(err, errlen, "%s frame before the handshake completed (only HELLO, AUTH and ERROR)", tn);
        return -1;
    }
    if (x->flags) {
        wire_errf(err, errlen, "%s frame: compression is not allowed before the handshake completed", tn);
        return -1;
    }
    if (x->req_id) {
        wire_errf(err, errlen, "%s frame: req_id must be 0 during the handshake", tn);
        return -1;
    }
    uint32_t max = wire_type_max_payload(x->type);
    if (x->len > max || x->raw_len != x->len) {
        wire_errf(err, errlen, "%s frame too large or inconsistent during the handshake: len %u, raw_len %u, limit %u",
                  tn, x->len, x->raw_len, max);
        return -1;
    }
    return 0;
}

/* After it: every payload is sealed (len includes the tag); HELLO and AUTH
 * belong to the handshake only. */
static int wire_header_check_sealed(const wire_header *x, const char *tn, char *err, size_t errlen) {
    if (x->type == WIRE_HELLO || x->type == WIRE_AUTH) {
        wire_errf(err, errlen, "%s frame after the handshake", tn);
        return -1;
    }
    uint32_t max = wire_type_max_payload(x->type);
    if (x->len < WIRE_TAG_BYTES || x->len - WIRE_TAG_BYTES > max || x->raw_len > max) {
        wire_errf(err, errlen, "%s frame too large: %u bytes (%u raw), limit %u + %u-byte tag", tn, x->len,
                  x->raw_len, max, WIRE_TAG_BYTES);
        return -1;
    }
    uint32_t body = x->len - WIRE_TAG_BYTES;
    if (x->flags & WIRE_FLAG_ZSTD) {
        if (body == 0 || x->raw_len == 0) {
            wire_errf(err, errlen, "%s frame: compressed payload cannot be empty", tn);
            return -1;
        }
    } else if (x->raw_len != body) {
        wire_errf(err, errlen, "%s frame: raw_len %u != len %u - %u in an uncompressed frame", tn, x->raw_len,
                  x->len, WIRE_TAG_BYTES);
        return -1;
    }
    return 0;
}

int wire_header_decode(const uint8_t in[WIRE_HEADER_BYTES], int sealed, wire_header *h, char *err, size_t errlen) {
    uint32_t magic = get_u32(in);
    if (magic != WIRE_MAGIC) {
        wire_errf(err, errlen, "bad frame magic 0x%08x (not a tandem peer?)", magic);
        return -1;
    }
    wire_header x;
    x.version = get_u16(in + 4);
    x.type = get_u16(in + 6);
    x.flags = get_u32(in + 8);
    x.len = get_u32(in + 12);
    x.raw_len = get_u32(in + 16);
    x.crc = get_u32(in + 20);
    x.req_id = get_u64(in + 24);
    if (x.version != WIRE_VERSION) {
        wire_errf(err, errlen, "protocol version mismatch: peer speaks version %u, this node speaks %u",
                  x.version, WIRE_VERSION);
        return -1;
    }
    if (!wire_type_known(x.type)) {
        wire_errf(err, errlen, "unknown frame type %u", x.type);
        return -1;
    }
    const char *tn = wire_type_name(x.type);
    if (x.flags & ~(uint32_t)WIRE_FLAG_ZSTD) {
        wire_errf(err, errlen, "%s frame has unknown flags 0x%x", tn, x.flags);
        return -1;
    }
    if (sealed ? wire_header_check_sealed(&x, tn, err, errlen) : wire_header_check_plain(&x, tn, err, errlen))
        return -1;
    *h = x;
    return 0;
}

/* ==== Buffers ==== */

void wire_buf_free(wire_buf *b) {
    free(b->data);
    b->data = NULL;
    b->len = b->cap = 0;
}

void wire_buf_reset(wire_buf *b) { b->len = 0; }

/* Make room for `extra` more bytes; -1 on overflow or out-of-memory. */
static int wire_buf_reserve(wire_buf *b, size_t extra) {
    if (extra > SIZE_MAX - b->len) return -1;
    size_t need = b->len + extra;
    if (need <= b->cap) return 0;
    size_t cap = b->cap ? b->cap : 256;
    while (cap < need) cap = cap > SIZE_MAX / 2 ? need : cap * 2;
    uint8_t *d = realloc(b->data, cap);
    if (!d) return -1;
    b->data = d;
    b->cap = cap;
    return 0;
}

/* Ensure capacity for exactly n bytes from the start (contents not kept). */
static int wire_buf_size(wire_buf *b, size_t n) {
    b->len = 0;
    if (wire_buf_reserve(b, n ? n : 1)) return -1;
    b->len = n;
    return 0;
}

static uint8_t *wire_buf_grow(wire_buf *b, size_t n) {
    if (wire_buf_reserve(b, n)) return NULL;
    uint8_t *p = b->data + b->len;
    b->len += n;
    return p;
}

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
    if (n < WIRE_REQUEST_FIXED) {
        wire_errf(err, errlen, "REQUEST payload is %zu bytes, shorter than its %u-byte head", n,
                  WIRE_REQUEST_FIXED);
        return -1;
    }
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
    if (n < WIRE_KV_FIXED) {
        wire_errf(err, errlen, "KV payload is %zu bytes, shorter than its %u-byte head", n, WIRE_KV_FIXED);
        return -1;
    }
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
    if (n < WIRE_ERROR_FIXED) {
        wire_errf(err, errlen, "ERROR payload is %zu bytes, shorter than its %u-byte head", n,
                  WIRE_ERROR_FIXED);
        return -1;
    }
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

/* ==== Connection ==== */

static int64_t wire_now_ms(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (int64_t)ts.tv_sec * 1000 + ts.tv_nsec / 1000000;
}

/* Absolute deadline for an operation allowed to take timeout_ms (<= 0: none). */
static int64_t wire_deadline(int timeout_ms) { return timeout_ms > 0 ? wire_now_ms() + timeout_ms : -1; }

/* Wait for fd readiness until the deadline. 1 ready, 0 timed out, -1 error. */
static int wire_poll(int fd, short events, int64_t deadline) {
    for (;;) {
        int wait = -1;
        if (deadline >= 0) {
            int64_t left = deadline - wire_now_ms();
            if (left <= 0) return 0;
            wait = left > INT32_MAX ? INT32_MAX : (int)left;
        }
        struct pollfd pf = { .fd = fd, .events = events };
        int r = poll(&pf, 1, wait);
        if (r > 0) return 1;
        if (r == 0) {
            if (deadline >= 0) continue;   /* recheck the clock */
            continue;
        }
        if (errno != EINTR) return -1;
    }
}

void wire_conn_init(wire_conn *c, int fd, int timeout_ms) {
    memset(c, 0, sizeof *c);
    c->fd = fd;
    c->timeout_ms = timeout_ms;
    pthread_mutex_init(&c->send_lock, NULL);
    c->live = 1;
    int one = 1;
    /* Fails harmlessly on non-TCP sockets (socketpair in tests). */
    if (fd >= 0) (void)setsockopt(fd, IPPROTO_TCP, TCP_NODELAY, &one, sizeof one);
}

void wire_conn_close(wire_conn *c) {
    if (!c->live) return;
    if (c->fd >= 0) close(c->fd);
    c->fd = -1;
    EVP_CIPHER_CTX_free(c->tx_aead);   /* frees (and wipes) the key schedules */
    EVP_CIPHER_CTX_free(c->rx_aead);
    c->tx_aead = c->rx_aead = NULL;
    c->sealed = 0;
    wire_buf_free(&c->rx);
    wire_buf_free(&c->tx);
    wire_buf_free(&c->ztx);
    wire_buf_free(&c->zrx);
    ZSTD_freeCCtx(c->zc);
    ZSTD_freeDCtx(c->zd);
    c->zc = c->zd = NULL;
    pthread_mutex_destroy(&c->send_lock);
    c->live = 0;
}

void wire_conn_shutdown(wire_conn *c) {
    if (c->fd >= 0) shutdown(c->fd, SHUT_RDWR);
}

/* ==== Seal ====
 * AES-256-GCM per frame: key = the direction's session key, nonce = 4 zero
 * bytes || the frame's u64 sequence number (little-endian), associated data =
 * the 32-byte header with its crc field zeroed, tag appended to the payload.
 * The sequence numbers are implicit (both ends count), so a replayed,
 * reordered, dropped or forged frame fails the tag. */

static EVP_CIPHER_CTX *wire_aead_new(const uint8_t key[WIRE_KEY_BYTES], int enc) {
    EVP_CIPHER_CTX *x = EVP_CIPHER_CTX_new();
    if (!x) return NULL;
    if (EVP_CipherInit_ex(x, EVP_aes_256_gcm(), NULL, key, NULL, enc) != 1) {
        EVP_CIPHER_CTX_free(x);
        return NULL;
    }
    return x;
}

int wire_conn_seal(wire_conn *c, const uint8_t tx_key[WIRE_KEY_BYTES], const uint8_t rx_key[WIRE_KEY_BYTES],
                   char *err, size_t errlen) {
    EVP_CIPHER_CTX *t = wire_aead_new(tx_key, 1), *r = wire_aead_new(rx_key, 0);
    if (!t || !r) {
        EVP_CIPHER_CTX_free(t);
        EVP_CIPHER_CTX_free(r);
        wire_errf(err, errlen, "cannot set up AES-256-GCM (OpenSSL)");
        return -1;
    }
    pthread_mutex_lock(&c->send_lock);
    EVP_CIPHER_CTX_free(c->tx_aead);
    EVP_CIPHER_CTX_free(c->rx_aead);
    c->tx_aead = t;
    c->rx_aead = r;
    c->tx_seq = c->rx_seq = 0;
    c->sealed = 1;
    pthread_mutex_unlock(&c->send_lock);
    return 0;
}

static void wire_nonce(uint64_t seq, uint8_t iv[12]) {
    memset(iv, 0, 4);
    put_u64(iv + 4, seq);
}

/* Header bytes as associated data: the crc field (which covers the sealed
 * bytes, so it cannot be inside the seal) is zeroed. */
static void wire_aad(const uint8_t hb[WIRE_HEADER_BYTES], uint8_t aad[WIRE_HEADER_BYTES]) {
    memcpy(aad, hb, WIRE_HEADER_BYTES);
    memset(aad + 20, 0, 4);
}

/* Encrypts n bytes of in into out (may be the same) and writes the tag after them. */
static int wire_seal(wire_conn *c, const uint8_t hb[WIRE_HEADER_BYTES], const uint8_t *in, size_t n, uint8_t *out) {
    EVP_CIPHER_CTX *x = c->tx_aead;
    uint8_t iv[12], aad[WIRE_HEADER_BYTES];
    int ol = 0, fl = 0;
    if (c->tx_seq == UINT64_MAX || n > INT_MAX) return -1;   /* never reached: 2^64 frames, 64 MiB cap */
    wire_nonce(c->tx_seq, iv);
    wire_aad(hb, aad);
    if (EVP_EncryptInit_ex(x, NULL, NULL, NULL, iv) != 1 ||
        EVP_EncryptUpdate(x, NULL, &ol, aad, sizeof aad) != 1 ||
        (n && EVP_EncryptUpdate(x, out, &ol, in, (int)n) != 1) ||
        EVP_EncryptFinal_ex(x, out + (n ? ol : 0), &fl) != 1 ||
        EVP_CIPHER_CTX_ctrl(x, EVP_CTRL_GCM_GET_TAG, WIRE_TAG_BYTES, out + n) != 1)
        return -1;
    c->tx_seq++;
    return 0;
}

/* Decrypts the n-byte body of p in place and checks the tag that follows it. */
static int wire_open(wire_conn *c, const uint8_t hb[WIRE_HEADER_BYTES], uint8_t *p, size_t n) {
    EVP_CIPHER_CTX *x = c->rx_aead;
    uint8_t iv[12], aad[WIRE_HEADER_BYTES];
    int ol = 0, fl = 0;
    if (c->rx_seq == UINT64_MAX || n > INT_MAX) return -1;
    wire_nonce(c->rx_seq, iv);
    wire_aad(hb, aad);
    if (EVP_DecryptInit_ex(x, NULL, NULL, NULL, iv) != 1 ||
        EVP_DecryptUpdate(x, NULL, &ol, aad, sizeof aad) != 1 ||
        (n && EVP_DecryptUpdate(x, p, &ol, p, (int)n) != 1) ||
        EVP_CIPHER_CTX_ctrl(x, EVP_CTRL_GCM_SET_TAG, WIRE_TAG_BYTES, p + n) != 1 ||
        EVP_DecryptFinal_ex(x, p + (n ? ol : 0), &fl) != 1)
        return -1;
    c->rx_seq++;
    return 0;
}

/* Write all iovecs (modified in place) before the deadline. */
static int wire_write_all(wire_conn *c, struct iovec *iov, int iovcnt, int64_t deadline,
                          const char *tn, char *err, size_t errlen) {
    while (iovcnt > 0) {
        struct msghdr mh = { .msg_iov = iov, .msg_iovlen = (size_t)iovcnt };
        ssize_t w = sendmsg(c->fd, &mh, PLAT_MSG_NOSIGNAL | MSG_DONTWAIT);
        if (w < 0) {
            if (errno == EINTR) continue;
            if (errno == EAGAIN || errno == EWOULDBLOCK) {
                int r = wire_poll(c->fd, POLLOUT, deadline);
                if (r == 0) {
                    wire_errf(err, errlen, "timed out after %d ms sending a %s frame", c->timeout_ms, tn);
                    return -1;
                }
                if (r < 0) {
                    wire_errf(err, errlen, "poll failed sending a %s frame: %s", tn, strerror(errno));
                    return -1;
                }
                continue;
            }
            if (errno == EPIPE || errno == ECONNRESET)
                wire_errf(err, errlen, "connection closed by peer while sending a %s frame", tn);
            else
                wire_errf(err, errlen, "send of a %s frame failed: %s", tn, strerror(errno));
            return -1;
        }
        c->bytes_out += (uint64_t)w;
        size_t left = (size_t)w;
        while (iovcnt > 0 && left >= iov->iov_len) {
            left -= iov->iov_len;
            iov++;
            iovcnt--;
        }
        if (iovcnt > 0) {
            iov->iov_base = (uint8_t *)iov->iov_base + left;
            iov->iov_len -= left;
        }
    }
    return 0;
}

/* Compress payload into c->ztx if that makes it smaller. Returns the
 * compressed length, or 0 to send it raw. */
static size_t wire_compress(wire_conn *c, const void *payload, size_t len) {
    if (len < WIRE_ZSTD_MIN_BYTES) return 0;
    if (!c->zc && !(c->zc = ZSTD_createCCtx())) return 0;
    size_t bound = ZSTD_compressBound(len);
    if (wire_buf_size(&c->ztx, bound)) return 0;
    size_t z = ZSTD_compressCCtx(c->zc, c->ztx.data, bound, payload, len, WIRE_ZSTD_LEVEL);
    if (ZSTD_isError(z) || z >= len) return 0;
    return z;
}

/* Builds the frame (header, body, tag if sealed) in c->tx. Locked. */
static int wire_frame_build(wire_conn *c, uint16_t type, uint64_t req_id, uint32_t flags, uint32_t raw_len,
                            const void *body, size_t blen, char *err, size_t errlen) {
    size_t tag = c->sealed ? WIRE_TAG_BYTES : 0;
    if (blen > WIRE_MAX_PAYLOAD || wire_buf_size(&c->tx, WIRE_HEADER_BYTES + blen + tag)) {
        wire_errf(err, errlen, "out of memory for a %zu-byte %s frame", blen, wire_type_name(type));
        return -1;
    }
    uint8_t *hb = c->tx.data, *pl = hb + WIRE_HEADER_BYTES;
    wire_header h = { .version = WIRE_VERSION, .type = type, .flags = flags, .len = (uint32_t)(blen + tag),
                      .raw_len = raw_len, .crc = 0, .req_id = req_id };
    wire_header_encode(&h, hb);
    if (!c->sealed) {
        if (blen) memcpy(pl, body, blen);
    } else if (wire_seal(c, hb, body, blen, pl)) {
        wire_errf(err, errlen, "sealing a %s frame failed (OpenSSL)", wire_type_name(type));
        return -1;
    }
    put_u32(hb + 20, wire_crc32c(0, pl, blen + tag));
    return 0;
}

static int wire_write_frame(wire_conn *c, int64_t deadline, const char *tn, char *err, size_t errlen) {
    struct iovec iov = { c->tx.data, c->tx.len };
    return wire_write_all(c, &iov, 1, deadline, tn, err, errlen);
}

/* Checks what any frame we send must satisfy. */
static int wire_send_check(wire_conn *c, uint16_t type, size_t len, char *err, size_t errlen) {
    const char *tn = wire_type_name(type);
    if (!wire_type_known(type)) {
        wire_errf(err, errlen, "refusing to send unknown frame type %u", type);
        return -1;
    }
    if (len > wire_type_max_payload(type)) {
        wire_errf(err, errlen, "%s payload of %zu bytes exceeds the limit %u", tn, len, wire_type_max_payload(type));
        return -1;
    }
    if (c->fd < 0) {
        wire_errf(err, errlen, "connection is closed");
        return -1;
    }
    return 0;
}

static int wire_send_locked(wire_conn *c, uint16_t type, uint64_t req_id, uint32_t flags,
                            const void *payload, size_t len, int64_t deadline, char *err, size_t errlen) {
    if (wire_send_check(c, type, len, err, errlen)) return -1;
    const void *body = payload;
    size_t blen = len;
    uint32_t fl = 0;
    /* Compression only inside the seal: never before the handshake. */
    if ((flags & WIRE_FLAG_ZSTD) && len && c->sealed) {
        size_t z = wire_compress(c, payload, len);
        if (z) {
            body = c->ztx.data;
            blen = z;
            fl = WIRE_FLAG_ZSTD;
        }
    }
    if (wire_frame_build(c, type, req_id, fl, (uint32_t)len, body, blen, err, errlen)) return -1;
    return wire_write_frame(c, deadline, wire_type_name(type), err, errlen);
}

int wire_send_raw(wire_conn *c, uint16_t type, uint64_t req_id, uint32_t flags, uint32_t raw_len,
                  const void *body, size_t blen, void (*mangle)(uint8_t *frame, size_t n, void *ud), void *ud,
                  char *err, size_t errlen) {
    pthread_mutex_lock(&c->send_lock);
    int r = wire_send_check(c, type, blen, err, errlen);
    if (!r) r = wire_frame_build(c, type, req_id, flags, raw_len, body, blen, err, errlen);
    if (!r && mangle) mangle(c->tx.data, c->tx.len, ud);
    if (!r) r = wire_write_frame(c, wire_deadline(c->timeout_ms), wire_type_name(type), err, errlen);
    pthread_mutex_unlock(&c->send_lock);
    return r;
}

int wire_send(wire_conn *c, uint16_t type, uint64_t req_id, uint32_t flags,
              const void *payload, size_t len, char *err, size_t errlen) {
    pthread_mutex_lock(&c->send_lock);
    int r = wire_send_locked(c, type, req_id, flags, payload, len, wire_deadline(c->timeout_ms), err, errlen);
    pthread_mutex_unlock(&c->send_lock);
    return r;
}

int wire_send_error(wire_conn *c, uint64_t req_id, uint32_t code, const char *msg) {
    wire_error e;
    e.code = code;
    snprintf(e.message, sizeof e.message, "%s", msg ? msg : "");
    uint8_t buf[WIRE_ERROR_FIXED + WIRE_ERROR_MAX_MSG];
    wire_buf b = { buf, 0, sizeof buf };   /* fits: encode never reallocates */
    if (wire_encode_error(&b, &e)) return -1;
    char dummy[8];
    /* Best effort with a short deadline: a peer that stopped reading must not
     * hold up the error path (even on a connection without a timeout). */
    int ms = c->timeout_ms > 0 && c->timeout_ms < WIRE_ERROR_SEND_MS ? c->timeout_ms : WIRE_ERROR_SEND_MS;
    pthread_mutex_lock(&c->send_lock);
    int r = wire_send_locked(c, WIRE_ERROR, req_id, 0, b.data, b.len, wire_deadline(ms), dummy, sizeof dummy);
    pthread_mutex_unlock(&c->send_lock);
    return r;
}

/* Read exactly n bytes before the deadline. `started` says whether any byte
 * of this frame has been read (EOF at a frame boundary is a clean close). */
static int wire_read_all(wire_conn *c, uint8_t *buf, size_t n, int64_t deadline, int started,
                         char *err, size_t errlen) {
    size_t got = 0;
    while (got < n) {
        ssize_t r = recv(c->fd, buf + got, n - got, MSG_DONTWAIT);
        if (r > 0) {
            got += (size_t)r;
            c->bytes_in += (uint64_t)r;
            started = 1;
            continue;
        }
        if (r == 0) {
            wire_errf(err, errlen, started ? "connection closed by peer in the middle of a frame"
                                           : "connection closed by peer");
            return -1;
        }
        if (errno == EINTR) continue;
        if (errno == EAGAIN || errno == EWOULDBLOCK) {
            int pr = wire_poll(c->fd, POLLIN, deadline);
            if (pr == 0) {
                wire_errf(err, errlen, started ? "timed out after %d ms in the middle of a frame"
                                               : "timed out after %d ms waiting for a frame",
                          c->timeout_ms);
                return -1;
            }
            if (pr < 0) {
                wire_errf(err, errlen, "poll failed: %s", strerror(errno));
                return -1;
            }
            continue;
        }
        if (errno == ECONNRESET)
            wire_errf(err, errlen, "connection closed by peer (reset)");
        else
            wire_errf(err, errlen, "receive failed: %s", strerror(errno));
        return -1;
    }
    return 0;
}

/* Read an n-byte payload into dst. The buffer grows as bytes arrive (at
 * most doubling), so a header that merely claims a huge payload costs the
 * sender the bytes before it costs us the memory. */
static int wire_read_payload(wire_conn *c, wire_buf *dst, uint32_t n, int64_t deadline, const char *tn,
                             char *err, size_t errlen) {
    size_t got = 0;
    dst->len = 0;
    while (got < n) {
        size_t want = got < WIRE_GROW_STEP ? WIRE_GROW_STEP : got * 2;
        if (want > n) want = n;
        if (wire_buf_reserve(dst, want - got)) {   /* dst->len == got */
            wire_errf(err, errlen, "out of memory for a %u-byte %s payload", n, tn);
            return -1;
        }
        if (wire_read_all(c, dst->data + got, want - got, deadline, 1, err, errlen)) return -1;
        got = want;
        dst->len = got;
    }
    dst->len = n;
    return 0;
}

/* Decompress the n bytes of c->zrx into c->rx (exactly h->raw_len bytes,
 * which the header check bounded by the type's limit before we got here). */
static int wire_decompress(wire_conn *c, const wire_header *h, size_t n, char *err, size_t errlen) {
    const char *tn = wire_type_name(h->type);
    unsigned long long fcs = ZSTD_getFrameContentSize(c->zrx.data, n);
    if (fcs == ZSTD_CONTENTSIZE_ERROR || fcs == ZSTD_CONTENTSIZE_UNKNOWN || fcs != h->raw_len) {
        wire_errf(err, errlen, "%s frame: zstd frame content size does not match raw_len %u", tn, h->raw_len);
        return -1;
    }
    size_t fsz = ZSTD_findFrameCompressedSize(c->zrx.data, n);
    if (ZSTD_isError(fsz) || fsz != n) {
        wire_errf(err, errlen, "%s frame: payload is not exactly one zstd frame", tn);
        return -1;
    }
    if (!c->zd && !(c->zd = ZSTD_createDCtx())) {
        wire_errf(err, errlen, "out of memory for zstd");
        return -1;
    }
    if (wire_buf_size(&c->rx, h->raw_len)) {
        wire_errf(err, errlen, "out of memory for a %u-byte %s payload", h->raw_len, tn);
        return -1;
    }
    size_t r = ZSTD_decompressDCtx(c->zd, c->rx.data, h->raw_len, c->zrx.data, n);
    if (ZSTD_isError(r) || r != h->raw_len) {
        wire_errf(err, errlen, "%s frame: zstd decompression failed: %s", tn,
                  ZSTD_isError(r) ? ZSTD_getErrorName(r) : "short output");
        c->rx.len = 0;
        return -1;
    }
    return 0;
}

/* CRC, then the seal, then decompression: the payload is in dst (len bytes). */
static int wire_check_payload(wire_conn *c, const uint8_t hb[WIRE_HEADER_BYTES], const wire_header *x,
                              wire_buf *dst, char *err, size_t errlen) {
    const char *tn = wire_type_name(x->type);
    uint32_t crc = wire_crc32c(0, dst->data, x->len);
    if (crc != x->crc) {
        wire_errf(err, errlen, "checksum mismatch in %s frame: got 0x%08x, expected 0x%08x", tn, crc, x->crc);
        c->rx_err = WERR_CHECKSUM;
        return -1;
    }
    size_t body = x->len;
    if (c->sealed) {
        body -= WIRE_TAG_BYTES;
        if (wire_open(c, hb, dst->data, body)) {
            wire_errf(err, errlen, "authentication tag mismatch in %s frame %llu (forged, replayed, reordered or "
                      "dropped frame)", tn, (unsigned long long)c->rx_seq);
            c->rx_err = WERR_AUTH;
            return -1;
        }
        dst->len = body;
    }
    if ((x->flags & WIRE_FLAG_ZSTD) && wire_decompress(c, x, body, err, errlen)) {
        c->rx_err = WERR_PROTOCOL;
        return -1;
    }
    return 0;
}

int wire_recv(wire_conn *c, wire_header *h, char *err, size_t errlen) {
    c->rx_err = 0;
    if (c->fd < 0) {
        wire_errf(err, errlen, "connection is closed");
        return -1;
    }
    int64_t deadline = wire_deadline(c->timeout_ms);
    uint8_t hb[WIRE_HEADER_BYTES];
    c->rx.len = 0;
    if (wire_read_all(c, hb, sizeof hb, deadline, 0, err, errlen)) {
        if (strstr(err, "timed out")) c->rx_err = WERR_TIMEOUT;
        return -1;
    }
    wire_header x;
    if (wire_header_decode(hb, c->sealed, &x, err, errlen)) {
        c->rx_err = WERR_PROTOCOL;
        return -1;
    }
    int z = (x.flags & WIRE_FLAG_ZSTD) != 0;
    wire_buf *dst = z ? &c->zrx : &c->rx;
    if (wire_read_payload(c, dst, x.len, deadline, wire_type_name(x.type), err, errlen)) {
        if (strstr(err, "timed out")) c->rx_err = WERR_TIMEOUT;
        c->rx.len = 0;
        return -1;
    }
    if (wire_check_payload(c, hb, &x, dst, err, errlen)) {
        c->rx.len = 0;
        return -1;
    }
    *h = x;
    return 0;
}

/* ==== TCP ==== */

/* Split "host:port", ":port", "port" or "[v6]:port" into host (default
 * 127.0.0.1) and port. */
static int wire_split_hostport(const char *hp, char *host, size_t hostlen, char *port, size_t portlen,
                               char *err, size_t errlen) {
    if (!hp || !*hp) {
        wire_errf(err, errlen, "empty address");
        return -1;
    }
    const char *h = NULL, *p;
    size_t hl = 0;
    if (hp[0] == '[') {
        const char *rb = strchr(hp, ']');
        if (!rb || rb[1] != ':') {
            wire_errf(err, errlen, "bad address '%s' (expected [ipv6]:port)", hp);
            return -1;
        }
        h = hp + 1;
        hl = (size_t)(rb - h);
        p = rb + 2;
    } else {
        const char *colon = strrchr(hp, ':');
        if (colon && strchr(hp, ':') != colon) {
            wire_errf(err, errlen, "bad address '%s' (write IPv6 addresses as [addr]:port)", hp);
            return -1;
        }
        if (colon) {
            h = hp;
            hl = (size_t)(colon - hp);
            p = colon + 1;
        } else {
            p = hp;
        }
    }
    if (!hl) {
        h = "127.0.0.1";
        hl = strlen(h);
    }
    size_t pl = strlen(p);
    if (hl >= hostlen || !pl || pl >= portlen || strspn(p, "0123456789") != pl || atol(p) > 65535) {
        wire_errf(err, errlen, "bad address '%s' (expected host:port with port 0-65535)", hp);
        return -1;
    }
    memcpy(host, h, hl);
    host[hl] = 0;
    memcpy(port, p, pl + 1);
    return 0;
}

static int wire_resolve(const char *hostport, int passive, struct addrinfo **res, char *err, size_t errlen) {
    char host[256], port[16];
    if (wire_split_hostport(hostport, host, sizeof host, port, sizeof port, err, errlen)) return -1;
    struct addrinfo hints;
    memset(&hints, 0, sizeof hints);
    hints.ai_family = AF_UNSPEC;
    hints.ai_socktype = SOCK_STREAM;
    hints.ai_flags = passive ? AI_PASSIVE : 0;
    /* "*" (listen only): every local address. */
    int any = passive && !strcmp(host, "*");
    int rc = getaddrinfo(any ? NULL : host, port, &hints, res);
    if (rc) {
        wire_errf(err, errlen, "cannot resolve '%s': %s", hostport, gai_strerror(rc));
        return -1;
    }
    return 0;
}

static void wire_set_nodelay(int fd) {
    int one = 1;
    (void)setsockopt(fd, IPPROTO_TCP, TCP_NODELAY, &one, sizeof one);
}

/* Connections the kernel queues before accept: under a connection flood
 * a short queue overflows and a legitimate peer's SYN is dropped (then
 * retried after a second); the prefill node drains the queue at tens of
 * thousands a second (a flood's newcomers past their share are closed
 * unread), so a long one only delays a peer by milliseconds. The kernel
 * caps it at net.core.somaxconn. */
#define WIRE_LISTEN_BACKLOG 4096

int wire_listen(const char *hostport, char *err, size_t errlen) {
    struct addrinfo *res;
    if (wire_resolve(hostport, 1, &res, err, errlen)) return -1;
    int fd = -1, last = 0;
    for (struct addrinfo *a = res; a; a = a->ai_next) {
        fd = plat_socket(a->ai_family, a->ai_socktype, a->ai_protocol, 0);
        if (fd < 0) { last = errno; continue; }
        int one = 1;
        (void)setsockopt(fd, SOL_SOCKET, SO_REUSEADDR, &one, sizeof one);
        wire_set_nodelay(fd);   /* inherited by accepted sockets on Linux */
        if (bind(fd, a->ai_addr, a->ai_addrlen) == 0 && listen(fd, WIRE_LISTEN_BACKLOG) == 0) break;
        last = errno;
        close(fd);
        fd = -1;
    }
    freeaddrinfo(res);
    if (fd < 0) wire_errf(err, errlen, "cannot listen on %s: %s", hostport, strerror(last));
    return fd;
}

int wire_local_port(int fd) {
    struct sockaddr_storage ss;
    socklen_t sl = sizeof ss;
    if (getsockname(fd, (struct sockaddr *)&ss, &sl)) return -1;
    if (ss.ss_family == AF_INET) return ntohs(((struct sockaddr_in *)&ss)->sin_port);
    if (ss.ss_family == AF_INET6) return ntohs(((struct sockaddr_in6 *)&ss)->sin6_port);
    return -1;
}

int wire_accept(int lfd, int timeout_ms, char *err, size_t errlen) {
    int64_t deadline = wire_deadline(timeout_ms);
    for (;;) {
        int pr = wire_poll(lfd, POLLIN, deadline);
        if (pr == 0) return -2;
        if (pr < 0) {
            wire_errf(err, errlen, "poll on listening socket failed: %s", strerror(errno));
            return -1;
        }
        int fd = plat_accept(lfd, 1);
        if (fd >= 0) {
            /* Back to blocking: our I/O polls with deadlines and uses MSG_DONTWAIT. */
            int fl = fcntl(fd, F_GETFL);
            if (fl >= 0) (void)fcntl(fd, F_SETFL, fl & ~O_NONBLOCK);
            wire_set_nodelay(fd);
            return fd;
        }
        /* A connection that vanished before accept, or a signal: try again. */
        if (errno == EINTR || errno == EAGAIN || errno == EWOULDBLOCK || errno == ECONNABORTED ||
            errno == EPROTO)
            continue;
        wire_errf(err, errlen, "accept failed: %s", strerror(errno));
        return -1;
    }
}

/* Non-blocking connect to one address with a deadline. fd or -1 (errno set). */
static int wire_connect_one(const struct addrinfo *a, int64_t deadline, int *timed_out) {
    int fd = plat_socket(a->ai_family, a->ai_socktype, a->ai_protocol, 1);
    if (fd < 0) return -1;
    if (connect(fd, a->ai_addr, a->ai_addrlen) < 0) {
        if (errno != EINPROGRESS) goto fail;
        int pr = wire_poll(fd, POLLOUT, deadline);
        if (pr <= 0) {
            if (pr == 0) { *timed_out = 1; errno = ETIMEDOUT; }
            goto fail;
        }
        int soerr = 0;
        socklen_t sl = sizeof soerr;
        if (getsockopt(fd, SOL_SOCKET, SO_ERROR, &soerr, &sl) < 0) goto fail;
        if (soerr) { errno = soerr; goto fail; }
    }
    int fl = fcntl(fd, F_GETFL);
    if (fl >= 0) (void)fcntl(fd, F_SETFL, fl & ~O_NONBLOCK);
    wire_set_nodelay(fd);
    return fd;
fail:;
    int e = errno;
    close(fd);
    errno = e;
    return -1;
}

int wire_connect(const char *hostport, int timeout_ms, char *err, size_t errlen) {
    struct addrinfo *res;
    if (wire_resolve(hostport, 0, &res, err, errlen)) return -1;
    int64_t deadline = wire_deadline(timeout_ms);
    int fd = -1, last = 0, timed_out = 0;
    for (struct addrinfo *a = res; a && fd < 0; a = a->ai_next) {
        fd = wire_connect_one(a, deadline, &timed_out);
        if (fd < 0) last = errno;
        if (timed_out) break;
    }
    freeaddrinfo(res);
    if (fd < 0) {
        if (timed_out)
            wire_errf(err, errlen, "cannot connect to %s: timed out after %d ms", hostport, timeout_ms);
        else
            wire_errf(err, errlen, "cannot connect to %s: %s", hostport, strerror(last));
    }
    return fd;
}

/* ==== Handshake ==== */

static void wire_hex(const uint8_t *p, size_t n, char *out) {
    static const char hx[] = "0123456789abcdef";
    for (size_t i = 0; i < n; i++) {
        out[2 * i] = hx[p[i] >> 4];
        out[2 * i + 1] = hx[p[i] & 15];
    }
    out[2 * n] = 0;
}

/* Handshake labels (docs/wire-protocol.md section 5); a change to any of
 * them is a protocol version change. */
#define WIRE_HS_TRANSCRIPT "tandem-v2 transcript"
#define WIRE_HS_AUTH_I "tandem-v2 auth initiator"
#define WIRE_HS_AUTH_R "tandem-v2 auth responder"
#define WIRE_HS_KEY_I2R "tandem-v2 key initiator to responder"
#define WIRE_HS_KEY_R2I "tandem-v2 key responder to initiator"

/* What both ends derive from the secret and the two HELLO payloads. */
typedef struct {
    uint8_t auth_i[32], auth_r[32];   /* the initiator's and the responder's AUTH */
    uint8_t k_i2r[32], k_r2i[32];     /* session keys, one per direction */
} wire_hs_keys;

/* th = SHA-256(label || HELLO_initiator || HELLO_responder) (payload bytes
 * exactly as sent); PRK = HKDF-Extract(salt = th, IKM = secret); each output
 * is HKDF-Expand(PRK, its label, 32). */
static int wire_hs_derive(const void *secret, size_t secret_len, const uint8_t *hello_i, const uint8_t *hello_r,
                          wire_hs_keys *k) {
    uint8_t th[32], msg[sizeof WIRE_HS_TRANSCRIPT - 1 + 2 * WIRE_HELLO_BYTES];
    size_t ll = sizeof WIRE_HS_TRANSCRIPT - 1;
    unsigned int thl = sizeof th;
    memcpy(msg, WIRE_HS_TRANSCRIPT, ll);
    memcpy(msg + ll, hello_i, WIRE_HELLO_BYTES);
    memcpy(msg + ll + WIRE_HELLO_BYTES, hello_r, WIRE_HELLO_BYTES);
    if (EVP_Digest(msg, sizeof msg, th, &thl, EVP_sha256(), NULL) != 1) return -1;
    struct { const char *label; uint8_t *out; } outs[] = {
        { WIRE_HS_AUTH_I, k->auth_i }, { WIRE_HS_AUTH_R, k->auth_r },
        { WIRE_HS_KEY_I2R, k->k_i2r }, { WIRE_HS_KEY_R2I, k->k_r2i },
    };
    int rc = 0;
    for (int i = 0; i < 4 && !rc; i++)
        rc = wire_hkdf_sha256(th, sizeof th, secret, secret_len, outs[i].label, strlen(outs[i].label), outs[i].out, 32);
    return rc;
}

/* Receive one frame of the expected type before the deadline; a peer's
 * ERROR frame becomes "peer <id> refused the handshake: <msg>". */
static int wire_hs_recv(wire_conn *c, uint16_t want, int64_t deadline, const char *peer_id,
                        uint32_t *peer_code, char *err, size_t errlen) {
    *peer_code = 0;
    int saved = c->timeout_ms;
    int64_t left = deadline - wire_now_ms();
    if (left <= 0) {
        wire_errf(err, errlen, "handshake timed out");
        return -1;
    }
    c->timeout_ms = (int)(left > INT32_MAX ? INT32_MAX : left);
    wire_header h;
    char e2[512];
    int r = wire_recv(c, &h, e2, sizeof e2);
    c->timeout_ms = saved;
    if (r) {
        wire_errf(err, errlen, "handshake with %s failed: %s", peer_id, e2);
        /* Tell the peer why (best effort; a closed socket just fails quietly). */
        if (!strstr(e2, "closed by peer"))
            wire_send_error(c, 0, strstr(e2, "timed out") ? WERR_TIMEOUT : WERR_PROTOCOL, err);
        return -1;
    }
    if (h.type == WIRE_ERROR) {
        wire_error we;
        if (wire_decode_error(c->rx.data, c->rx.len, &we, e2, sizeof e2)) {
            wire_errf(err, errlen, "handshake with %s failed: bad ERROR frame: %s", peer_id, e2);
            return -1;
        }
        wire_errf(err, errlen, "peer %s refused the handshake: %s", peer_id, we.message);
        *peer_code = we.code;
        return -1;
    }
    if (h.type != want) {
        wire_errf(err, errlen, "handshake with %s failed: expected a %s frame, got %s", peer_id,
                  wire_type_name(want), wire_type_name(h.type));
        wire_send_error(c, 0, WERR_PROTOCOL, err);
        return -1;
    }
    if (h.req_id != 0 || (h.flags & WIRE_FLAG_ZSTD)) {
        wire_errf(err, errlen, "handshake with %s failed: %s frame must have req_id 0 and no compression",
                  peer_id, wire_type_name(want));
        wire_send_error(c, 0, WERR_PROTOCOL, err);
        return -1;
    }
    return 0;
}

static int wire_hs_send(wire_conn *c, uint16_t type, const wire_buf *b, int64_t deadline,
                        char *err, size_t errlen) {
    char e2[256];
    pthread_mutex_lock(&c->send_lock);
    int r = wire_send_locked(c, type, 0, 0, b->data, b->len, deadline, e2, sizeof e2);
    pthread_mutex_unlock(&c->send_lock);
    if (r) wire_errf(err, errlen, "handshake failed sending %s: %s", wire_type_name(type), e2);
    return r;
}

/* Same model and the same KV cache type, or an ERROR naming both sides. */
static int wire_hs_compare(wire_conn *c, const wire_hello *me, const wire_hello *peer, char *err,
                           size_t errlen) {
    char fa[17], fb[17];
    wire_hex(me->fingerprint, 8, fa);
    wire_hex(peer->fingerprint, 8, fb);
    if (memcmp(me->fingerprint, peer->fingerprint, 32) != 0) {
        wire_errf(err, errlen, "model mismatch: this node serves %s (fingerprint %s..), peer serves %s (fingerprint %s..)",
                  me->model_desc, fa, peer->model_desc, fb);
        wire_send_error(c, 0, WERR_MODEL, err);
        return -1;
    }
    if (me->kv_dtype != peer->kv_dtype) {
        wire_errf(err, errlen, "KV cache type mismatch: this node stores %s for %s, peer %s stores %s",
                  gguf_type_name(me->kv_dtype), me->model_desc, peer->node_id, gguf_type_name(peer->kv_dtype));
        wire_send_error(c, 0, WERR_MODEL, err);
        return -1;
    }
    return 0;
}

/* The responder's half of the proofs: verify the initiator's AUTH first,
 * only then send ours. The initiator's: send ours, then verify theirs. */
static int wire_hs_auth(wire_conn *c, int initiator, const wire_hello *me, const wire_hello *them,
                        const wire_hs_keys *k, int64_t deadline, char *err, size_t errlen) {
    wire_auth mine, theirs;
    wire_buf b = { 0 };
    uint32_t code;
    char e2[384];
    int rc = -1;
    memcpy(mine.mac, initiator ? k->auth_i : k->auth_r, 32);
    if (initiator && (wire_encode_auth(&b, &mine) || wire_hs_send(c, WIRE_AUTH, &b, deadline, err, errlen))) goto out;
    if (wire_hs_recv(c, WIRE_AUTH, deadline, them->node_id, &code, err, errlen)) {
        if (code == WERR_AUTH && initiator)
            wire_errf(err, errlen, "authentication failed: peer %s rejected this node's proof (different shared secret)",
                      them->node_id);
        goto out;
    }
    if (wire_decode_auth(c->rx.data, c->rx.len, &theirs, e2, sizeof e2)) {
        wire_errf(err, errlen, "handshake with %s failed: %s", them->node_id, e2);
        goto out;
    }
    if (CRYPTO_memcmp(initiator ? k->auth_r : k->auth_i, theirs.mac, 32) != 0) {
        wire_errf(err, errlen, "authentication failed: peer %s does not know the shared secret", them->node_id);
        char msg[256];
        snprintf(msg, sizeof msg, "authentication failed: %s rejected this node's AUTH (different shared secret)",
                 me->node_id);
        wire_send_error(c, 0, WERR_AUTH, msg);
        goto out;
    }
    if (!initiator && (wire_encode_auth(&b, &mine) || wire_hs_send(c, WIRE_AUTH, &b, deadline, err, errlen))) goto out;
    rc = 0;
out:
    OPENSSL_cleanse(&mine, sizeof mine);
    wire_buf_free(&b);
    return rc;
}

/* Sends our HELLO, receives and checks the peer's; both payloads as sent
 * are kept for the transcript. */
static int wire_hs_hellos(wire_conn *c, wire_hello *me, wire_hello *them, uint8_t raw_me[WIRE_HELLO_BYTES],
                          uint8_t raw_them[WIRE_HELLO_BYTES], wire_hello *peer, int64_t deadline,
                          char *err, size_t errlen) {
    wire_buf b = { raw_me, 0, WIRE_HELLO_BYTES };   /* fits: encode never reallocates */
    uint32_t code;
    char e2[384];
    if (wire_encode_hello(&b, me) || wire_hs_send(c, WIRE_HELLO, &b, deadline, err, errlen)) return -1;
    /* HELLO and AUTH have no req_id: a peer that says nothing is named by address-less "peer". */
    if (wire_hs_recv(c, WIRE_HELLO, deadline, "peer", &code, err, errlen)) return -1;
    memcpy(raw_them, c->rx.data, WIRE_HELLO_BYTES);   /* wire_hs_recv: exactly a HELLO's size */
    if (wire_decode_hello(raw_them, WIRE_HELLO_BYTES, them, e2, sizeof e2)) {
        wire_errf(err, errlen, "handshake failed: bad HELLO from peer: %s", e2);
        wire_send_error(c, 0, WERR_PROTOCOL, err);
        return -1;
    }
    if (peer) *peer = *them;   /* for the caller's logs, even if we refuse it below */
    if (them->role == me->role || !memcmp(them->nonce, me->nonce, 32)) {
        wire_errf(err, errlen, "handshake with %s failed: peer claims this node's own role (%s) or nonce",
                  them->node_id, wire_role_name(me->role));
        wire_send_error(c, 0, WERR_PROTOCOL, err);
        return -1;
    }
    return wire_hs_compare(c, me, them, err, errlen);
}

int wire_handshake(wire_conn *c, const wire_hello *mine, const void *secret, size_t secret_len,
                   wire_hello *peer, char *err, size_t errlen) {
    int timeout = c->timeout_ms > 0 ? c->timeout_ms : WIRE_HANDSHAKE_DEFAULT_MS;
    int64_t deadline = wire_now_ms() + timeout;
    wire_hello me = *mine, them;
    uint8_t raw_me[WIRE_HELLO_BYTES], raw_them[WIRE_HELLO_BYTES];
    wire_hs_keys k;
    memset(&k, 0, sizeof k);
    me.node_id[sizeof me.node_id - 1] = 0;
    me.model_desc[sizeof me.model_desc - 1] = 0;
    if (c->sealed) {
        wire_errf(err, errlen, "handshake on a connection that already has session keys");
        return -1;
    }
    if (wire_random(me.nonce, sizeof me.nonce)) {
        wire_errf(err, errlen, "handshake failed: no randomness for the nonce: %s", strerror(errno));
        return -1;
    }
    if (wire_hs_hellos(c, &me, &them, raw_me, raw_them, peer, deadline, err, errlen)) return -1;
    int rc = -1;
    if (!secret || !secret_len) {
        wire_errf(err, errlen, "authentication failed: this node (%s) has no shared secret", me.node_id);
        wire_send_error(c, 0, WERR_AUTH, err);
        goto out;
    }
    /* The end with the higher role number initiates (proves first): a
     * prefill node, which accepts strangers' connections, never does. */
    int initiator = me.role > them.role;
    if (wire_hs_derive(secret, secret_len, initiator ? raw_me : raw_them, initiator ? raw_them : raw_me, &k)) {
        wire_errf(err, errlen, "handshake failed: key derivation failed (OpenSSL)");
        goto out;
    }
    if (wire_hs_auth(c, initiator, &me, &them, &k, deadline, err, errlen)) goto out;
    rc = wire_conn_seal(c, initiator ? k.k_i2r : k.k_r2i, initiator ? k.k_r2i : k.k_i2r, err, errlen);
out:
    OPENSSL_cleanse(&k, sizeof k);
    return rc;
}

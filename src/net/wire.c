/* wire.c - tandem's node-to-node protocol: framing, checksums, buffers,
 * frame I/O with deadlines, and the AES-256-GCM seal on every frame after
 * the handshake. The payload codecs are in wire_codec.c, the sockets in
 * wire_tcp.c, the handshake in wire_handshake.c (wire_internal.h between
 * them). docs/wire-protocol.md is the specification these files implement.
 */

#include "net/wire.h"

#include <errno.h>
#include <limits.h>
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

#include "base/platform.h"
#include "net/wire_draft.h"

#if defined(__x86_64__)
#include <nmmintrin.h>
#endif

#include "net/wire_internal.h"

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

void wire_errf(char *err, size_t errlen, const char *fmt, ...) {
    if (!err || !errlen) return;
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(err, errlen, fmt, ap);
    va_end(ap);
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

uint8_t *wire_buf_grow(wire_buf *b, size_t n) {
    if (wire_buf_reserve(b, n)) return NULL;
    uint8_t *p = b->data + b->len;
    b->len += n;
    return p;
}

/* ==== Connection ==== */

int64_t wire_now_ms(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (int64_t)ts.tv_sec * 1000 + ts.tv_nsec / 1000000;
}

/* Absolute deadline for an operation allowed to take timeout_ms (<= 0: none). */
int64_t wire_deadline(int timeout_ms) { return timeout_ms > 0 ? wire_now_ms() + timeout_ms : -1; }

/* Wait for fd readiness until the deadline. 1 ready, 0 timed out, -1 error. */
int wire_poll(int fd, short events, int64_t deadline) {
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

int wire_send_locked(wire_conn *c, uint16_t type, uint64_t req_id, uint32_t flags,
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

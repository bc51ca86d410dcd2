/* wire.h - tandem's node-to-node protocol (docs/wire-protocol.md is the
 * byte-by-byte specification; this header is its C face).
 *
 * Every message is a frame: a fixed 32-byte header followed by a payload.
 * All integers are little-endian. The payload is checked with CRC32C and may
 * be zstd-compressed (flag bit 0) when both ends advertised it. After the
 * handshake every payload is sealed with AES-256-GCM (per-direction session
 * keys, the frame's sequence number as nonce, the header as associated data)
 * and ends in a 16-byte tag; before it only HELLO, AUTH and ERROR may pass.
 *
 *   off size field
 *     0    4 magic     "TNDM"
 *     4    2 version   WIRE_VERSION
 *     6    2 type      enum wire_type
 *     8    4 flags     bit 0: payload is zstd-compressed
 *    12    4 len       payload bytes on the wire (tag included once sealed)
 *    16    4 raw_len   payload bytes after opening and decompression
 *    20    4 crc       CRC32C of the payload bytes as sent (ciphertext and tag)
 *    24    8 req_id    request the frame belongs to (0 for connection-level frames)
 */
#ifndef TANDEM_WIRE_H
#define TANDEM_WIRE_H

#include <pthread.h>
#include <stddef.h>
#include <stdint.h>

#define WIRE_MAGIC 0x4D444E54u      /* "TNDM" read as a little-endian u32 */
#define WIRE_VERSION 2
#define WIRE_HEADER_BYTES 32
/* Largest payload: one layer of one 512-token chunk of a big model is
 * 512 tokens x 2 (K,V) x 8 KV heads x 128 x 2 bytes = 2 MiB; 64 MiB leaves
 * room for wide models and bigger chunks while bounding what a hostile peer
 * can make us allocate. */
#define WIRE_MAX_PAYLOAD (64u << 20)
/* AES-256-GCM tag closing every sealed payload. */
#define WIRE_TAG_BYTES 16u
#define WIRE_KEY_BYTES 32u

enum wire_type {
    WIRE_HELLO = 1,      /* both ends, first frame: who I am, my nonce, my model */
    WIRE_AUTH = 2,       /* initiator first, then responder: proof of the shared secret over the HELLOs */
    WIRE_REQUEST = 3,    /* decode -> prefill: tokens to prefill, span to send */
    WIRE_KV = 4,         /* prefill -> decode: one layer's K and V for a token range */
    WIRE_DONE = 5,       /* prefill -> decode: request finished, with figures */
    WIRE_ERROR = 6,      /* either way: code + message; ends the request (or connection if req_id 0) */
    WIRE_CANCEL = 7,     /* decode -> prefill: stop computing this request */
    WIRE_PING = 8,       /* liveness, echoed as PONG */
    WIRE_PONG = 9,
    WIRE_ACT = 10,       /* slice -> decode -> next slice: a chunk's hidden states (net/wire_act.h) */
    WIRE_DRAFT = 11,     /* decode -> draft node: histories, drafts wanted (net/wire_draft.h) */
    WIRE_DRAFTS = 12,    /* draft node -> decode: the drafts */
};

enum wire_flag { WIRE_FLAG_ZSTD = 1u };

/* Error codes carried in WIRE_ERROR frames. */
enum wire_err {
    WERR_PROTOCOL = 1,   /* malformed frame, bad order */
    WERR_AUTH = 2,       /* wrong secret */
    WERR_MODEL = 3,      /* model fingerprint mismatch */
    WERR_CHECKSUM = 4,
    WERR_RANGE = 5,      /* token range / layer / size out of bounds */
    WERR_DTYPE = 6,      /* unknown or unnegotiated dtype */
    WERR_BUSY = 7,
    WERR_INTERNAL = 8,
    WERR_CANCELLED = 9,
    WERR_TIMEOUT = 10,
};

typedef struct {
    uint16_t version, type;
    uint32_t flags, len, raw_len, crc;
    uint64_t req_id;
} wire_header;

/* Fixed payload sizes (docs/wire-protocol.md section 4). */
#define WIRE_HELLO_BYTES 396u
#define WIRE_AUTH_BYTES 32u
#define WIRE_REQUEST_FIXED 20u       /* + 4 bytes per token */
#define WIRE_KV_FIXED 20u            /* + 2 * n * row_bytes */
#define WIRE_DONE_BYTES 32u
#define WIRE_ERROR_FIXED 8u          /* + message bytes (<= WIRE_ERROR_MAX_MSG) */
#define WIRE_ERROR_MAX_MSG 511u
#define WIRE_PING_MAX 64u            /* PING/PONG: opaque bytes, echoed */

/* "HELLO", "KV", ... ("unknown" outside the enum). */
const char *wire_type_name(uint32_t type);
/* "protocol", "auth", "model", ... ("unknown"). */
const char *wire_err_name(uint32_t code);
/* "prefill", "decode", "router" ("unknown"). */
const char *wire_role_name(uint32_t role);
/* Largest payload a frame of this type may carry (raw, and on the wire before
 * the tag); 0 for unknown types. */
uint32_t wire_type_max_payload(uint32_t type);

/* ==== Checksums and authentication ==== */
uint32_t wire_crc32c(uint32_t crc, const void *data, size_t n);   /* start with crc = 0 */
/* Table-driven (slicing-by-8) reference; wire_crc32c uses SSE4.2 when built for it. */
uint32_t wire_crc32c_sw(uint32_t crc, const void *data, size_t n);
/* Plain HMAC-SHA256(key, msg) (RFC 2104); wire_hkdf_sha256 is built on it. */
void wire_hmac_sha256(const void *key, size_t key_len, const void *msg, size_t msg_len, uint8_t out[32]);
int wire_random(uint8_t *out, size_t n);   /* 0 on success */
/* HKDF-SHA256 (RFC 5869): extract with salt, expand with info to out_len
 * bytes (<= 255 * 32). 0, or -1 if out_len is too large. */
int wire_hkdf_sha256(const void *salt, size_t salt_len, const void *ikm, size_t ikm_len, const void *info,
                     size_t info_len, uint8_t *out, size_t out_len);

/* ==== Header ==== */
void wire_header_encode(const wire_header *h, uint8_t out[WIRE_HEADER_BYTES]);
/* Checks magic, version, type range, flags and sizes. sealed = 0: the rules
 * before the handshake completes (only HELLO, AUTH and ERROR, uncompressed,
 * req_id 0, at most their own size); sealed = 1: after it (any type but
 * HELLO/AUTH, len = sealed bytes + WIRE_TAG_BYTES). 0 or -1 with message. */
int wire_header_decode(const uint8_t in[WIRE_HEADER_BYTES], int sealed, wire_header *h, char *err, size_t errlen);

/* ==== Payloads ====
 * Each payload type has a C struct, an encoder (appends to a wire_buf) and a
 * decoder that bounds-checks everything against the received bytes. Decoded
 * structs may point into the payload buffer (valid while it lives). */

typedef struct { uint8_t *data; size_t len, cap; } wire_buf;
void wire_buf_free(wire_buf *b);
void wire_buf_reset(wire_buf *b);        /* len = 0, keeps the memory */
/* Note: encoders APPEND to b (reset it first to build one payload); they
 * return 0, or -1 on out-of-memory or a value the format cannot carry. */

enum wire_role { WIRE_ROLE_PREFILL = 1, WIRE_ROLE_DECODE = 2, WIRE_ROLE_ROUTER = 3 };
/* SLICE: I speak ACT frames and layer-split prefill (docs/wire-protocol.md 4.9).
 * DRAFT: I speak DRAFT/DRAFTS frames (4.10); a prefill node sets it only
 * when it has a draft model. */
enum wire_caps { WIRE_CAP_ZSTD = 1u, WIRE_CAP_Q8_0 = 2u, WIRE_CAP_BF16 = 4u, WIRE_CAP_SLICE = 8u, WIRE_CAP_DRAFT = 16u };

typedef struct {
    uint32_t role;               /* enum wire_role */
    uint32_t caps;               /* enum wire_caps bits */
    uint8_t nonce[32];           /* fresh random per connection */
    uint8_t fingerprint[32];     /* model fingerprint (model_fingerprint) */
    uint32_t kv_dtype;           /* the sender's KV cache type (ggml type) */
    char node_id[64];            /* NUL-terminated */
    char model_desc[256];        /* human-readable: file name, arch, shape, type */
} wire_hello;

typedef struct {
    uint8_t mac[32];             /* HKDF-Expand(PRK, "tandem-v2 auth initiator|responder") (docs, section 5) */
} wire_auth;

typedef struct {
    uint32_t start_pos;          /* first position to send (decode node already holds [0, start_pos)) */
    uint32_t end_pos;            /* send positions [start_pos, end_pos); end_pos <= n_tokens */
    uint32_t wire_dtype;         /* GGML_TYPE_F16 / BF16 / Q8_0: must equal the cache type or be negotiated Q8_0 */
    uint32_t flags;              /* bit 0: zstd frames wanted */
    uint32_t n_tokens;
    const uint8_t *tokens;       /* n_tokens little-endian u32 ids (points into the payload) */
} wire_request;

typedef struct {
    uint32_t layer;
    uint32_t pos0, n;            /* token range [pos0, pos0 + n) */
    uint32_t dtype;              /* ggml type of the rows */
    uint32_t row_bytes;          /* bytes of one token's K (= V) row */
    const uint8_t *k, *v;        /* n * row_bytes each */
} wire_kv;

typedef struct {
    uint32_t n_positions;        /* positions sent */
    uint32_t n_computed;         /* prompt positions the prefill node computed */
    double prefill_ms;           /* prefill compute time on the prefill node */
    uint64_t kv_bytes;           /* raw K+V bytes sent */
    uint64_t wire_bytes;         /* bytes actually written (headers + compressed payloads) */
} wire_done;

typedef struct {
    uint32_t code;               /* enum wire_err */
    char message[512];
} wire_error;

int wire_encode_hello(wire_buf *b, const wire_hello *h);
int wire_decode_hello(const uint8_t *p, size_t n, wire_hello *h, char *err, size_t errlen);
int wire_encode_auth(wire_buf *b, const wire_auth *a);
int wire_decode_auth(const uint8_t *p, size_t n, wire_auth *a, char *err, size_t errlen);
int wire_encode_request(wire_buf *b, const wire_request *r, const int32_t *tokens);
int wire_decode_request(const uint8_t *p, size_t n, wire_request *r, char *err, size_t errlen);
uint32_t wire_request_token(const wire_request *r, uint32_t i);
/* K and V rows given separately (they live in different cache arrays). */
int wire_encode_kv(wire_buf *b, const wire_kv *kv);
int wire_decode_kv(const uint8_t *p, size_t n, wire_kv *kv, char *err, size_t errlen);
int wire_encode_done(wire_buf *b, const wire_done *d);
int wire_decode_done(const uint8_t *p, size_t n, wire_done *d, char *err, size_t errlen);
int wire_encode_error(wire_buf *b, const wire_error *e);
int wire_decode_error(const uint8_t *p, size_t n, wire_error *e, char *err, size_t errlen);

/* ==== Connection ====
 * A blocking socket with deadlines. wire_send() frames a payload (compressing
 * it with zstd when flags has WIRE_FLAG_ZSTD and that makes it smaller),
 * wire_recv() reads one frame, verifies header and CRC32C, opens the seal,
 * decompresses, and leaves the payload in conn->rx (valid until the next
 * wire_recv). Both are safe to call from one sender and one receiver thread
 * at the same time. A fresh conn is unsealed (handshake rules);
 * wire_handshake seals it. */
typedef struct {
    int fd;
    int timeout_ms;              /* per-frame read/write deadline; 0 = none */
    wire_buf rx;                 /* last payload received */
    wire_buf tx, ztx, zrx;       /* scratch */
    uint64_t bytes_out, bytes_in;
    pthread_mutex_t send_lock;   /* wire_send may be called from several threads */
    void *zc, *zd;               /* zstd contexts (sender's, receiver's), lazily made */
    int live;                    /* set by wire_conn_init, cleared by wire_conn_close */
    int sealed;                  /* session keys installed (wire_conn_seal) */
    void *tx_aead, *rx_aead;     /* EVP_CIPHER_CTX of each direction's key */
    uint64_t tx_seq, rx_seq;     /* sequence number of the next frame each way (the GCM nonce) */
    uint32_t rx_err;             /* after a failed wire_recv: the enum wire_err to answer with, 0 = none
                                  * (peer closed, or our own I/O failed) */
} wire_conn;

void wire_conn_init(wire_conn *c, int fd, int timeout_ms);   /* also sets TCP_NODELAY */
void wire_conn_close(wire_conn *c);      /* closes fd, frees buffers; safe to call twice */
/* shutdown(2) both directions: a thread blocked in wire_recv/wire_send on
 * this conn returns promptly with "connection closed by peer"/an error. */
void wire_conn_shutdown(wire_conn *c);
int wire_send(wire_conn *c, uint16_t type, uint64_t req_id, uint32_t flags,
              const void *payload, size_t len, char *err, size_t errlen);
/* Installs session keys: from now on every frame is sealed (AES-256-GCM) and
 * checked; sequence numbers start at 0. Done by wire_handshake; tests call it
 * directly on socket pairs. 0 or -1 with a message. */
int wire_conn_seal(wire_conn *c, const uint8_t tx_key[WIRE_KEY_BYTES], const uint8_t rx_key[WIRE_KEY_BYTES],
                   char *err, size_t errlen);
/* Lower level, for tests and fault injection: frames `body` as given (never
 * compressed here: with WIRE_FLAG_ZSTD, body must already be a zstd frame
 * and raw_len its content size), seals it on a sealed conn, lets mangle (if
 * not NULL) change the finished frame's bytes, and writes it. */
int wire_send_raw(wire_conn *c, uint16_t type, uint64_t req_id, uint32_t flags, uint32_t raw_len,
                  const void *body, size_t blen, void (*mangle)(uint8_t *frame, size_t n, void *ud), void *ud,
                  char *err, size_t errlen);
/* Returns 0 with *h filled, or -1 (error, peer closed, or timeout: message says which). */
int wire_recv(wire_conn *c, wire_header *h, char *err, size_t errlen);
/* Best-effort WIRE_ERROR frame (message truncated to WIRE_ERROR_MAX_MSG). */
int wire_send_error(wire_conn *c, uint64_t req_id, uint32_t code, const char *msg);

/* TCP helpers. "host:port", ":port", "port" or "[v6addr]:port"; listen binds
 * 127.0.0.1 unless a host is given ("*" = all interfaces). Sockets are
 * CLOEXEC and TCP_NODELAY. Errors: "cannot connect to H:P: <reason>" (a
 * connect timeout says "timed out"), "cannot listen on ...", "bad address". */
int wire_listen(const char *hostport, char *err, size_t errlen);
int wire_connect(const char *hostport, int timeout_ms, char *err, size_t errlen);
/* Port a bound socket listens on (for wire_listen(":0")), or -1. */
int wire_local_port(int fd);
/* Accept one connection (CLOEXEC, TCP_NODELAY). Returns the fd; -2 if
 * timeout_ms (> 0) passed with no connection; -1 with a message on error. */
int wire_accept(int lfd, int timeout_ms, char *err, size_t errlen);

/* Handshake (both sides): send HELLO, receive the peer's, check fingerprint,
 * then the initiator (the end with the higher role number: the decode node
 * towards a prefill node) sends its AUTH and the responder answers with its
 * own only after verifying it. Both proofs and the session keys come from
 * HKDF over the shared secret and a hash of both HELLOs; on success the conn
 * is sealed. On a mismatch it sends an ERROR naming both models and fails.
 * peer receives the peer's hello (filled as soon as it is decoded, so also
 * on a model/auth failure).
 * mine->nonce is ignored: a fresh nonce is drawn for every handshake.
 * Peers must have different roles (prefill<->decode, router<->decode).
 * The whole handshake has one deadline: c->timeout_ms, or 10 s if that is 0.
 * Error messages (err): "model mismatch: this node serves ..., peer serves ...",
 * "KV cache type mismatch: ...", "authentication failed: peer <id> does not
 * know the shared secret", "authentication failed: peer <id> rejected this
 * node's proof (different shared secret)", "peer <id> refused the handshake: <its message>",
 * "protocol version mismatch: ...", or the I/O error ("timed out", "closed"). */
int wire_handshake(wire_conn *c, const wire_hello *mine, const void *secret, size_t secret_len,
                   wire_hello *peer, char *err, size_t errlen);

#endif

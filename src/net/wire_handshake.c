/* wire_handshake.c - the wire protocol's authenticated handshake
 * (docs/wire-protocol.md section 3): HELLOs exchanged and compared, the
 * HMAC proofs of the shared secret, and the HKDF-derived session keys
 * installed with wire_conn_seal. */

#include "net/wire.h"

#include <errno.h>
#include <stdio.h>
#include <string.h>

#include <openssl/crypto.h>
#include <openssl/evp.h>

#include "engine/gguf.h"

#include "net/wire_internal.h"

/* Handshake deadline when the connection has no per-frame timeout: long
 * enough for a loaded machine, short enough that a silent peer is dropped. */
#define WIRE_HANDSHAKE_DEFAULT_MS 10000

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

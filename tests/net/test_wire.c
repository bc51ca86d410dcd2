/* test_wire.c - the wire protocol: checksums, HMAC, payload codecs, header
 * validation, framed socket I/O (zstd, corruption, timeouts), TCP helpers,
 * the authenticated handshake, and model fingerprints. */
#include "t.h"

#include <errno.h>
#include <math.h>
#include <fcntl.h>
#include <pthread.h>
#include <signal.h>
#include <stdint.h>
#include <sys/socket.h>
#include <time.h>
#include <unistd.h>

#include "engine/fingerprint.h"
#include "engine/gguf.h"
#include "engine/model.h"
#include "net/wire.h"
#include "net/wire_act.h"

#include <zstd.h>

static double now_ms(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return ts.tv_sec * 1e3 + ts.tv_nsec / 1e6;
}

static uint64_t rng_state = 0x9E3779B97F4A7C15ull;   /* t_rnd_u32's: one sequence through the file */

/* ==== CRC32C ==== */

static void test_crc(void) {
    CHECK(wire_crc32c(0, "123456789", 9) == 0xE3069283u, "crc32c check value: %08x", wire_crc32c(0, "123456789", 9));
    CHECK(wire_crc32c_sw(0, "123456789", 9) == 0xE3069283u, "sw crc32c check value");
    CHECK(wire_crc32c(0, "", 0) == 0, "crc of nothing");
    /* RFC 3720 (iSCSI) appendix B.4 vectors. */
    uint8_t b[32];
    memset(b, 0, 32);
    CHECK(wire_crc32c(0, b, 32) == 0x8A9136AAu, "32 zero bytes");
    memset(b, 0xFF, 32);
    CHECK(wire_crc32c(0, b, 32) == 0x62A8AB43u, "32 0xff bytes");
    for (int i = 0; i < 32; i++) b[i] = (uint8_t)i;
    CHECK(wire_crc32c(0, b, 32) == 0x46DD794Eu, "32 incrementing bytes");
    for (int i = 0; i < 32; i++) b[i] = (uint8_t)(31 - i);
    CHECK(wire_crc32c(0, b, 32) == 0x113FDB5Cu, "32 decrementing bytes");

    /* Hardware == table for all alignments and lengths, and chaining works. */
    static uint8_t buf[4096 + 16];
    for (size_t i = 0; i < sizeof buf; i++) buf[i] = (uint8_t)t_rnd_u32(&rng_state);
    int bad = 0, badchain = 0;
    for (int t = 0; t < 600; t++) {
        size_t off = t_rnd_u32(&rng_state) % 16, n = t < 100 ? (size_t)t : t_rnd_u32(&rng_state) % 4096;
        uint32_t hw = wire_crc32c(0, buf + off, n), sw = wire_crc32c_sw(0, buf + off, n);
        if (hw != sw) bad++;
        size_t cut = n ? t_rnd_u32(&rng_state) % n : 0;
        if (wire_crc32c(wire_crc32c(0, buf + off, cut), buf + off + cut, n - cut) != hw) badchain++;
    }
    CHECK(bad == 0, "hardware and table CRC32C disagree %d times", bad);
    CHECK(badchain == 0, "chained CRC differs %d times", badchain);
}

/* ==== HMAC ==== */

static void hex32(const char *hex, uint8_t out[32]) {
    for (int i = 0; i < 32; i++) sscanf(hex + 2 * i, "%2hhx", &out[i]);
}

static void test_hmac(void) {
    /* RFC 4231 test case 2. */
    uint8_t want[32], got[32];
    hex32("5bdcc146bf60754e6a042426089575c75a003f089d2739839dec58b964ec3843", want);
    const char *msg = "what do ya want for nothing?";
    wire_hmac_sha256("Jefe", 4, msg, strlen(msg), got);
    CHECK(memcmp(want, got, 32) == 0, "HMAC-SHA256 RFC 4231 case 2");
    /* HKDF-SHA256, RFC 5869 test cases 1 and 3 (42 output bytes: two blocks). */
    uint8_t ikm[22], salt[13], info[10], okm[42], want42[42];
    memset(ikm, 0x0b, sizeof ikm);
    for (int i = 0; i < 13; i++) salt[i] = (uint8_t)i;
    for (int i = 0; i < 10; i++) info[i] = (uint8_t)(0xf0 + i);
    const char *tc1 = "3cb25f25faacd57a90434f64d0362f2a2d2d0a90cf1a5a4c5db02d56ecc4c5bf34007208d5b887185865";
    for (int i = 0; i < 42; i++) sscanf(tc1 + 2 * i, "%2hhx", &want42[i]);
    CHECK(wire_hkdf_sha256(salt, 13, ikm, 22, info, 10, okm, 42) == 0 && !memcmp(okm, want42, 42), "HKDF RFC 5869 case 1");
    const char *tc3 = "8da4e775a563c18f715f802a063c5a31b8a11f5c5ee1879ec3454e5f3c738d2d9d201395faa4b61a96c8";
    for (int i = 0; i < 42; i++) sscanf(tc3 + 2 * i, "%2hhx", &want42[i]);
    CHECK(wire_hkdf_sha256(NULL, 0, ikm, 22, NULL, 0, okm, 42) == 0 && !memcmp(okm, want42, 42), "HKDF RFC 5869 case 3");
    CHECK(wire_hkdf_sha256(salt, 13, ikm, 22, info, 10, okm, 255 * 32 + 1) < 0, "HKDF output limit");
    uint8_t r1[32], r2[32];
    CHECK(wire_random(r1, 32) == 0 && wire_random(r2, 32) == 0 && memcmp(r1, r2, 32) != 0, "random");
}

/* ==== Payloads ==== */

/* Every strict prefix and one extra byte must be refused. */
typedef int (*decode_fn)(const uint8_t *p, size_t n, void *out, char *err, size_t errlen);

static int all_truncations_fail(decode_fn fn, const uint8_t *p, size_t n, void *out) {
    char err[512];
    uint8_t *copy = malloc(n + 1);
    memcpy(copy, p, n);
    copy[n] = 0;
    int bad = 0;
    for (size_t k = 0; k < n; k++) {
        /* A fresh heap block of exactly k bytes lets ASan catch overreads. */
        uint8_t *q = malloc(k ? k : 1);
        memcpy(q, p, k);
        if (fn(q, k, out, err, sizeof err) == 0) bad++;
        free(q);
    }
    if (fn(copy, n + 1, out, err, sizeof err) == 0) bad++;
    free(copy);
    return bad;
}

static void test_hello(void) {
    wire_hello h, d;
    memset(&h, 0, sizeof h);
    h.role = WIRE_ROLE_PREFILL;
    h.caps = WIRE_CAP_ZSTD | WIRE_CAP_Q8_0;
    for (int i = 0; i < 32; i++) { h.nonce[i] = (uint8_t)i; h.fingerprint[i] = (uint8_t)(i * 7); }
    h.kv_dtype = GGML_TYPE_F16;
    strcpy(h.node_id, "prefill-1");
    strcpy(h.model_desc, "qwen3-mini-Q8_0.gguf (qwen3, 4 layers, n_embd 256, Q8_0)");
    wire_buf b = { 0 };
    char err[512];
    CHECK(wire_encode_hello(&b, &h) == 0 && b.len == WIRE_HELLO_BYTES, "hello encode %zu", b.len);
    CHECK(wire_decode_hello(b.data, b.len, &d, err, sizeof err) == 0, "hello decode: %s", err);
    CHECK(d.role == h.role && d.caps == h.caps && d.kv_dtype == h.kv_dtype &&
          !memcmp(d.nonce, h.nonce, 32) && !memcmp(d.fingerprint, h.fingerprint, 32) &&
          !strcmp(d.node_id, h.node_id) && !strcmp(d.model_desc, h.model_desc), "hello round trip");
    CHECK(all_truncations_fail((decode_fn)wire_decode_hello, b.data, b.len, &d) == 0, "hello truncations");
    uint8_t m[WIRE_HELLO_BYTES];
    memcpy(m, b.data, sizeof m);
    m[0] = 9;
    CHECK(wire_decode_hello(m, sizeof m, &d, err, sizeof err) < 0 && strstr(err, "role"), "bad role: %s", err);
    memcpy(m, b.data, sizeof m);
    memset(m + 76, 'x', 64);   /* node_id without NUL */
    CHECK(wire_decode_hello(m, sizeof m, &d, err, sizeof err) < 0 && strstr(err, "NUL"), "unterminated id: %s", err);
    memcpy(m, b.data, sizeof m);
    m[77] = '\n';
    CHECK(wire_decode_hello(m, sizeof m, &d, err, sizeof err) < 0, "control char in id");
    memcpy(m, b.data, sizeof m);
    m[395] = 'z';               /* junk after the desc's NUL */
    CHECK(wire_decode_hello(m, sizeof m, &d, err, sizeof err) < 0, "non-zero padding");
    /* An over-long id is truncated by the encoder, still decodable. */
    memset(h.node_id, 'a', sizeof h.node_id);
    wire_buf_reset(&b);
    CHECK(wire_encode_hello(&b, &h) == 0 && wire_decode_hello(b.data, b.len, &d, err, sizeof err) == 0 &&
          strlen(d.node_id) == 63, "long node id truncated");
    wire_buf_free(&b);
}

static void test_auth(void) {
    wire_auth a, d;
    for (int i = 0; i < 32; i++) a.mac[i] = (uint8_t)(i * 3);
    wire_buf b = { 0 };
    char err[256];
    CHECK(wire_encode_auth(&b, &a) == 0 && b.len == 32, "auth encode");
    CHECK(wire_decode_auth(b.data, b.len, &d, err, sizeof err) == 0 && !memcmp(a.mac, d.mac, 32), "auth round trip");
    CHECK(all_truncations_fail((decode_fn)wire_decode_auth, b.data, b.len, &d) == 0, "auth truncations");
    wire_buf_free(&b);
}

static void test_request(void) {
    int32_t toks[7] = { 1, 2, 151643, 0, 99, 7, 123456 };
    wire_request r = { .start_pos = 2, .end_pos = 6, .wire_dtype = GGML_TYPE_Q8_0, .flags = 1, .n_tokens = 7 }, d;
    wire_buf b = { 0 };
    char err[256];
    CHECK(wire_encode_request(&b, &r, toks) == 0 && b.len == 20 + 28, "request encode");
    CHECK(wire_decode_request(b.data, b.len, &d, err, sizeof err) == 0, "request decode: %s", err);
    int same = d.start_pos == 2 && d.end_pos == 6 && d.wire_dtype == GGML_TYPE_Q8_0 && d.flags == 1 && d.n_tokens == 7;
    for (uint32_t i = 0; i < 7; i++) same &= wire_request_token(&d, i) == (uint32_t)toks[i];
    CHECK(same, "request round trip");
    CHECK(wire_request_token(&d, 7) == UINT32_MAX, "token index out of range");
    CHECK(all_truncations_fail((decode_fn)wire_decode_request, b.data, b.len, &d) == 0, "request truncations");
    uint8_t m[48];
    memcpy(m, b.data, 48);
    m[0] = 7;   /* start 7 > end 6 */
    CHECK(wire_decode_request(m, 48, &d, err, sizeof err) < 0 && strstr(err, "span"), "start > end: %s", err);
    memcpy(m, b.data, 48);
    m[4] = 8;   /* end 8 > 7 tokens */
    CHECK(wire_decode_request(m, 48, &d, err, sizeof err) < 0, "end > n_tokens");
    memcpy(m, b.data, 48);
    m[8] = 0;   /* F32 is not a wire dtype */
    CHECK(wire_decode_request(m, 48, &d, err, sizeof err) < 0 && strstr(err, "dtype"), "bad dtype: %s", err);
    memcpy(m, b.data, 48);
    m[12] = 8;   /* bits 1-2 are the ACT dtype of a layer-split request; bit 3 is unknown */
    CHECK(wire_decode_request(m, 48, &d, err, sizeof err) < 0, "unknown flags");
    m[12] = 4;
    CHECK(wire_decode_request(m, 48, &d, err, sizeof err) == 0 && d.flags == 4, "ACT dtype flag bits");
    memcpy(m, b.data, 48);
    m[20 + 3] = 0x80;   /* token id >= 2^31 */
    CHECK(wire_decode_request(m, 48, &d, err, sizeof err) < 0, "huge token id");
    memcpy(m, b.data, 48);
    m[16] = 0xFF; m[17] = 0xFF; m[18] = 0xFF; m[19] = 0xFF;   /* n_tokens 2^32-1 */
    CHECK(wire_decode_request(m, 48, &d, err, sizeof err) < 0, "n_tokens beyond payload");
    int32_t neg[2] = { 5, -1 };
    wire_request rn = { .start_pos = 0, .end_pos = 2, .wire_dtype = GGML_TYPE_F16, .n_tokens = 2 };
    wire_buf_reset(&b);
    CHECK(wire_encode_request(&b, &rn, neg) < 0, "negative token refused by encoder");
    wire_buf_free(&b);
}

static void test_kv_one(uint32_t dtype, uint32_t row_bytes, uint32_t n) {
    size_t span = (size_t)n * row_bytes;
    uint8_t *k = malloc(span), *v = malloc(span);
    for (size_t i = 0; i < span; i++) { k[i] = (uint8_t)t_rnd_u32(&rng_state); v[i] = (uint8_t)t_rnd_u32(&rng_state); }
    wire_kv kv = { .layer = 3, .pos0 = 17, .n = n, .dtype = dtype, .row_bytes = row_bytes, .k = k, .v = v }, d;
    wire_buf b = { 0 };
    char err[256];
    CHECK(wire_encode_kv(&b, &kv) == 0 && b.len == 20 + 2 * span, "kv encode %s", gguf_type_name(dtype));
    CHECK(wire_decode_kv(b.data, b.len, &d, err, sizeof err) == 0, "kv decode: %s", err);
    CHECK(d.layer == 3 && d.pos0 == 17 && d.n == n && d.dtype == dtype && d.row_bytes == row_bytes &&
          !memcmp(d.k, k, span) && !memcmp(d.v, v, span), "kv round trip %s", gguf_type_name(dtype));
    CHECK(all_truncations_fail((decode_fn)wire_decode_kv, b.data, b.len, &d) == 0, "kv truncations");
    free(k);
    free(v);
    wire_buf_free(&b);
}

static void test_kv(void) {
    test_kv_one(GGML_TYPE_F16, 2 * 64, 5);
    test_kv_one(GGML_TYPE_BF16, 2 * 128, 3);
    test_kv_one(GGML_TYPE_Q8_0, 34 * 4, 2);
    uint8_t rows[2 * 2 * 64];
    memset(rows, 1, sizeof rows);
    wire_kv kv = { .layer = 0, .pos0 = 0, .n = 2, .dtype = GGML_TYPE_F16, .row_bytes = 64, .k = rows, .v = rows }, d;
    wire_buf b = { 0 };
    char err[256];
    CHECK(wire_encode_kv(&b, &kv) == 0, "kv encode");
    uint8_t m[20 + 256];
    memcpy(m, b.data, sizeof m);
    m[12] = 0;   /* F32 */
    CHECK(wire_decode_kv(m, sizeof m, &d, err, sizeof err) < 0 && strstr(err, "dtype"), "kv bad dtype: %s", err);
    memcpy(m, b.data, sizeof m);
    m[12] = GGML_TYPE_Q8_0;   /* 64 is not a multiple of 34 */
    CHECK(wire_decode_kv(m, sizeof m, &d, err, sizeof err) < 0, "q8_0 row bytes");
    memcpy(m, b.data, sizeof m);
    m[16] = 63;   /* odd row bytes for f16 */
    CHECK(wire_decode_kv(m, sizeof m, &d, err, sizeof err) < 0, "odd f16 row bytes");
    memcpy(m, b.data, sizeof m);
    m[8] = 3;   /* n says 3, payload holds 2 */
    CHECK(wire_decode_kv(m, sizeof m, &d, err, sizeof err) < 0 && strstr(err, "size mismatch"), "kv n mismatch: %s", err);
    memcpy(m, b.data, sizeof m);
    m[8] = 0;
    CHECK(wire_decode_kv(m, sizeof m, &d, err, sizeof err) < 0, "kv n = 0");
    memcpy(m, b.data, sizeof m);
    m[8] = 0xFF; m[9] = 0xFF; m[10] = 0xFF; m[11] = 0xFF;
    m[16] = 0xFE; m[17] = 0xFF; m[18] = 0xFF; m[19] = 0xFF;   /* n*row_bytes would overflow 32 bits */
    CHECK(wire_decode_kv(m, sizeof m, &d, err, sizeof err) < 0, "kv size overflow");
    memcpy(m, b.data, sizeof m);
    m[4] = 0xFF; m[5] = 0xFF; m[6] = 0xFF; m[7] = 0x7F;   /* pos0 + n overflows int */
    CHECK(wire_decode_kv(m, sizeof m, &d, err, sizeof err) < 0, "kv pos overflow");
    kv.dtype = GGML_TYPE_F32;
    wire_buf_reset(&b);
    CHECK(wire_encode_kv(&b, &kv) < 0, "encoder refuses F32 rows");
    wire_buf_free(&b);
}

static void test_done_error(void) {
    wire_done dn = { .n_positions = 99, .n_computed = 100, .prefill_ms = 12.5, .kv_bytes = 1ull << 40,
                     .wire_bytes = 123456789012ull }, dd;
    wire_buf b = { 0 };
    char err[600];
    CHECK(wire_encode_done(&b, &dn) == 0 && b.len == 32, "done encode");
    CHECK(wire_decode_done(b.data, b.len, &dd, err, sizeof err) == 0 && dd.n_positions == 99 &&
          dd.n_computed == 100 && dd.prefill_ms == 12.5 && dd.kv_bytes == dn.kv_bytes &&
          dd.wire_bytes == dn.wire_bytes, "done round trip");
    CHECK(all_truncations_fail((decode_fn)wire_decode_done, b.data, b.len, &dd) == 0, "done truncations");
    uint8_t m[32];
    memcpy(m, b.data, 32);
    memset(m + 8, 0xFF, 8);   /* NaN */
    CHECK(wire_decode_done(m, 32, &dd, err, sizeof err) < 0, "NaN prefill_ms");

    wire_error e = { .code = WERR_CHECKSUM }, ed;
    snprintf(e.message, sizeof e.message, "checksum mismatch in KV frame");
    wire_buf_reset(&b);
    CHECK(wire_encode_error(&b, &e) == 0 && b.len == 8 + strlen(e.message), "error encode");
    CHECK(wire_decode_error(b.data, b.len, &ed, err, sizeof err) == 0 && ed.code == WERR_CHECKSUM &&
          !strcmp(ed.message, e.message), "error round trip");
    CHECK(all_truncations_fail((decode_fn)wire_decode_error, b.data, b.len, &ed) == 0, "error truncations");
    memset(e.message, 'x', sizeof e.message - 1);
    e.message[sizeof e.message - 1] = 0;
    wire_buf_reset(&b);
    CHECK(wire_encode_error(&b, &e) == 0 && b.len == 8 + WIRE_ERROR_MAX_MSG, "longest message");
    CHECK(wire_decode_error(b.data, b.len, &ed, err, sizeof err) == 0 && strlen(ed.message) == 511, "longest decodes");
    uint8_t big[8 + 600];
    memset(big, 'y', sizeof big);
    big[0] = 1; big[1] = big[2] = big[3] = 0;
    big[4] = 600 & 0xFF; big[5] = 600 >> 8; big[6] = big[7] = 0;
    CHECK(wire_decode_error(big, sizeof big, &ed, err, sizeof err) < 0, "message over 511 bytes");
    uint8_t z[12] = { 0, 0, 0, 0, 4, 0, 0, 0, 'a', 'b', 'c', 'd' };
    CHECK(wire_decode_error(z, 12, &ed, err, sizeof err) < 0, "code 0");
    uint8_t c[12] = { 2, 0, 0, 0, 4, 0, 0, 0, 'a', '\033', 'c', 0 };
    CHECK(wire_decode_error(c, 12, &ed, err, sizeof err) < 0, "NUL in message");
    c[11] = 'd';
    CHECK(wire_decode_error(c, 12, &ed, err, sizeof err) == 0 && !strcmp(ed.message, "a?cd"), "control chars masked");
    wire_buf_free(&b);
}

/* ==== Header ==== */

static void test_header(void) {
    wire_header h = { .version = WIRE_VERSION, .type = WIRE_KV, .flags = WIRE_FLAG_ZSTD, .len = 100,
                      .raw_len = 1000, .crc = 0xDEADBEEF, .req_id = 0x0102030405060708ull }, d;
    uint8_t b[WIRE_HEADER_BYTES], m[WIRE_HEADER_BYTES];
    char err[256];
    wire_header_encode(&h, b);
    CHECK(!memcmp(b, "TNDM", 4) && b[4] == 2 && b[24] == 8 && b[31] == 1, "header layout");
    CHECK(wire_header_decode(b, 1, &d, err, sizeof err) == 0 && d.type == WIRE_KV && d.flags == 1 && d.len == 100 &&
          d.raw_len == 1000 && d.crc == 0xDEADBEEF && d.req_id == h.req_id, "header round trip: %s", err);
    memcpy(m, b, sizeof m); m[0] = 'X';
    CHECK(wire_header_decode(m, 1, &d, err, sizeof err) < 0 && strstr(err, "magic"), "bad magic");
    memcpy(m, b, sizeof m); m[4] = 1;
    CHECK(wire_header_decode(m, 1, &d, err, sizeof err) < 0 &&
          strstr(err, "protocol version mismatch: peer speaks version 1, this node speaks 2"), "version 1: %s", err);
    memcpy(m, b, sizeof m); m[6] = 0;
    CHECK(wire_header_decode(m, 1, &d, err, sizeof err) < 0 && strstr(err, "unknown frame type"), "type 0");
    memcpy(m, b, sizeof m); m[6] = 13;   /* 10 is ACT (layer-split prefill), 11 and 12 DRAFT(S) */
    CHECK(wire_header_decode(m, 1, &d, err, sizeof err) < 0, "type 13");
    memcpy(m, b, sizeof m); m[8] = 3;
    CHECK(wire_header_decode(m, 1, &d, err, sizeof err) < 0 && strstr(err, "flags"), "unknown flag");
    /* Sealed: len counts the tag; uncompressed means raw_len = len - 16. */
    h.flags = 0;
    wire_header_encode(&h, m);
    CHECK(wire_header_decode(m, 1, &d, err, sizeof err) < 0 && strstr(err, "raw_len"), "raw_len != len - tag");
    h.len = 116; h.raw_len = 100;
    wire_header_encode(&h, m);
    CHECK(wire_header_decode(m, 1, &d, err, sizeof err) == 0, "uncompressed sealed frame: %s", err);
    h.len = 15; h.raw_len = 0;
    wire_header_encode(&h, m);
    CHECK(wire_header_decode(m, 1, &d, err, sizeof err) < 0, "shorter than a tag");
    h.raw_len = WIRE_MAX_PAYLOAD + 1; h.len = h.raw_len + WIRE_TAG_BYTES;
    wire_header_encode(&h, m);
    CHECK(wire_header_decode(m, 1, &d, err, sizeof err) < 0 && strstr(err, "too large"), "oversized");
    h.raw_len = WIRE_MAX_PAYLOAD; h.len = h.raw_len + WIRE_TAG_BYTES;
    wire_header_encode(&h, m);
    CHECK(wire_header_decode(m, 1, &d, err, sizeof err) == 0, "largest KV ok");
    h.type = WIRE_CANCEL;
    h.raw_len = 1; h.len = 17;
    wire_header_encode(&h, m);
    CHECK(wire_header_decode(m, 1, &d, err, sizeof err) < 0, "CANCEL with payload");
    h.raw_len = 0; h.len = 16;
    wire_header_encode(&h, m);
    CHECK(wire_header_decode(m, 1, &d, err, sizeof err) == 0, "sealed CANCEL is just a tag");
    h.type = WIRE_KV; h.flags = WIRE_FLAG_ZSTD; h.len = 16; h.raw_len = 10;
    wire_header_encode(&h, m);
    CHECK(wire_header_decode(m, 1, &d, err, sizeof err) < 0, "empty compressed payload");
    h.type = WIRE_HELLO; h.flags = 0; h.len = WIRE_HELLO_BYTES + 16; h.raw_len = WIRE_HELLO_BYTES; h.req_id = 0;
    wire_header_encode(&h, m);
    CHECK(wire_header_decode(m, 1, &d, err, sizeof err) < 0 && strstr(err, "after the handshake"), "HELLO once sealed");

    /* Before the handshake: HELLO, AUTH and ERROR only, small, plain, req_id 0. */
    h.len = h.raw_len = WIRE_HELLO_BYTES;
    wire_header_encode(&h, m);
    CHECK(wire_header_decode(m, 0, &d, err, sizeof err) == 0, "plain HELLO: %s", err);
    h.len = h.raw_len = WIRE_HELLO_BYTES + 1;
    wire_header_encode(&h, m);
    CHECK(wire_header_decode(m, 0, &d, err, sizeof err) < 0, "HELLO over its size");
    const uint16_t banned[] = { WIRE_REQUEST, WIRE_KV, WIRE_DONE, WIRE_CANCEL, WIRE_PING, WIRE_PONG };
    int refused = 0;
    for (int i = 0; i < 6; i++) {
        wire_header x = { .version = WIRE_VERSION, .type = banned[i], .len = 0, .raw_len = 0 };
        wire_header_encode(&x, m);
        refused += wire_header_decode(m, 0, &d, err, sizeof err) < 0 && strstr(err, "before the handshake") != NULL;
    }
    CHECK(refused == 6, "request/data frames refused before the handshake (%d of 6)", refused);
    wire_header z = { .version = WIRE_VERSION, .type = WIRE_ERROR, .flags = WIRE_FLAG_ZSTD, .len = 100, .raw_len = 500 };
    wire_header_encode(&z, m);
    CHECK(wire_header_decode(m, 0, &d, err, sizeof err) < 0 && strstr(err, "compression"), "no zstd before auth: %s", err);
    z.flags = 0; z.len = z.raw_len = 20; z.req_id = 5;
    wire_header_encode(&z, m);
    CHECK(wire_header_decode(m, 0, &d, err, sizeof err) < 0 && strstr(err, "req_id"), "req_id 0 before auth");
    CHECK(!strcmp(wire_type_name(WIRE_KV), "KV") && !strcmp(wire_type_name(77), "unknown"), "type names");
}

/* ==== Framed I/O ==== */

/* Session keys for connections that skip the handshake: 32 bytes each,
 * +1 for the literal's terminator (no part of the key; an array of exactly
 * 32 drops it, which gcc 15 and clang 22 warn about in -Wextra). */
static const uint8_t key_ab[WIRE_KEY_BYTES + 1] = "0123456789abcdef0123456789abcdef";
static const uint8_t key_ba[WIRE_KEY_BYTES + 1] = "fedcba9876543210fedcba9876543210";

/* A connected AF_UNIX pair, close-on-exec; where there are no socket type
 * flags (macOS) by fcntl, with SO_NOSIGPIPE as plat_socket sets it, since
 * wire.c's sends there rely on it (PLAT_MSG_NOSIGNAL is 0). */
static int tw_socketpair(int sv[2]) {
#if defined(SOCK_CLOEXEC)
    return socketpair(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0, sv);
#else
    if (socketpair(AF_UNIX, SOCK_STREAM, 0, sv)) return -1;
    for (int i = 0; i < 2; i++) {
        fcntl(sv[i], F_SETFD, FD_CLOEXEC);
#if defined(SO_NOSIGPIPE)
        int one = 1;
        setsockopt(sv[i], SOL_SOCKET, SO_NOSIGPIPE, &one, sizeof one);
#endif
    }
    return 0;
#endif
}

static void seal_pair(wire_conn *a, wire_conn *b) {
    char err[256];
    if (wire_conn_seal(a, key_ab, key_ba, err, sizeof err) || wire_conn_seal(b, key_ba, key_ab, err, sizeof err)) {
        fprintf(stderr, "seal: %s\n", err);
        exit(1);
    }
}

/* A connected, sealed pair (as after a handshake). */
static void pair(wire_conn *a, wire_conn *b, int timeout_ms) {
    int sv[2];
    if (tw_socketpair(sv)) { perror("socketpair"); exit(1); }
    wire_conn_init(a, sv[0], timeout_ms);
    wire_conn_init(b, sv[1], timeout_ms);
    seal_pair(a, b);
}

/* A connected pair still in handshake mode. */
static void plain_pair(wire_conn *a, wire_conn *b, int timeout_ms) {
    int sv[2];
    if (tw_socketpair(sv)) { perror("socketpair"); exit(1); }
    wire_conn_init(a, sv[0], timeout_ms);
    wire_conn_init(b, sv[1], timeout_ms);
}

typedef struct {
    wire_conn *c;
    int n;
    size_t len;
    int rc;
} sender_arg;

static void *sender_main(void *p) {
    sender_arg *s = p;
    uint8_t *buf = malloc(s->len);
    char err[256];
    s->rc = 0;
    for (int i = 0; i < s->n && !s->rc; i++) {
        memset(buf, i, s->len);
        s->rc = wire_send(s->c, WIRE_PING + (i % 2) * 0, (uint64_t)i, 0, buf, s->len > 64 ? 64 : s->len, err, sizeof err);
        wire_kv kv = { .layer = (uint32_t)i, .pos0 = 0, .n = (uint32_t)(s->len / 256), .dtype = GGML_TYPE_F16,
                       .row_bytes = 128, .k = buf, .v = buf };
        wire_buf b = { 0 };
        wire_encode_kv(&b, &kv);
        if (!s->rc) s->rc = wire_send(s->c, WIRE_KV, (uint64_t)i, i % 2 ? WIRE_FLAG_ZSTD : 0, b.data, b.len, err, sizeof err);
        wire_buf_free(&b);
    }
    free(buf);
    return NULL;
}

static void test_send_recv(void) {
    wire_conn a, b;
    wire_header h;
    char err[512];
    pair(&a, &b, 2000);

    /* Small frame, no compression. */
    CHECK(wire_send(&a, WIRE_PING, 5, 0, "hello", 5, err, sizeof err) == 0, "send ping: %s", err);
    CHECK(wire_recv(&b, &h, err, sizeof err) == 0 && h.type == WIRE_PING && h.req_id == 5 && b.rx.len == 5 &&
          !memcmp(b.rx.data, "hello", 5), "recv ping: %s", err);
    CHECK(a.bytes_out == 53 && b.bytes_in == 53, "byte counters (32 + 5 + 16-byte tag) %llu %llu", (unsigned long long)a.bytes_out,
          (unsigned long long)b.bytes_in);
    CHECK(wire_send(&a, WIRE_CANCEL, 9, 0, NULL, 0, err, sizeof err) == 0 &&
          wire_recv(&b, &h, err, sizeof err) == 0 && h.type == WIRE_CANCEL && h.len == WIRE_TAG_BYTES &&
          b.rx.len == 0 && h.req_id == 9, "empty frame (a tag only)");

    /* Compressible KV frame with zstd: sent compressed, received identical. */
    size_t n = 300000;
    uint8_t *big = malloc(n);
    for (size_t i = 0; i < n; i++) big[i] = (uint8_t)((i / 64) & 7);
    uint64_t out0 = a.bytes_out;
    CHECK(wire_send(&a, WIRE_KV, 1, WIRE_FLAG_ZSTD, big, n, err, sizeof err) == 0, "send zstd: %s", err);
    CHECK(wire_recv(&b, &h, err, sizeof err) == 0 && (h.flags & WIRE_FLAG_ZSTD) && h.raw_len == n && h.len < n / 4 &&
          b.rx.len == n && !memcmp(b.rx.data, big, n), "recv zstd: %s", err);
    CHECK(a.bytes_out - out0 == 32 + h.len, "compressed bytes counted");
    /* Incompressible: the flag is dropped. (Kept under the socket buffer
     * size: this thread is both sender and receiver.) */
    n = 60000;
    for (size_t i = 0; i < n; i++) big[i] = (uint8_t)t_rnd_u32(&rng_state);
    CHECK(wire_send(&a, WIRE_KV, 2, WIRE_FLAG_ZSTD, big, n, err, sizeof err) == 0 &&
          wire_recv(&b, &h, err, sizeof err) == 0 && !(h.flags & WIRE_FLAG_ZSTD) && h.len == n + WIRE_TAG_BYTES &&
          !memcmp(b.rx.data, big, n), "incompressible sent raw");
    CHECK(wire_send(&a, WIRE_HELLO, 0, 0, big, WIRE_HELLO_BYTES + 1, err, sizeof err) < 0, "oversized send refused");

    /* A corrupted payload: valid header, wrong CRC. */
    wire_header bh = { .version = WIRE_VERSION, .type = WIRE_KV, .len = 100, .raw_len = 100 - WIRE_TAG_BYTES,
                       .crc = wire_crc32c(0, big, 100) ^ 0x10, .req_id = 3 };
    uint8_t hb[WIRE_HEADER_BYTES];
    wire_header_encode(&bh, hb);
    CHECK(write(a.fd, hb, sizeof hb) == sizeof hb && write(a.fd, big, 100) == 100, "raw write");
    CHECK(wire_recv(&b, &h, err, sizeof err) < 0 && strstr(err, "checksum mismatch in KV frame") &&
          b.rx_err == WERR_CHECKSUM, "bad crc: %s", err);

    /* zstd payload, properly sealed, but garbage inside. */
    memset(big, 0x55, 100);
    CHECK(wire_send_raw(&a, WIRE_KV, 3, WIRE_FLAG_ZSTD, 1000, big, 100, NULL, NULL, err, sizeof err) == 0, "raw send");
    CHECK(wire_recv(&b, &h, err, sizeof err) < 0 && strstr(err, "zstd") && b.rx_err == WERR_PROTOCOL,
          "garbage zstd: %s", err);

    /* A real zstd frame whose raw_len lies (sealed, so only the sender can lie). */
    for (size_t i = 0; i < 5000; i++) big[i] = (uint8_t)(i % 3);
    uint8_t *zf = malloc(ZSTD_compressBound(5000));
    size_t zl = ZSTD_compress(zf, ZSTD_compressBound(5000), big, 5000, 1);
    CHECK(!ZSTD_isError(zl) && wire_send_raw(&a, WIRE_KV, 4, WIRE_FLAG_ZSTD, 4999, zf, zl, NULL, NULL, err, sizeof err) == 0,
          "raw zstd send");
    CHECK(wire_recv(&b, &h, err, sizeof err) < 0 && strstr(err, "content size"), "raw_len lie: %s", err);
    CHECK(wire_send_raw(&a, WIRE_KV, 5, WIRE_FLAG_ZSTD, 5000, zf, zl, NULL, NULL, err, sizeof err) == 0 &&
          wire_recv(&b, &h, err, sizeof err) == 0 && b.rx.len == 5000 && !memcmp(b.rx.data, big, 5000),
          "the same frame with the true raw_len: %s", err);
    free(zf);

    /* Garbage header. */
    CHECK(write(a.fd, "GET / HTTP/1.1\r\nHost: x\r\n\r\n.....", 32) == 32, "raw write");
    CHECK(wire_recv(&b, &h, err, sizeof err) < 0 && strstr(err, "magic"), "http request: %s", err);
    wire_conn_close(&a);
    wire_conn_close(&b);
    free(big);

    /* Concurrent full-duplex traffic: each end sends while receiving. */
    pair(&a, &b, 5000);
    sender_arg sa = { &a, 40, 200000, -1 }, sb = { &b, 40, 200000, -1 };
    pthread_t ta, tb;
    pthread_create(&ta, NULL, sender_main, &sa);
    pthread_create(&tb, NULL, sender_main, &sb);
    int ok_a = 1, ok_b = 1, ok;
    for (int i = 0; i < 80; i++) {
        ok_a &= wire_recv(&a, &h, err, sizeof err) == 0 && h.req_id == (uint64_t)(i / 2);
        if (ok_a && h.type == WIRE_KV) {
            wire_kv kv;
            ok_a &= wire_decode_kv(a.rx.data, a.rx.len, &kv, err, sizeof err) == 0 && kv.layer == (uint32_t)(i / 2);
        }
        ok_b &= wire_recv(&b, &h, err, sizeof err) == 0 && h.req_id == (uint64_t)(i / 2);
    }
    pthread_join(ta, NULL);
    pthread_join(tb, NULL);
    CHECK(ok_a && ok_b && sa.rc == 0 && sb.rc == 0, "full duplex traffic: %s", err);
    /* A frame bigger than the receive buffer's first growth step (1 MiB). */
    sender_arg sl = { &a, 2, 3u << 20, -1 };
    pthread_create(&ta, NULL, sender_main, &sl);
    ok = 1;
    for (int i = 0; i < 4; i++) {
        ok &= wire_recv(&b, &h, err, sizeof err) == 0;
        if (ok && h.type == WIRE_KV) {
            wire_kv kv;
            ok &= wire_decode_kv(b.rx.data, b.rx.len, &kv, err, sizeof err) == 0 && kv.n == (3u << 20) / 256 &&
                  kv.k[kv.n * 128 - 1] == (uint8_t)kv.layer && kv.v[0] == (uint8_t)kv.layer;
        }
    }
    pthread_join(ta, NULL);
    CHECK(ok && sl.rc == 0, "3 MiB frames: %s", err);
    /* Several senders on one conn: frames stay whole. */
    sender_arg s1 = { &a, 20, 50000, -1 }, s2 = { &a, 20, 50000, -1 };
    pthread_create(&ta, NULL, sender_main, &s1);
    pthread_create(&tb, NULL, sender_main, &s2);
    ok = 1;
    for (int i = 0; i < 80; i++) ok &= wire_recv(&b, &h, err, sizeof err) == 0;
    pthread_join(ta, NULL);
    pthread_join(tb, NULL);
    CHECK(ok && s1.rc == 0 && s2.rc == 0, "two senders interleave whole frames: %s", err);

    /* Timeouts: nothing at all, then half a frame. */
    b.timeout_ms = 300;
    double t0 = now_ms();
    CHECK(wire_recv(&b, &h, err, sizeof err) < 0 && strstr(err, "timed out"), "silent peer: %s", err);
    double dt = now_ms() - t0;
    CHECK(dt >= 250 && dt < 1500, "timeout took %.0f ms", dt);
    uint8_t half[48];
    wire_header ph = { .version = WIRE_VERSION, .type = WIRE_KV, .len = 1000 + WIRE_TAG_BYTES, .raw_len = 1000 };
    wire_header_encode(&ph, half);
    memset(half + 32, 0, 16);
    CHECK(write(a.fd, half, sizeof half) == sizeof half, "half frame written");
    t0 = now_ms();
    CHECK(wire_recv(&b, &h, err, sizeof err) < 0 && strstr(err, "timed out"), "half frame: %s", err);
    dt = now_ms() - t0;
    CHECK(dt >= 250 && dt < 1500, "half-frame timeout took %.0f ms", dt);
    /* Peer closes mid-frame, then at a boundary. */
    wire_conn c2, d2;
    pair(&c2, &d2, 2000);
    CHECK(write(c2.fd, half, 40) == 40, "partial");
    wire_conn_close(&c2);
    CHECK(wire_recv(&d2, &h, err, sizeof err) < 0 && strstr(err, "closed by peer"), "close mid-frame: %s", err);
    wire_conn_close(&d2);
    pair(&c2, &d2, 2000);
    wire_conn_close(&c2);
    CHECK(wire_recv(&d2, &h, err, sizeof err) < 0 && !strcmp(err, "connection closed by peer"), "clean close: %s", err);
    CHECK(wire_send(&d2, WIRE_PING, 0, 0, "x", 1, err, sizeof err) < 0, "send to closed peer fails, no SIGPIPE");
    wire_conn_close(&d2);
    wire_conn_close(&d2);   /* idempotent */
    /* Shutdown wakes a blocked receiver. */
    wire_conn_shutdown(&a);
    CHECK(wire_recv(&a, &h, err, sizeof err) < 0, "recv after shutdown");
    wire_conn_close(&a);
    wire_conn_close(&b);
}

/* ==== Seal: forged, replayed, reordered, dropped frames ==== */

static void flip_and_fix_crc(uint8_t *frame, size_t n, void *ud) {
    size_t at = *(size_t *)ud;
    frame[at] ^= 0x01;
    uint32_t crc = wire_crc32c(0, frame + WIRE_HEADER_BYTES, n - WIRE_HEADER_BYTES);
    for (int i = 0; i < 4; i++) frame[20 + i] = (uint8_t)(crc >> (8 * i));
}

/* Reads exactly the frames' bytes sent so far from the far end, raw. */
static size_t read_raw(int fd, uint8_t *buf, size_t want) {
    size_t got = 0;
    while (got < want) {
        ssize_t r = read(fd, buf + got, want - got);
        if (r <= 0) break;
        got += (size_t)r;
    }
    return got;
}

static void test_seal(void) {
    wire_conn a, b;
    wire_header h;
    char err[512];
    uint8_t kv[4000];
    for (size_t i = 0; i < sizeof kv; i++) kv[i] = (uint8_t)t_rnd_u32(&rng_state);
    /* Flip one bit anywhere (payload, tag, or authenticated header field)
     * and make the CRC right again: the tag catches it. */
    size_t spots[] = { WIRE_HEADER_BYTES + 10, WIRE_HEADER_BYTES + sizeof kv + 3, 24 /* req_id */, 6 /* type */ };
    const char *names[] = { "payload byte", "tag byte", "req_id in the header", "type in the header" };
    for (int i = 0; i < 4; i++) {
        pair(&a, &b, 1000);
        CHECK(wire_send_raw(&a, WIRE_KV, 7, 0, sizeof kv, kv, sizeof kv, flip_and_fix_crc, &spots[i], err, sizeof err) == 0,
              "send tampered");
        int r = wire_recv(&b, &h, err, sizeof err);
        CHECK(r < 0 && (strstr(err, "authentication tag mismatch") || i == 3) && b.rx_err != 0 &&
              (i == 3 || b.rx_err == WERR_AUTH), "%s flipped, CRC fixed: refused (%s)", names[i], err);
        wire_conn_close(&a);
        wire_conn_close(&b);
    }
    /* Replay, reorder, drop: capture sealed frames off the socket and feed
     * them back in another order. */
    uint8_t f[2][WIRE_HEADER_BYTES + 64 + WIRE_TAG_BYTES];
    size_t fl = WIRE_HEADER_BYTES + 5 + WIRE_TAG_BYTES;
    const char *how[] = { "replayed", "reordered", "dropped" };
    for (int t = 0; t < 3; t++) {
        pair(&a, &b, 500);
        int ok = wire_send(&a, WIRE_PING, 1, 0, "first", 5, err, sizeof err) == 0 &&
                 wire_send(&a, WIRE_PING, 2, 0, "other", 5, err, sizeof err) == 0 &&
                 read_raw(b.fd, f[0], fl) == fl && read_raw(b.fd, f[1], fl) == fl;
        CHECK(ok, "capture two sealed frames");
        /* the far end of b's socket is a's fd: what we write there, b reads */
        if (t == 0) ok = write(a.fd, f[0], fl) == (ssize_t)fl && write(a.fd, f[0], fl) == (ssize_t)fl;
        if (t == 1) ok = write(a.fd, f[1], fl) == (ssize_t)fl && write(a.fd, f[0], fl) == (ssize_t)fl;
        if (t == 2) ok = write(a.fd, f[1], fl) == (ssize_t)fl;
        int r1 = wire_recv(&b, &h, err, sizeof err);
        int r2 = t == 0 && r1 == 0 ? wire_recv(&b, &h, err, sizeof err) : r1;
        CHECK(ok && r2 < 0 && strstr(err, "authentication tag mismatch") && (t != 0 || r1 == 0),
              "%s frame refused: %s", how[t], err);
        wire_conn_close(&a);
        wire_conn_close(&b);
    }
    /* Different keys (an attacker's guess) open nothing. */
    int sv[2];
    tw_socketpair(sv);
    wire_conn_init(&a, sv[0], 500);
    wire_conn_init(&b, sv[1], 500);
    wire_conn_seal(&a, key_ab, key_ba, err, sizeof err);
    wire_conn_seal(&b, key_ab, key_ba, err, sizeof err);   /* b expects a's frames under the wrong key */
    CHECK(wire_send(&a, WIRE_PING, 1, 0, "x", 1, err, sizeof err) == 0 && wire_recv(&b, &h, err, sizeof err) < 0 &&
          strstr(err, "authentication tag"), "wrong key: %s", err);
    wire_conn_close(&a);
    wire_conn_close(&b);
    /* The plaintext is not on the wire. */
    pair(&a, &b, 500);
    const char *secret_text = "the prompt's tokens are private";
    uint8_t raw[128];
    size_t rl = WIRE_HEADER_BYTES + strlen(secret_text) + WIRE_TAG_BYTES;
    CHECK(wire_send(&a, WIRE_PING, 1, 0, secret_text, strlen(secret_text), err, sizeof err) == 0 &&
          read_raw(b.fd, raw, rl) == rl && !memmem(raw, rl, "prompt", 6), "payload is encrypted");
    wire_conn_close(&a);
    wire_conn_close(&b);
    /* Before the handshake nothing but handshake frames gets through, and
     * nothing is decompressed. */
    plain_pair(&a, &b, 500);
    CHECK(wire_send(&a, WIRE_PING, 0, 0, "x", 1, err, sizeof err) == 0 && wire_recv(&b, &h, err, sizeof err) < 0 &&
          strstr(err, "before the handshake"), "PING before the handshake: %s", err);
    wire_conn_close(&a);
    wire_conn_close(&b);
    plain_pair(&a, &b, 500);
    CHECK(wire_send(&a, WIRE_ERROR, 0, WIRE_FLAG_ZSTD, kv, 200, err, sizeof err) == 0 &&
          wire_recv(&b, &h, err, sizeof err) == 0 && !(h.flags & WIRE_FLAG_ZSTD), "no compression before the handshake");
    wire_conn_close(&a);
    wire_conn_close(&b);
}

/* ==== TCP ==== */

typedef struct {
    int lfd, rc;
    char err[256];
} acceptor_arg;

static void *acceptor_main(void *p) {
    acceptor_arg *a = p;
    int fd = wire_accept(a->lfd, 3000, a->err, sizeof a->err);
    a->rc = -1;
    if (fd < 0) return NULL;
    wire_conn c;
    wire_conn_init(&c, fd, 3000);
    wire_conn_seal(&c, key_ba, key_ab, a->err, sizeof a->err);
    wire_header h;
    if (wire_recv(&c, &h, a->err, sizeof a->err) == 0 &&
        wire_send(&c, WIRE_PONG, h.req_id, 0, c.rx.data, c.rx.len, a->err, sizeof a->err) == 0)
        a->rc = 0;
    wire_conn_close(&c);
    return NULL;
}

static void test_tcp(void) {
    char err[256];
    const char *addrs[] = { ":0", "127.0.0.1:0", "0", "[::1]:0", "*:0" };
    for (int i = 0; i < 5; i++) {
        int lfd = wire_listen(addrs[i], err, sizeof err);
        if (lfd < 0 && i == 3) { t_skip_what("ipv6", "IPv6 loopback unavailable (%s)", err); continue; }
        CHECK(lfd >= 0, "listen %s: %s", addrs[i], err);
        if (lfd < 0) continue;
        int port = wire_local_port(lfd);
        CHECK(port > 0, "bound port");
        acceptor_arg aa = { lfd, -1, "" };
        pthread_t t;
        pthread_create(&t, NULL, acceptor_main, &aa);
        char hp[64];
        snprintf(hp, sizeof hp, i == 3 ? "[::1]:%d" : "localhost:%d", port);
        if (i == 0) snprintf(hp, sizeof hp, "%d", port);
        int fd = wire_connect(hp, 2000, err, sizeof err);
        CHECK(fd >= 0, "connect %s: %s", hp, err);
        if (fd >= 0) {
            wire_conn c;
            wire_header h;
            wire_conn_init(&c, fd, 3000);
            wire_conn_seal(&c, key_ab, key_ba, err, sizeof err);
            CHECK(wire_send(&c, WIRE_PING, 77, 0, "abc", 3, err, sizeof err) == 0 &&
                  wire_recv(&c, &h, err, sizeof err) == 0 && h.type == WIRE_PONG && h.req_id == 77 &&
                  c.rx.len == 3 && !memcmp(c.rx.data, "abc", 3), "tcp ping-pong: %s", err);
            wire_conn_close(&c);
        }
        pthread_join(t, NULL);
        CHECK(aa.rc == 0, "acceptor: %s", aa.err);
        /* Nothing connects: accept times out with -2. */
        CHECK(wire_accept(lfd, 100, err, sizeof err) == -2, "accept timeout");
        close(lfd);
        if (i == 1) {
            CHECK(wire_connect(hp, 1000, err, sizeof err) < 0 && strstr(err, "cannot connect"), "refused: %s", err);
        }
    }
    const char *bad[] = { "", "host:", "host:99999", "1:2:3", "[::1]", "host:12ab" };
    for (int i = 0; i < 6; i++)
        CHECK(wire_listen(bad[i], err, sizeof err) < 0, "bad address '%s' refused", bad[i]);
}

/* ==== Handshake ==== */

typedef struct {
    wire_conn *c;
    wire_hello mine, peer;
    const char *secret;
    int rc;
    int talked;                  /* after a good handshake: a sealed PING each way arrived */
    char err[512];
} hs_arg;

static void *hs_main(void *p) {
    hs_arg *a = p;
    a->rc = wire_handshake(a->c, &a->mine, a->secret, a->secret ? strlen(a->secret) : 0, &a->peer, a->err,
                           sizeof a->err);
    a->talked = 0;
    if (a->rc == 0 && a->c->sealed) {
        wire_header h;
        char e[256];
        a->talked = wire_send(a->c, WIRE_PING, 1, 0, a->mine.node_id, strlen(a->mine.node_id), e, sizeof e) == 0 &&
                    wire_recv(a->c, &h, e, sizeof e) == 0 && h.type == WIRE_PING &&
                    a->c->rx.len == strlen(a->peer.node_id) && !memcmp(a->c->rx.data, a->peer.node_id, a->c->rx.len);
    }
    return NULL;
}

static void hello_init(wire_hello *h, uint32_t role, const char *id, uint8_t fpbyte, const char *desc) {
    memset(h, 0, sizeof *h);
    h->role = role;
    h->caps = WIRE_CAP_ZSTD;
    memset(h->fingerprint, fpbyte, 32);
    h->kv_dtype = GGML_TYPE_F16;
    snprintf(h->node_id, sizeof h->node_id, "%s", id);
    snprintf(h->model_desc, sizeof h->model_desc, "%s", desc);
}

static void run_hs(hs_arg *x, hs_arg *y) {
    wire_conn a, b;
    plain_pair(&a, &b, 3000);
    x->c = &a;
    y->c = &b;
    pthread_t t1, t2;
    pthread_create(&t1, NULL, hs_main, x);
    pthread_create(&t2, NULL, hs_main, y);
    pthread_join(t1, NULL);
    pthread_join(t2, NULL);
    wire_conn_close(&a);
    wire_conn_close(&b);
}

/* A stranger without the secret talks to a responder (the prefill role):
 * whatever it sends, the responder never sends an AUTH. */
static void stranger_run(hs_arg *p, int variant, int *saw_auth, char *perr, size_t perrlen) {
    wire_conn a, b;
    plain_pair(&a, &b, 400);
    p->c = &a;
    pthread_t t;
    pthread_create(&t, NULL, hs_main, p);
    wire_header h;
    char err[512];
    *saw_auth = 0;
    if (wire_recv(&b, &h, err, sizeof err) == 0 && h.type == WIRE_HELLO) {
        wire_hello ph;
        wire_decode_hello(b.rx.data, b.rx.len, &ph, err, sizeof err);
        wire_hello me = ph;   /* reflect the responder's own HELLO ... */
        if (variant >= 1) me.role = WIRE_ROLE_DECODE;          /* ... as a decode node with its nonce */
        if (variant >= 2) wire_random(me.nonce, 32);            /* ... or a nonce of our choosing */
        wire_buf bb = { 0 };
        wire_encode_hello(&bb, &me);
        wire_send(&b, WIRE_HELLO, 0, 0, bb.data, bb.len, err, sizeof err);
        if (variant == 3) {   /* a guessed AUTH */
            uint8_t mac[32] = { 0 };
            wire_send(&b, WIRE_AUTH, 0, 0, mac, 32, err, sizeof err);
        }
        wire_buf_free(&bb);
        for (int i = 0; i < 4 && wire_recv(&b, &h, err, sizeof err) == 0; i++) *saw_auth |= h.type == WIRE_AUTH;
    }
    pthread_join(t, NULL);
    snprintf(perr, perrlen, "%s", p->err);
    wire_conn_close(&a);
    wire_conn_close(&b);
}

static void test_handshake_stranger(hs_arg *p) {
    const char *what[] = { "its own HELLO reflected", "its nonce reflected as a decode node",
                           "a stranger's nonce, then silence", "a stranger's nonce and a guessed AUTH" };
    const char *want[] = { "role", "nonce", "timed out", "authentication failed" };
    for (int v = 0; v < 4; v++) {
        int saw_auth;
        char perr[512];
        stranger_run(p, v, &saw_auth, perr, sizeof perr);
        CHECK(p->rc < 0 && !saw_auth && strstr(perr, want[v]),
              "responder given %s: no AUTH sent (%d), fails with '%s': %s", what[v], saw_auth, want[v], perr);
    }
}

static void test_handshake(void) {
    hs_arg p = { .secret = "correct horse" }, d = { .secret = "correct horse" };
    hello_init(&p.mine, WIRE_ROLE_PREFILL, "pf-1", 0xAB, "m.gguf (qwen3, 4 layers)");
    hello_init(&d.mine, WIRE_ROLE_DECODE, "dec-1", 0xAB, "m.gguf (qwen3, 4 layers)");
    run_hs(&p, &d);
    CHECK(p.rc == 0 && d.rc == 0, "handshake ok: '%s' '%s'", p.err, d.err);
    CHECK(!strcmp(p.peer.node_id, "dec-1") && !strcmp(d.peer.node_id, "pf-1") &&
          p.peer.role == WIRE_ROLE_DECODE && d.peer.caps == WIRE_CAP_ZSTD, "peer hello");
    CHECK(memcmp(p.peer.nonce, d.peer.nonce, 32) != 0, "fresh nonces");
    CHECK(p.talked && d.talked, "sealed frames flow both ways after the handshake");

    /* Wrong secret on one side: both fail, naming authentication. */
    d.secret = "battery staple";
    run_hs(&p, &d);
    CHECK(p.rc < 0 && d.rc < 0, "wrong secret refused by both");
    CHECK(strstr(p.err, "authentication failed: peer dec-1 does not know the shared secret") != NULL, "p: %s", p.err);
    CHECK(strstr(d.err, "authentication failed: peer pf-1") != NULL, "d: %s", d.err);
    /* No secret at all vs a secret. */
    d.secret = NULL;
    run_hs(&p, &d);
    CHECK(p.rc < 0 && d.rc < 0 && strstr(p.err, "authentication"), "empty secret refused: %s", p.err);
    d.secret = "correct horse";

    /* Different models: both fail and name both. */
    hello_init(&d.mine, WIRE_ROLE_DECODE, "dec-1", 0xCD, "other.gguf (llama, 2 layers)");
    run_hs(&p, &d);
    CHECK(p.rc < 0 && d.rc < 0, "model mismatch refused");
    CHECK(strstr(p.err, "model mismatch: this node serves m.gguf (qwen3, 4 layers) (fingerprint abababab") &&
          strstr(p.err, "peer serves other.gguf (llama, 2 layers) (fingerprint cdcdcdcd"), "p: %s", p.err);
    CHECK(strstr(d.err, "model mismatch") && strstr(d.err, "other.gguf") && strstr(d.err, "m.gguf"), "d: %s", d.err);

    /* Same model, different KV cache types. */
    hello_init(&d.mine, WIRE_ROLE_DECODE, "dec-1", 0xAB, "m.gguf (qwen3, 4 layers)");
    d.mine.kv_dtype = GGML_TYPE_BF16;
    run_hs(&p, &d);
    CHECK(p.rc < 0 && d.rc < 0 && strstr(p.err, "KV cache type mismatch") && strstr(p.err, "BF16"), "dtype: %s", p.err);
    d.mine.kv_dtype = GGML_TYPE_F16;

    /* Same role on both ends (reflection) is refused. */
    d.mine.role = WIRE_ROLE_PREFILL;
    run_hs(&p, &d);
    CHECK(p.rc < 0 && d.rc < 0 && strstr(p.err, "role"), "same role: %s", p.err);
    d.mine.role = WIRE_ROLE_DECODE;

    /* A silent peer: the handshake deadline fires. */
    wire_conn a, b;
    plain_pair(&a, &b, 300);
    p.c = &a;
    double t0 = now_ms();
    hs_main(&p);
    CHECK(p.rc < 0 && strstr(p.err, "timed out") && now_ms() - t0 < 2000, "silent peer: %s", p.err);
    wire_conn_close(&a);
    /* A peer that hangs up. */
    plain_pair(&a, &b, 1000);
    wire_conn_close(&b);
    p.c = &a;
    hs_main(&p);
    CHECK(p.rc < 0 && strstr(p.err, "closed"), "closed peer: %s", p.err);
    wire_conn_close(&a);
    /* A peer speaking a future protocol version. */
    plain_pair(&a, &b, 1000);
    wire_header vh = { .version = WIRE_VERSION + 1, .type = WIRE_HELLO, .len = 0, .raw_len = 0 };
    uint8_t vb[WIRE_HEADER_BYTES];
    wire_header_encode(&vh, vb);
    CHECK(write(b.fd, vb, sizeof vb) == sizeof vb, "raw write");
    p.c = &a;
    hs_main(&p);
    CHECK(p.rc < 0 && strstr(p.err, "protocol version mismatch: peer speaks version 3, this node speaks 2"),
          "version: %s", p.err);
    wire_header eh;
    char e3[512];
    b.timeout_ms = 1000;
    int saw_error = 0;
    for (int i = 0; i < 3 && wire_recv(&b, &eh, e3, sizeof e3) == 0; i++) saw_error |= eh.type == WIRE_ERROR;
    CHECK(saw_error, "the old node told the new one why");
    wire_conn_close(&a);
    wire_conn_close(&b);
    /* A peer that speaks first with an ERROR. */
    plain_pair(&a, &b, 1000);
    wire_send_error(&b, 0, WERR_BUSY, "too many connections");
    p.c = &a;
    hs_main(&p);
    CHECK(p.rc < 0 && strstr(p.err, "refused the handshake: too many connections"), "busy: %s", p.err);
    wire_conn_close(&a);
    wire_conn_close(&b);
    test_handshake_stranger(&p);
}

/* ==== Fingerprint ==== */

static void test_fingerprint(void) {
    char path1[512], path2[512], err[512];
    snprintf(path1, sizeof path1, "%s/models/qwen3-mini-Q8_0.gguf", t_fixtures());
    snprintf(path2, sizeof path2, "%s/models/qwen2-mini-Q4_0.gguf", t_fixtures());
    if (!t_need(path1) || !t_need(path2)) return;
    model *m1 = NULL, *m1b = NULL, *m2 = NULL;
    CHECK(model_load(&m1, path1, NULL, err, sizeof err) == 0, "load %s: %s", path1, err);
    /* again, hashed on 3 threads after the load (the file's pages read back)
     * instead of on 1 during it: the same fingerprint */
    model_opts later = { .n_threads = 3, .fingerprint_later = 1 };
    CHECK(model_load(&m1b, path1, &later, err, sizeof err) == 0, "load again: %s", err);
    CHECK(model_load(&m2, path2, NULL, err, sizeof err) == 0, "load %s: %s", path2, err);
    if (!m1 || !m1b || !m2) { model_free(m1); model_free(m1b); model_free(m2); return; }
    uint8_t f1[32], f1b[32], f2[32];
    char d1[256], d1b[256], d2[256];
    double t0 = now_ms();
    CHECK(model_fingerprint(m1, f1, d1, sizeof d1) == 0, "fingerprint 1: %s", d1);
    double dt = now_ms() - t0;
    CHECK(model_fingerprint(m1b, f1b, d1b, sizeof d1b) == 0, "fingerprint 1b");
    CHECK(model_fingerprint(m2, f2, d2, sizeof d2) == 0, "fingerprint 2");
    CHECK(memcmp(f1, f1b, 32) == 0, "same file, same fingerprint");
    CHECK(memcmp(f1, f2, 32) != 0, "different models, different fingerprints");
    CHECK(!strcmp(d1, d1b), "same description");
    CHECK(strstr(d1, "qwen3-mini-Q8_0.gguf (qwen3, ") != NULL && strstr(d1, "layers, n_embd"), "desc: %s", d1);
    CHECK(strstr(d2, "qwen2-mini-Q4_0.gguf (qwen2, ") != NULL, "desc 2: %s", d2);
    char hex[65];
    fingerprint_hex(f1, 32, hex);
    printf("test_wire: %s -> %.16s.. (%.1f ms)\n", d1, hex, dt);

    /* A real mismatch over the handshake names both files. */
    hs_arg p = { .secret = "s" }, d = { .secret = "s" };
    hello_init(&p.mine, WIRE_ROLE_PREFILL, "pf", 0, d1);
    hello_init(&d.mine, WIRE_ROLE_DECODE, "dec", 0, d2);
    memcpy(p.mine.fingerprint, f1, 32);
    memcpy(d.mine.fingerprint, f2, 32);
    run_hs(&p, &d);
    CHECK(p.rc < 0 && strstr(p.err, "qwen3-mini-Q8_0.gguf") && strstr(p.err, "qwen2-mini-Q4_0.gguf"), "p: %s", p.err);
    CHECK(d.rc < 0 && strstr(d.err, "qwen3-mini-Q8_0.gguf") && strstr(d.err, "qwen2-mini-Q4_0.gguf"), "d: %s", d.err);
    memcpy(d.mine.fingerprint, f1b, 32);
    run_hs(&p, &d);
    CHECK(p.rc == 0 && d.rc == 0, "same model handshake: %s %s", p.err, d.err);

    /* The F16 and Q8_0 versions of one architecture differ too (tensor data). */
    char path3[512];
    snprintf(path3, sizeof path3, "%s/qwen3-mini-F16.gguf", t_models());
    model *m3 = NULL;
    CHECK(model_load(&m3, path3, NULL, err, sizeof err) == 0, "load %s: %s (make models)", path3, err);
    if (m3) {
        uint8_t f3[32];
        CHECK(model_fingerprint(m3, f3, NULL, 0) == 0 && memcmp(f3, f1, 32) != 0, "F16 vs Q8_0 differ");
        model_free(m3);
    }
    model_free(m1);
    model_free(m1b);
    model_free(m2);
}

/* ACT (layer-split prefill): round trips in each dtype, every truncation
 * and extension refused, bad dtype / empty / out-of-range heads refused. */
static void test_act(void) {
    enum { N = 3, D = 40 };
    float rows[N * D], back[N * D];
    for (int i = 0; i < N * D; i++) rows[i] = (float)(i - 50) * 0.37f;
    const uint32_t dts[] = { GGML_TYPE_F32, GGML_TYPE_F16, GGML_TYPE_BF16 };
    char err[256];
    for (int k = 0; k < 3; k++) {
        wire_buf b = { 0 };
        CHECK(wire_encode_act(&b, 7, N, dts[k], D, rows) == 0 && b.len == WIRE_ACT_FIXED + N * D * wire_act_elt_bytes(dts[k]),
              "ACT encode %s", gguf_type_name(dts[k]));
        wire_act a;
        CHECK(wire_decode_act(b.data, b.len, &a, err, sizeof err) == 0 && a.pos0 == 7 && a.n == N && a.dim == D &&
              a.dtype == dts[k], "ACT decode %s: %s", gguf_type_name(dts[k]), err);
        wire_act_rows_f32(&a, back);
        double worst = 0;
        for (int i = 0; i < N * D; i++) worst = fmax(worst, fabs((double)back[i] - rows[i]));
        /* f32 travels exactly; f16 keeps 11 bits, bf16 8, of values up to 18.5 */
        double tol = dts[k] == GGML_TYPE_F32 ? 0 : dts[k] == GGML_TYPE_F16 ? 0.01 : 0.07;
        CHECK(worst <= tol, "ACT %s round trip worst %g (tolerance %g)", gguf_type_name(dts[k]), worst, tol);
        int bad = 0;
        for (size_t cut = 0; cut < b.len; cut++) bad += wire_decode_act(b.data, cut, &a, err, sizeof err) == 0;
        CHECK(bad == 0, "ACT %s: %d truncations accepted", gguf_type_name(dts[k]), bad);
        wire_buf_free(&b);
    }
    uint8_t h[WIRE_ACT_FIXED + 8] = { 0 };
    wire_act a;
    h[4] = 1; h[8] = 2; h[12] = 2;   /* n 1, dtype Q4_0, dim 2 */
    CHECK(wire_decode_act(h, WIRE_ACT_FIXED + 8, &a, err, sizeof err) < 0 && strstr(err, "dtype"), "ACT Q4_0 refused: %s", err);
    h[8] = 0; h[4] = 0;
    CHECK(wire_decode_act(h, WIRE_ACT_FIXED + 8, &a, err, sizeof err) < 0, "ACT of 0 rows refused");
    h[4] = 1; h[0] = 0xff; h[1] = 0xff; h[2] = 0xff; h[3] = 0x7f;   /* pos0 2^31 - 1 */
    CHECK(wire_decode_act(h, WIRE_ACT_FIXED + 8, &a, err, sizeof err) < 0 && strstr(err, "2^31"), "ACT beyond 2^31: %s", err);
    CHECK(wire_act_max_rows(GGML_TYPE_F32, 65536) >= 1 &&
          (uint64_t)wire_act_max_rows(GGML_TYPE_F32, 1024) * 4096 + WIRE_ACT_FIXED <= WIRE_MAX_PAYLOAD, "ACT rows per frame");
    CHECK(!strcmp(wire_type_name(WIRE_ACT), "ACT") && wire_type_max_payload(WIRE_ACT) == WIRE_MAX_PAYLOAD, "ACT type");
}

int main(void) {
    test_act();
    test_crc();
    test_hmac();
    test_hello();
    test_auth();
    test_request();
    test_kv();
    test_done_error();
    test_header();
    test_send_recv();
    test_seal();
    test_tcp();
    test_handshake();
    test_fingerprint();
    return t_done("test_wire");
}

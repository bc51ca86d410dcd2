/* test_wire_attack.c - an attacker on the network against a real prefill
 * node process (`tandem serve --role prefill`), with this process as the
 * decode side (handoff.c) and forked attacker processes in between:
 *   1. a stranger's HELLO (its own nonce, or the node's reflected): the node
 *      never sends an AUTH, and drops it at the handshake deadline;
 *   2. a relay between a real decode client and the node: a pure relay is
 *      a pipe; one that flips a sealed byte (CRC fixed), replays a frame,
 *      injects a forged frame or edits a HELLO gets nothing accepted;
 *   3. sixteen 2 KB zstd "bombs" before the handshake: peak RSS (VmHWM)
 *      stays within 64 MiB of idle;
 *   4. 20 idle unauthenticated connections: a real decode client is still
 *      served promptly, and a health probe still reads the HELLO;
 *   5. PINGs do not hold a slot: the decode side's handoff deadline fires
 *      against a node that only PINGs; the node closes a peer that only PINGs;
 *   6. req_id 0 and reused ids refused with ERROR; a bad CRC or tag answered
 *      with ERROR(CHECKSUM / AUTH) before the node hangs up;
 *   7. CANCEL or a vanished peer while a request is queued behind another:
 *      it is never computed.
 */
#include <errno.h>
#include <fcntl.h>
#include <poll.h>
#include <signal.h>
#include <stdarg.h>
#include <sys/socket.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

#include <zstd.h>

#include "engine/gguf.h"
#include "node/handoff.h"
#include "engine/model.h"
#include "proc.h"
#include "net/wire.h"

static char g_tmp[256], g_secret[300], g_model[512];
static const char *g_bin;
static int g_slow = 1;           /* deadline multiplier (ASan) */
static const char *g_sec = "attack-test-secret-0123456789abcdef-5f0c2a9e7b1d4c3a8e6f9b2d1c0a7e5f";

/* ==== Processes ==== */

typedef struct { pid_t pid; int port; char log[300]; } tnode;

static int node_start(tnode *n, const char *const *extra) {
    static int seq;
    char pf[300];
    snprintf(pf, sizeof pf, "%s/port.%d", g_tmp, ++seq);
    snprintf(n->log, sizeof n->log, "%s/node.%d.log", g_tmp, seq);
    char *v[40];
    int k = 0;
    v[k++] = (char *)g_bin; v[k++] = "serve"; v[k++] = "--role"; v[k++] = "prefill";
    v[k++] = "-m"; v[k++] = g_model; v[k++] = "--secret-file"; v[k++] = g_secret;
    v[k++] = "--listen"; v[k++] = "127.0.0.1:0"; v[k++] = "--port-file"; v[k++] = pf; v[k++] = "-t"; v[k++] = "1";
    for (int i = 0; extra && extra[i] && k < 38; i++) v[k++] = (char *)extra[i];
    v[k] = NULL;
    n->pid = spawn_log(v, n->log, 1);
    n->port = wait_port(pf, n->pid, 30000 * g_slow);
    if (n->port > 0) return 0;
    wait_exit(n->pid, 0);   /* killed and reaped */
    n->pid = 0;
    return -1;
}

static void node_stop(tnode *n) {
    stop_proc(n->pid, 20000 * g_slow);
    n->pid = 0;
}

/* ==== Wire helpers ==== */

static int tcp_to(int port) {
    char hp[64], err[256];
    snprintf(hp, sizeof hp, "127.0.0.1:%d", port);
    return wire_connect(hp, 3000, err, sizeof err);
}

/* An authenticated decode-role connection made directly with wire.h. */
static int auth_conn(wire_conn *c, int port, model *m, const char *secret) {
    char err[512];
    int fd = tcp_to(port);
    if (fd < 0) return -1;
    wire_conn_init(c, fd, 3000 * g_slow);
    wire_hello mine, peer;
    if (handoff_hello_init(&mine, m, GGML_TYPE_F16, WIRE_ROLE_DECODE, "attack-test", err, sizeof err) ||
        wire_handshake(c, &mine, secret, strlen(secret), &peer, err, sizeof err)) {
        fprintf(stderr, "auth_conn: %s\n", err);
        wire_conn_close(c);
        return -1;
    }
    return 0;
}

static int send_request(wire_conn *c, uint64_t id, const int32_t *toks, int n) {
    wire_request r = { .start_pos = 0, .end_pos = (uint32_t)n - 1, .wire_dtype = GGML_TYPE_F16, .n_tokens = (uint32_t)n };
    wire_buf b = { 0 };
    char err[256];
    int rc = wire_encode_request(&b, &r, toks) || wire_send(c, WIRE_REQUEST, id, 0, b.data, b.len, err, sizeof err);
    wire_buf_free(&b);
    return rc ? -1 : 0;
}

/* Reads frames until one of type `want` (or an error); its header in *h. */
static int recv_until(wire_conn *c, uint16_t want, wire_header *h, wire_error *e) {
    char err[512];
    for (int i = 0; i < 10000; i++) {
        if (wire_recv(c, h, err, sizeof err)) return -1;
        if (h->type == WIRE_ERROR && e) wire_decode_error(c->rx.data, c->rx.len, e, err, sizeof err);
        if (h->type == want) return 0;
    }
    return -1;
}

/* ==== The relay (a forked attacker process) ==== */

enum relay_mode { RELAY_PIPE, RELAY_TAMPER, RELAY_REPLAY, RELAY_INJECT, RELAY_DOWNGRADE };

static void fix_crc(uint8_t *frame, size_t n) {
    uint32_t crc = wire_crc32c(0, frame + WIRE_HEADER_BYTES, n - WIRE_HEADER_BYTES);
    for (int i = 0; i < 4; i++) frame[20 + i] = (uint8_t)(crc >> (8 * i));
}

/* Moves one whole frame from `from` to `to`, applying the mode's change.
 * dir 0: decode -> prefill, 1: prefill -> decode. */
static int relay_frame(int from, int to, int dir, enum relay_mode mode, int *kv_seen) {
    static uint8_t buf[WIRE_HEADER_BYTES + (8u << 20)];
    if (read_full(from, buf, WIRE_HEADER_BYTES)) return -1;
    uint32_t len = (uint32_t)buf[12] | (uint32_t)buf[13] << 8 | (uint32_t)buf[14] << 16 | (uint32_t)buf[15] << 24;
    uint16_t type = (uint16_t)(buf[6] | buf[7] << 8);
    if (len > sizeof buf - WIRE_HEADER_BYTES || read_full(from, buf + WIRE_HEADER_BYTES, len)) return -1;
    size_t n = WIRE_HEADER_BYTES + len;
    if (dir == 0 && type == WIRE_HELLO && mode == RELAY_DOWNGRADE) {
        buf[WIRE_HEADER_BYTES + 4] &= (uint8_t)~WIRE_CAP_ZSTD;   /* strip the decode node's zstd capability */
        fix_crc(buf, n);
    }
    if (dir == 1 && type == WIRE_KV && ++*kv_seen == 2) {
        if (mode == RELAY_TAMPER) {
            buf[WIRE_HEADER_BYTES + len / 2] ^= 0x40;
            fix_crc(buf, n);
        }
        if (mode == RELAY_REPLAY && send_all(to, buf, n)) return -1;   /* the frame goes twice */
    }
    if (dir == 0 && type == WIRE_REQUEST && mode == RELAY_INJECT) {
        /* our own REQUEST in place of the real one: same shape, new bytes */
        for (uint32_t i = 0; i + 16 < len; i++) buf[WIRE_HEADER_BYTES + i] ^= 0x21;
        fix_crc(buf, n);
    }
    return send_all(to, buf, n);
}

/* Forks an attacker process: the parent gets its pid; the child gets 0 and
 * in *fd the one connection it accepted on lfd (-1 when none came within
 * 10 s). Output is flushed first, so that no buffered line goes out twice. */
static pid_t attacker_fork(int lfd, int *fd) {
    fflush(stdout);
    fflush(stderr);
    pid_t pid = fork();
    if (pid == 0) {
        char err[256];
        *fd = wire_accept(lfd, 10000, err, sizeof err);
    }
    return pid;
}

static pid_t relay_start(int lfd, int node_port, enum relay_mode mode) {
    int d;
    pid_t pid = attacker_fork(lfd, &d);
    if (pid) return pid;
    int p = d >= 0 ? tcp_to(node_port) : -1;
    int kv_seen = 0;
    while (d >= 0 && p >= 0) {
        struct pollfd pf[2] = { { .fd = d, .events = POLLIN }, { .fd = p, .events = POLLIN } };
        if (poll(pf, 2, 10000) <= 0) break;
        if ((pf[0].revents & (POLLIN | POLLHUP)) && relay_frame(d, p, 0, mode, &kv_seen)) break;
        if ((pf[1].revents & (POLLIN | POLLHUP)) && relay_frame(p, d, 1, mode, &kv_seen)) break;
    }
    _exit(0);
}

/* ==== 1: a stranger's HELLO ==== */

static void test_stranger(const tnode *n) {
    for (int variant = 0; variant < 2; variant++) {
        wire_conn c;
        int fd = tcp_to(n->port);
        CHECK(fd >= 0, "connect");
        if (fd < 0) return;
        wire_conn_init(&c, fd, 5000 * g_slow);
        wire_header h;
        char err[512];
        int ok = wire_recv(&c, &h, err, sizeof err) == 0 && h.type == WIRE_HELLO;
        CHECK(ok, "the node's HELLO: %s", err);
        wire_hello ph, me;
        wire_decode_hello(c.rx.data, c.rx.len, &ph, err, sizeof err);
        me = ph;
        me.role = WIRE_ROLE_DECODE;
        if (variant == 0) wire_random(me.nonce, 32);   /* 1: the node's own nonce, reflected */
        wire_buf b = { 0 };
        wire_encode_hello(&b, &me);
        wire_send(&c, WIRE_HELLO, 0, 0, b.data, b.len, err, sizeof err);
        wire_buf_free(&b);
        int saw_auth = 0, saw_error = 0;
        double t0 = now_ms();
        while (wire_recv(&c, &h, err, sizeof err) == 0) {
            saw_auth |= h.type == WIRE_AUTH;
            saw_error |= h.type == WIRE_ERROR;
        }
        double dt = now_ms() - t0;
        CHECK(!saw_auth, "%s: the node sent no AUTH", variant ? "reflected nonce" : "stranger's nonce");
        CHECK(saw_error && strstr(err, "closed"), "%s: ERROR, then the node hung up (%s)",
              variant ? "reflected nonce" : "stranger's nonce", err);
        if (variant == 0)
            CHECK(dt > 1500 && dt < 2000 + 1500.0 * g_slow, "dropped at the 2 s handshake deadline (%.0f ms)", dt);
        wire_conn_close(&c);
    }
}

/* ==== 2: a relay in the middle ==== */

static void test_relay(const tnode *n, model *m) {
    const char *names[] = { "pure relay", "tampered KV frame", "replayed KV frame", "injected REQUEST",
                            "downgraded HELLO" };
    int32_t toks[40];
    for (int i = 0; i < 40; i++) toks[i] = 1 + (i * 37) % 500;
    session *s = NULL;
    char err[512];
    session_new(&s, m, 256, GGML_TYPE_F16, err, sizeof err);
    for (int mode = RELAY_PIPE; mode <= RELAY_DOWNGRADE; mode++) {
        int lfd = wire_listen("127.0.0.1:0", err, sizeof err);
        char hp[64];
        snprintf(hp, sizeof hp, "127.0.0.1:%d", wire_local_port(lfd));
        pid_t rp = relay_start(lfd, n->port, (enum relay_mode)mode);
        close(lfd);
        handoff_opts ho = { .timeout_ms = 3000 * g_slow, .secret = g_sec, .secret_len = strlen(g_sec),
                            .node_id = "victim", .zstd = 1 };
        handoff_client *c = NULL;
        handoff_stats st;
        session_reset(s, 0);
        int rc = handoff_connect(&c, hp, m, GGML_TYPE_F16, &ho, err, sizeof err);
        if (rc == 0) rc = handoff_prefill(c, s, toks, 40, 0, &st, err, sizeof err);
        handoff_close(c);
        kill(rp, SIGKILL);
        waitpid(rp, NULL, 0);
        if (mode == RELAY_PIPE) {
            CHECK(rc == 0 && session_pos(s) == 39, "%s: a relay that changes nothing is just a pipe: %s", names[mode], err);
        } else {
            CHECK(rc < 0 && session_pos(s) == 0, "%s: refused, no KV kept (pos %d): %s", names[mode], session_pos(s), err);
            const char *want = mode == RELAY_DOWNGRADE ? "authentication failed"
                             : mode == RELAY_INJECT ? "error (code 2)" : "failed authentication";
            CHECK(strstr(err, want) != NULL, "%s: message names '%s': %s", names[mode], want, err);
        }
        printf("wire_attack: %s: %s\n", names[mode], rc == 0 ? "served" : err);
    }
    CHECK(wait_file_has(n->log, "authentication tag mismatch in REQUEST frame", 3000 * g_slow),
          "the node refused the injected REQUEST at its tag");
    CHECK(wait_file_has(n->log, "does not know the shared secret", 3000 * g_slow), "the node refused the downgraded HELLO's proof");
    session_free(s);
}

/* ==== 3: decompression bombs before the handshake ==== */

static void test_preauth_bomb(const tnode *n) {
    long idle = proc_status_kb(n->pid, "VmHWM:");
    /* 2 KB of zstd that would inflate to 64 MiB */
    size_t raw = WIRE_MAX_PAYLOAD, cap = ZSTD_compressBound(raw);
    uint8_t *zeros = calloc(1, raw), *z = malloc(cap);
    size_t zl = ZSTD_compress(z, cap, zeros, raw, 1);
    free(zeros);
    CHECK(!ZSTD_isError(zl) && zl < 4096, "a %zu-byte zstd frame of 64 MiB", zl);
    int fds[16], refused = 0, dropped = 0;
    for (int i = 0; i < 16; i++) {
        fds[i] = tcp_to(n->port);
        uint16_t type = i % 2 ? WIRE_KV : WIRE_ERROR;   /* a data frame, and a handshake-legal type */
        wire_header h = { .version = WIRE_VERSION, .type = type, .flags = WIRE_FLAG_ZSTD, .len = (uint32_t)zl,
                          .raw_len = (uint32_t)raw, .crc = wire_crc32c(0, z, zl) };
        uint8_t hb[WIRE_HEADER_BYTES];
        wire_header_encode(&h, hb);
        if (fds[i] >= 0) { send_all(fds[i], hb, sizeof hb); send_all(fds[i], z, zl); }
    }
    for (int i = 0; i < 16; i++) {
        wire_conn c;
        wire_header h;
        wire_error e = { 0 };
        char err[512];
        if (fds[i] < 0) continue;
        wire_conn_init(&c, fds[i], 5000 * g_slow);
        while (wire_recv(&c, &h, err, sizeof err) == 0)
            if (h.type == WIRE_ERROR) wire_decode_error(c.rx.data, c.rx.len, &e, err, sizeof err);
        refused += e.code == WERR_PROTOCOL && strstr(e.message, "before the handshake") != NULL;
        dropped += e.code == 0;   /* dropped from the handshake pool for a newcomer, unanswered */
        wire_conn_close(&c);
    }
    free(z);
    long peak = proc_status_kb(n->pid, "VmHWM:");
    /* 127.0.0.1 authenticated before (test_relay): its handshakes share the
     * trusted pool (8), whose oldest may be dropped for a newcomer first */
    CHECK(refused + dropped == 16 && refused >= 8, "all 16 pre-auth zstd frames refused with ERROR(PROTOCOL) (%d) or "
          "dropped unanswered (%d)", refused, dropped);
    CHECK(peak - idle < 64 * 1024, "peak RSS %ld kB -> %ld kB (+%ld kB, limit 64 MiB)", idle, peak, peak - idle);
    printf("wire_attack: 16 pre-auth 2 KB zstd bombs: VmHWM %ld -> %ld kB\n", idle, peak);
}

/* ==== 4: idle strangers do not lock out real decode nodes ==== */

static void test_idle_flood(const tnode *n, model *m) {
    int fds[20];
    for (int i = 0; i < 20; i++) fds[i] = tcp_to(n->port);
    sleep_ms(200);
    char hp[64], err[512];
    snprintf(hp, sizeof hp, "127.0.0.1:%d", n->port);
    handoff_opts ho = { .timeout_ms = 3000 * g_slow, .secret = g_sec, .secret_len = strlen(g_sec), .node_id = "real" };
    session *s = NULL;
    session_new(&s, m, 256, GGML_TYPE_F16, err, sizeof err);
    int32_t toks[20];
    for (int i = 0; i < 20; i++) toks[i] = 1 + i * 11;
    handoff_client *c = NULL;
    handoff_stats st;
    double t0 = now_ms();
    int rc = handoff_connect(&c, hp, m, GGML_TYPE_F16, &ho, err, sizeof err);
    if (rc == 0) rc = handoff_prefill(c, s, toks, 20, 0, &st, err, sizeof err);
    double dt = now_ms() - t0;
    handoff_close(c);
    CHECK(rc == 0, "served with 20 idle unauthenticated connections open: %s", err);
    CHECK(dt < 1000.0 * g_slow, "promptly: %.0f ms", dt);
    /* a router's health probe reads the HELLO as before */
    wire_conn pc;
    wire_header h;
    int pfd = tcp_to(n->port);
    wire_conn_init(&pc, pfd, 1000 * g_slow);
    CHECK(pfd >= 0 && wire_recv(&pc, &h, err, sizeof err) == 0 && h.type == WIRE_HELLO, "probe reads HELLO: %s", err);
    wire_conn_close(&pc);
    printf("wire_attack: with 20 idle strangers connected, a decode client was served in %.0f ms\n", dt);
    for (int i = 0; i < 20; i++) if (fds[i] >= 0) close(fds[i]);
    session_free(s);
}

/* ==== 5: PINGs hold nothing ==== */

/* A node that authenticates, reads the REQUEST, then only PINGs. */
static pid_t pinger_start(int lfd, model *m) {
    int fd;
    pid_t pid = attacker_fork(lfd, &fd);
    if (pid) return pid;
    char err[512];
    wire_conn c;
    wire_conn_init(&c, fd, 5000);
    wire_hello mine, peer;
    wire_header h;
    if (fd < 0 || handoff_hello_init(&mine, m, GGML_TYPE_F16, WIRE_ROLE_PREFILL, "pinger", err, sizeof err) ||
        wire_handshake(&c, &mine, g_sec, strlen(g_sec), &peer, err, sizeof err) || wire_recv(&c, &h, err, sizeof err))
        _exit(1);
    for (int i = 0; i < 600; i++) {
        if (wire_send(&c, WIRE_PING, h.req_id, 0, "still here", 10, err, sizeof err)) break;
        sleep_ms(100);
    }
    _exit(0);
}

static void test_ping_deadline(const tnode *n, model *m) {
    char err[512], hp[64];
    int lfd = wire_listen("127.0.0.1:0", err, sizeof err);
    snprintf(hp, sizeof hp, "127.0.0.1:%d", wire_local_port(lfd));
    pid_t pp = pinger_start(lfd, m);
    close(lfd);
    handoff_opts ho = { .timeout_ms = 1000, .deadline_ms = 1500, .secret = g_sec, .secret_len = strlen(g_sec) };
    session *s = NULL;
    session_new(&s, m, 256, GGML_TYPE_F16, err, sizeof err);
    int32_t toks[10] = { 1, 2, 3, 4, 5, 6, 7, 8, 9, 10 };
    handoff_client *c = NULL;
    handoff_stats st;
    int rc = handoff_connect(&c, hp, m, GGML_TYPE_F16, &ho, err, sizeof err);
    double t0 = now_ms();
    if (rc == 0) rc = handoff_prefill(c, s, toks, 10, 0, &st, err, sizeof err);
    double dt = now_ms() - t0;
    handoff_close(c);
    kill(pp, SIGKILL);
    waitpid(pp, NULL, 0);
    CHECK(rc < 0 && strstr(err, "handoff deadline of 1500 ms"), "a PINGing prefill node: deadline: %s", err);
    CHECK(dt >= 1400 && dt < 1500 + 1000.0 * g_slow, "the decode slot was released at %.0f ms (deadline 1500)", dt);
    printf("wire_attack: PINGs every 100 ms, handoff deadline 1500 ms: given up after %.0f ms\n", dt);
    session_free(s);

    /* The node (run with --idle-ms 1500) closes a peer that only PINGs. */
    wire_conn pc;
    CHECK(auth_conn(&pc, n->port, m, g_sec) == 0, "authenticated connection");
    t0 = now_ms();
    wire_header h;
    wire_error e = { 0 };
    int closed = 0, pings = 0;
    while (now_ms() - t0 < 6000.0 * g_slow) {
        if (wire_send(&pc, WIRE_PING, 0, 0, "x", 1, err, sizeof err)) { closed = 1; break; }
        pings++;
        if (recv_until(&pc, WIRE_PONG, &h, &e)) { closed = 1; break; }
        sleep_ms(100);
    }
    dt = now_ms() - t0;
    CHECK(closed && e.code == WERR_TIMEOUT && dt >= 1400 && dt < 1500 + 1500.0 * g_slow,
          "the node closed a PING-only peer after %.0f ms (%d PINGs, --idle-ms 1500), error %u", dt, pings, e.code);
    wire_conn_close(&pc);
}

/* ==== 6: request ids, CRC and tag errors ==== */

static void flip_payload(uint8_t *frame, size_t n, void *ud) {
    int fix = *(int *)ud;
    frame[WIRE_HEADER_BYTES + 3] ^= 1;
    if (fix) fix_crc(frame, n);
}

static void test_ids_and_errors(const tnode *n, model *m) {
    wire_conn c;
    wire_header h;
    wire_error e = { 0 };
    char err[512];
    int32_t toks[8] = { 1, 20, 30, 40, 50, 60, 70, 80 };
    CHECK(auth_conn(&c, n->port, m, g_sec) == 0, "authenticated connection");
    CHECK(send_request(&c, 0, toks, 8) == 0 && recv_until(&c, WIRE_ERROR, &h, &e) == 0 && e.code == WERR_PROTOCOL &&
          strstr(e.message, "request id 0 refused"), "req_id 0 refused with ERROR: %s", e.message);
    CHECK(wire_recv(&c, &h, err, sizeof err) < 0 && strstr(err, "closed"), "and the connection closed: %s", err);
    wire_conn_close(&c);

    CHECK(auth_conn(&c, n->port, m, g_sec) == 0, "authenticated connection");
    memset(&e, 0, sizeof e);
    CHECK(send_request(&c, 5, toks, 8) == 0 && recv_until(&c, WIRE_DONE, &h, &e) == 0 && h.req_id == 5,
          "request 5 served");
    CHECK(send_request(&c, 5, toks, 8) == 0 && recv_until(&c, WIRE_ERROR, &h, &e) == 0 && e.code == WERR_PROTOCOL &&
          strstr(e.message, "refused"), "request id 5 again refused: %s", e.message);
    wire_conn_close(&c);

    const char *what[] = { "bad CRC", "bad tag (CRC fixed)" };
    uint32_t want[] = { WERR_CHECKSUM, WERR_AUTH };
    for (int fix = 0; fix < 2; fix++) {
        CHECK(auth_conn(&c, n->port, m, g_sec) == 0, "authenticated connection");
        memset(&e, 0, sizeof e);
        int ok = wire_send_raw(&c, WIRE_PING, 0, 0, 8, "12345678", 8, flip_payload, &fix, err, sizeof err) == 0;
        CHECK(ok && recv_until(&c, WIRE_ERROR, &h, &e) == 0 && e.code == want[fix] && h.req_id == 0,
              "%s answered with ERROR(%s) before closing: code %u %s", what[fix], wire_err_name(want[fix]), e.code,
              e.message);
        CHECK(wire_recv(&c, &h, err, sizeof err) < 0, "then closed");
        wire_conn_close(&c);
    }
}

/* ==== 7: cancelled or abandoned while queued ==== */

static void test_queued_cancel(model *m) {
    /* 16-position chunks, 150 ms per frame: a 120-token prompt holds the
     * model for seconds while its frames trickle out. */
    const char *slow[] = { "-b", "16", "--debug-frame-delay-ms", "150", NULL };
    tnode n;
    if (node_start(&n, slow)) { CHECK(0, "slow node"); return; }
    wire_conn a, b, v;
    wire_header h;
    wire_error e = { 0 };
    char err[512];
    int32_t big[120], small[12];
    for (int i = 0; i < 120; i++) big[i] = 1 + (i * 7) % 500;
    for (int i = 0; i < 12; i++) small[i] = 3 + i;
    int ok = auth_conn(&a, n.port, m, g_sec) == 0 && auth_conn(&b, n.port, m, g_sec) == 0 &&
             auth_conn(&v, n.port, m, g_sec) == 0;
    CHECK(ok, "three authenticated connections");
    if (!ok) { node_stop(&n); return; }
    CHECK(send_request(&a, 1, big, 120) == 0 && recv_until(&a, WIRE_KV, &h, NULL) == 0, "A computing");
    /* B queues behind A, then cancels; V queues, then vanishes. */
    double t0 = now_ms();
    CHECK(send_request(&b, 1, small, 12) == 0 && send_request(&v, 1, small, 12) == 0, "B and V queued");
    sleep_ms(300);
    wire_send(&b, WIRE_CANCEL, 1, 0, NULL, 0, err, sizeof err);
    wire_conn_close(&v);
    CHECK(recv_until(&b, WIRE_ERROR, &h, &e) == 0 && e.code == WERR_CANCELLED && h.req_id == 1,
          "B's queued request: ERROR(CANCELLED) (%u %s)", e.code, e.message);
    double dt = now_ms() - t0;
    CHECK(dt < 1500.0 * g_slow, "B answered %.0f ms after queuing, while A still computes", dt);
    CHECK(wait_file_has(n.log, "cancelled by the decode node while queued", 3000 * g_slow), "the node logged B's cancel");
    CHECK(wait_file_has(n.log, "went away while queued", 3000 * g_slow), "the node logged V's departure");
    char *log = slurp(n.log);
    CHECK(strstr(log, " computed=11 ") == NULL, "neither queued request was computed");
    free(log);
    int done = recv_until(&a, WIRE_DONE, &h, &e) == 0;
    CHECK(done, "A still finishes");
    wire_conn_close(&a);
    wire_conn_close(&b);
    node_stop(&n);
}

/* ==== main ==== */

int main(void) {
    signal(SIGPIPE, SIG_IGN);
    g_bin = bin();
    g_slow = asan() ? 4 : 1;
    if (access(g_bin, X_OK)) { CHECK(0, "tandem binary %s (set TANDEM_BIN)", g_bin); return t_done("test_wire_attack"); }
    snprintf(g_tmp, sizeof g_tmp, "/tmp/tandem-attack-XXXXXX");
    if (!mkdtemp(g_tmp)) { CHECK(0, "mkdtemp"); return t_done("test_wire_attack"); }
    snprintf(g_secret, sizeof g_secret, "%s/secret", g_tmp);
    FILE *f = fopen(g_secret, "w");
    if (f) { fprintf(f, "%s\n", g_sec); fclose(f); }
    t_fixture_path(g_model, sizeof g_model, "models/stories260K.gguf");
    char err[512];
    model *m = NULL;
    model_opts mo = { .n_threads = 1, .n_batch = 64 };
    CHECK(model_load(&m, g_model, &mo, err, sizeof err) == 0, "load %s: %s", g_model, err);
    const char *extra[] = { "--idle-ms", "1500", "--handshake-ms", "2000", NULL };
    tnode n;
    if (m && node_start(&n, extra) == 0) {
        test_stranger(&n);
        test_relay(&n, m);
        test_preauth_bomb(&n);
        test_idle_flood(&n, m);
        test_ping_deadline(&n, m);
        test_ids_and_errors(&n, m);
        CHECK(kill(n.pid, 0) == 0, "the node survived all of it");
        node_stop(&n);
        test_queued_cancel(m);
    } else {
        CHECK(0, "prefill node started");
    }
    model_free(m);
    char cmd[600];
    snprintf(cmd, sizeof cmd, "rm -rf '%s'", g_tmp);
    if (system(cmd)) {}
    return t_done("test_wire_attack");
}

/* bench_handoff.c - `tandem bench-handoff`: what moving a prompt's KV cache
 * from a prefill node costs the time to first token.
 *
 * For every wire dtype and prompt length n (random token ids, seeded):
 *   TTFT local: evaluate the n tokens here, pick the first token;
 *   TTFT split: a prefill node computes the prompt and streams positions
 *               [0, n-1) layer by layer into our cache, then we evaluate the
 *               last token and pick the first token.
 * exposed ms = TTFT split - TTFT local: what the handoff adds on top of the
 * prefill (with perfect overlap, only the last layer's transfer, the request
 * trip and the frame bookkeeping). Means over -r repetitions after one
 * warm-up. Without --prefill-node a prefill node runs in this process (its
 * own model instance, a thread, 127.0.0.1), so both share the machine.
 */
#include "cmd/cli.h"

#include <math.h>
#include <pthread.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>

#include "base/cliopt.h"
#include "base/xorshift.h"
#include "engine/generate.h"
#include "engine/gguf.h"
#include "node/handoff.h"
#include "engine/kvcache.h"
#include "engine/model.h"
#include "engine/quant.h"
#include "engine/sampler.h"
#include "net/wire.h"

/* ==== Options ==== */

#define BH_MAX_LIST 16

typedef struct {
    const char *model, *node, *secret_file, *label, *kv_name, *backend;
    int device;                                   /* the in-process prefill node's backend */
    int lengths[BH_MAX_LIST], n_lengths;
    uint32_t dtypes[BH_MAX_LIST];
    int n_dtypes;
    int reps, threads, batch, zstd, timeout_ms;
    int wire_only;               /* --wire-only: the KV path without compute */
    const char *wire_source;     /* --wire-source ADDR: serve wire-only runs */
    uint64_t seed;
} bh_opts;

#define BH "tandem bench-handoff"

static void bh_usage(FILE *f) {
    fprintf(f,
        "usage: tandem bench-handoff -m MODEL.gguf [options]\n"
        "  --prefill-node HOST:PORT  measure against this prefill node (default: one in this\n"
        "                            process on 127.0.0.1, sharing this machine's cores)\n"
        "  --lengths N,N..           prompt lengths (default 128,256,512,1024,2048,4096)\n"
        "  --wire-dtype T,T..        f16, bf16, q8_0 (default f16,q8_0)\n"
        "  -r N                      repetitions after one warm-up (default 3)\n"
        "  -t N                      threads per model (default 2)\n"
        "  -b N                      prefill chunk (default: the prefill backend's, 512 on the CPU,\n"
        "                            4096 with cuda; with --prefill-node or --wire-only, 512)\n"
        "  --secret-file F           shared secret (or env TANDEM_SECRET; needed with --prefill-node)\n"
        "  --link-label TEXT         the link column (default \"loopback\" / the node's address)\n"
        "  --zstd                    zstd-compressed frames\n"
        "  --timeout-ms N            handoff stall timeout (default 60000)\n"
        "  --seed N                  token seed (default 1)\n"
        "  --wire-only               measure only the wire: stream chunk-sized KV frames (no compute)\n"
        "                            and report GB/s; with --prefill-node, from a --wire-source there\n"
        "  --wire-source HOST:PORT   serve --wire-only runs on this address until killed\n"
        "The in-process prefill node (the decode side always runs on the CPU):\n");
    cliopt_usage_backend(f, 25);
}

static int bh_int(const char *opt, const char *v, int lo, int hi, int *out) {
    return cliopt_int(BH, opt, v, lo, hi, out);
}

/* --wire-dtype f16,q8_0: the KV types by name (engine/kvcache.h). */
static int bh_dtypes(const char *v, bh_opts *o) {
    int k[BH_MAX_LIST], n;
    if (cliopt_choice_list(BH, "--wire-dtype", v, kv_dtype_names, k, BH_MAX_LIST, &n)) return -1;
    for (int i = 0; i < n; i++) o->dtypes[i] = kv_dtype_parse(kv_dtype_names[k[i]]);
    o->n_dtypes = n;
    return 0;
}

static int bh_parse(int argc, char **argv, bh_opts *o) {
    memset(o, 0, sizeof *o);
    o->reps = 3; o->threads = 2; o->batch = 0; o->timeout_ms = 60000; o->seed = 1;
    cliopt_int_list(BH, "--lengths", "128,256,512,1024,2048,4096", 2, 1 << 20, o->lengths, BH_MAX_LIST, &o->n_lengths);
    bh_dtypes("f16,q8_0", o);
    for (int i = 0; i < argc; i++) {
        const char *a = argv[i], *v = i + 1 < argc ? argv[i + 1] : NULL;
        int bad = 0, takes = 1, x = 0;
        if (!strcmp(a, "-m")) bad = cliopt_str(BH, a, v, &o->model);
        else if (!strcmp(a, "--prefill-node")) bad = cliopt_str(BH, a, v, &o->node);
        else if (!strcmp(a, "--secret-file")) bad = cliopt_str(BH, a, v, &o->secret_file);
        else if (!strcmp(a, "--link-label")) bad = cliopt_str(BH, a, v, &o->label);
        else if (!strcmp(a, "--lengths")) bad = cliopt_int_list(BH, a, v, 2, 1 << 20, o->lengths, BH_MAX_LIST, &o->n_lengths);
        else if (!strcmp(a, "--wire-dtype")) bad = bh_dtypes(v, o);
        else if (!strcmp(a, "-r")) bad = bh_int(a, v, 1, 1000, &o->reps);
        else if (!strcmp(a, "-t")) bad = bh_int(a, v, 1, 256, &o->threads);
        else if (!strcmp(a, "-b")) bad = bh_int(a, v, 1, 1 << 16, &o->batch);
        else if (!strcmp(a, "--timeout-ms")) bad = bh_int(a, v, 1, 3600000, &o->timeout_ms);
        else if (!strcmp(a, "--seed")) { bad = bh_int(a, v, 0, 1 << 30, &x); o->seed = (uint64_t)x; }
        else if (!strcmp(a, "--backend")) bad = cliopt_backend(BH, v, &o->backend);
        else if (!strcmp(a, "--device")) bad = bh_int(a, v, 0, 63, &o->device);
        else if (!strcmp(a, "--zstd")) { o->zstd = 1; takes = 0; }
        else if (!strcmp(a, "--wire-only")) { o->wire_only = 1; takes = 0; }
        else if (!strcmp(a, "--wire-source")) bad = cliopt_str(BH, a, v, &o->wire_source);
        else if (cliopt_is_help(a)) { bh_usage(stdout); return 1; }
        else { fprintf(stderr, BH ": unknown option %s (see tandem bench-handoff --help)\n", a); return -1; }
        if (bad) return -1;   /* the message is out */
        i += takes;
    }
    if (!o->model) { if (argc) fprintf(stderr, BH ": give -m MODEL.gguf\n"); bh_usage(stderr); return -1; }
    return 0;
}

/* ==== In-process prefill node ==== */

typedef struct {
    model *m;
    prefill_node_opts po;
    volatile int stop;
    pthread_t th;
    int started, rc;
    char port_file[64], err[512];
} bh_local_node;

static void *bh_node_main(void *arg) {
    bh_local_node *ln = arg;
    ln->rc = prefill_node_run(ln->m, &ln->po, ln->err, sizeof ln->err);
    return NULL;
}

/* Starts a prefill node thread with its own model; fills addr. */
static int bh_local_start(bh_local_node *ln, const bh_opts *o, const void *secret, size_t secret_len, int n_ctx,
                          char *addr, size_t addrlen, char *err, size_t errlen) {
    model_opts mo = { .n_threads = o->threads, .n_batch = o->batch, .backend = o->backend, .device = o->device };
    if (model_load(&ln->m, o->model, &mo, err, errlen)) return -1;
    snprintf(ln->port_file, sizeof ln->port_file, "/tmp/tandem-bh-%d.port", (int)getpid());
    unlink(ln->port_file);
    ln->po = (prefill_node_opts){ .listen = "127.0.0.1:0", .secret = secret, .secret_len = secret_len,
                                  .node_id = "bench-prefill", .n_ctx = n_ctx, .kv_dtype = GGML_TYPE_F16,
                                  .timeout_ms = o->timeout_ms, .stop = &ln->stop, .port_file = ln->port_file };
    if (pthread_create(&ln->th, NULL, bh_node_main, ln)) { snprintf(err, errlen, "cannot start a thread"); return -1; }
    ln->started = 1;
    for (int i = 0; i < 600; i++) {   /* up to 60 s for the node to listen */
        FILE *f = fopen(ln->port_file, "r");
        int port = 0;
        if (f) { int ok = fscanf(f, "%d", &port) == 1; fclose(f); if (ok && port > 0) { snprintf(addr, addrlen, "127.0.0.1:%d", port); return 0; } }
        struct timespec ts = { 0, 100 * 1000000L };
        nanosleep(&ts, NULL);
    }
    snprintf(err, errlen, "the in-process prefill node did not start: %.400s", ln->err[0] ? ln->err : "no port file");
    return -1;
}

static void bh_local_stop(bh_local_node *ln) {
    if (ln->started) { ln->stop = 1; pthread_join(ln->th, NULL); }
    if (ln->port_file[0]) unlink(ln->port_file);
    model_free(ln->m);
}

/* ==== Measurement ==== */

typedef struct {
    double ttft_local, ttft_split, prefill_remote, total, tail, xfer;
    double kv_bytes, wire_bytes;
    int agree, runs;
} bh_row;

static void bh_tokens(int32_t *t, int n, int n_vocab, uint64_t seed) {
    uint64_t s = seed * 0x9E3779B97F4A7C15ull + 1;
    for (int i = 0; i < n; i++) {
        t[i] = (int32_t)(xorshift64_next(&s) % (uint64_t)n_vocab);
    }
}

typedef struct {
    model *m;
    session *s;
    handoff_client *c;
    float *logits;
    int n_vocab, n_layer, batch;
} bh_ctx;

static int bh_local(bh_ctx *x, const int32_t *t, int n, double *ms, int32_t *first, char *err, size_t errlen) {
    session_reset(x->s, 0);
    double t0 = gen_now_ms();
    if (model_eval(x->m, x->s, t, n, x->logits, NULL, NULL, err, errlen)) return -1;
    *first = sampler_argmax(x->logits, x->n_vocab);
    *ms = gen_now_ms() - t0;
    return 0;
}

static int bh_split(bh_ctx *x, const int32_t *t, int n, double *ms, int32_t *first, handoff_stats *hs,
                    char *err, size_t errlen) {
    session_reset(x->s, 0);
    double t0 = gen_now_ms();
    if (handoff_prefill(x->c, x->s, t, n, 0, hs, err, errlen)) return -1;
    if (model_eval(x->m, x->s, t + n - 1, 1, x->logits, NULL, NULL, err, errlen)) return -1;
    *first = sampler_argmax(x->logits, x->n_vocab);
    *ms = gen_now_ms() - t0;
    return 0;
}

/* One local and one split run of the same tokens (the order alternates with
 * `flip`, so that neither side always runs on a warmer machine); adds to r. */
static int bh_measure(bh_ctx *x, const int32_t *t, int n, int flip, bh_row *r, char *err, size_t errlen) {
    double ms_local, ms_split;
    int32_t first_local, first_split;
    handoff_stats hs;
    if (flip && bh_split(x, t, n, &ms_split, &first_split, &hs, err, errlen)) return -1;
    if (bh_local(x, t, n, &ms_local, &first_local, err, errlen)) return -1;
    if (!flip && bh_split(x, t, n, &ms_split, &first_split, &hs, err, errlen)) return -1;
    /* frames start once the first chunk's first layer is computed; from then
     * until the last frame is in the cache the KV is on the wire */
    int sent = n - 1, chunk = sent < x->batch ? sent : x->batch;
    double first_frame = hs.prefill_ms_remote * chunk / (double)sent / x->n_layer;
    r->ttft_local += ms_local;
    r->ttft_split += ms_split;
    r->prefill_remote += hs.prefill_ms_remote;
    r->total += hs.total_ms;
    r->tail += hs.transfer_tail_ms;
    r->xfer += hs.total_ms > first_frame ? hs.total_ms - first_frame : hs.total_ms;
    r->kv_bytes += (double)hs.kv_bytes;
    r->wire_bytes += (double)hs.wire_bytes;
    r->agree += first_local == first_split;
    r->runs++;
    return 0;
}

static void bh_print_row(const char *link, uint32_t dt, int n, const bh_row *r) {
    double k = r->runs ? 1.0 / r->runs : 0;
    double exposed = (r->ttft_split - r->ttft_local) * k, pf = r->prefill_remote * k, xfer = r->xfer * k;
    printf("| %s | %s | %d | %.1f | %.0f | %.0f | %.1f | %.1f | %.1f%% | %.3f | %.1f | %.1f | %.1f | %d/%d |\n",
           link, kv_dtype_name(dt), n, pf, r->kv_bytes * k, r->wire_bytes * k, xfer, exposed,
           pf > 0 ? 100.0 * exposed / pf : 0.0, xfer > 0 ? r->wire_bytes * k / (xfer * 1e6) : 0.0,
           r->ttft_local * k, r->ttft_split * k, r->tail * k, r->agree, r->runs);
    fflush(stdout);
}

static int bh_run_dtype(bh_ctx *x, const bh_opts *o, const char *addr, const char *link, uint32_t dt,
                        const void *secret, size_t secret_len, int32_t *toks, char *err, size_t errlen) {
    handoff_opts ho = { .wire_dtype = dt, .zstd = o->zstd, .timeout_ms = o->timeout_ms, .secret = secret,
                        .secret_len = secret_len, .node_id = "bench-decode" };
    if (handoff_connect(&x->c, addr, x->m, GGML_TYPE_F16, &ho, err, errlen)) { x->c = NULL; return -1; }
    int rc = -1;
    bh_row warm = { 0 };
    bh_tokens(toks, o->lengths[0], x->n_vocab, o->seed + 999);
    if (bh_measure(x, toks, o->lengths[0], 0, &warm, err, errlen)) goto out;
    for (int li = 0; li < o->n_lengths; li++) {
        int n = o->lengths[li];
        bh_row r = { 0 };
        for (int rep = 0; rep < o->reps; rep++) {
            bh_tokens(toks, n, x->n_vocab, o->seed * 1000003ull + (uint64_t)n * 131 + (uint64_t)rep);
            if (bh_measure(x, toks, n, rep & 1, &r, err, errlen)) goto out;
        }
        bh_print_row(link, dt, n, &r);
    }
    rc = 0;
out:
    handoff_close(x->c);
    x->c = NULL;
    return rc;
}


static uint32_t get_le32(const uint8_t *p) {
    return (uint32_t)p[0] | ((uint32_t)p[1] << 8) | ((uint32_t)p[2] << 16) | ((uint32_t)p[3] << 24);
}
static void put_le32(uint8_t *p, uint32_t v) {
    for (int i = 0; i < 4; i++) p[i] = (uint8_t)(v >> (8 * i));
}

/* ==== Wire only ====
 * --wire-only measures the KV path without any model compute: a source
 * (the prefill side, listening) streams KV frames of one prefill chunk each
 * (-b positions x the model's K+V row bytes) as fast as the link takes them;
 * the receiver (decode side) checks every frame, decodes it and copies K and
 * V into a cache-sized buffer, as handoff.c does. One run: the receiver asks
 * with a PING carrying (dtype, frames, zstd); the source answers with the
 * frames and a DONE. --wire-source serves runs to a receiver elsewhere
 * (`--wire-only --prefill-node HOST:PORT` on another host or namespace). */

/* Bytes streamed per run: enough for a steady rate on a 10 Gbit/s link
 * (about a second), few enough that three reps stay quick. */
#define BW_RUN_BYTES (1024ull << 20)

typedef struct {
    uint32_t dtype, frames, zstd;
} bw_ask;

/* A chunk's rows of plausible KV values (|x| < 4, so f16 exponents vary like
 * real activations and zstd finds what it would find in a real cache). */
static uint8_t *bw_rows(uint32_t dtype, int kv_dim, int n, uint64_t seed) {
    size_t rb = (size_t)gguf_row_bytes(dtype, (uint64_t)kv_dim);
    uint8_t *rows = malloc(rb * (size_t)n);
    float *f = malloc(sizeof(float) * (size_t)kv_dim);
    if (!rows || !f) { free(rows); free(f); return NULL; }
    uint64_t s = seed * 0x9E3779B97F4A7C15ull + 7;
    for (int r = 0; r < n; r++) {
        for (int i = 0; i < kv_dim; i++) {
            f[i] = (float)((double)(xorshift64_next(&s) >> 11) / (double)(1ull << 53) * 8.0 - 4.0);
        }
        quant_quantize_act_row(dtype, f, rows + rb * (size_t)r, kv_dim);
    }
    free(f);
    return rows;
}

static void bw_hello(wire_hello *h, uint32_t role, const char *id) {
    memset(h, 0, sizeof *h);
    h->role = role;
    h->caps = WIRE_CAP_ZSTD | WIRE_CAP_Q8_0 | WIRE_CAP_BF16;
    h->kv_dtype = GGML_TYPE_F16;
    memset(h->fingerprint, 0x42, sizeof h->fingerprint);   /* both ends: the same "model" */
    snprintf(h->node_id, sizeof h->node_id, "%s", id);
    snprintf(h->model_desc, sizeof h->model_desc, "bench-handoff --wire-only");
}

/* Source side of one connection: answers asks until the peer hangs up. */
static void bw_serve_conn(wire_conn *c, int kv_dim, int batch) {
    char err[256];
    wire_header h;
    wire_buf fb = { 0 };
    while (wire_recv(c, &h, err, sizeof err) == 0) {
        if (h.type != WIRE_PING || c->rx.len != 12) break;
        bw_ask q = { get_le32(c->rx.data), get_le32(c->rx.data + 4), get_le32(c->rx.data + 8) };
        uint8_t *rows = bw_rows(q.dtype, kv_dim, batch, q.dtype);
        if (!rows) break;
        uint32_t rb = (uint32_t)gguf_row_bytes(q.dtype, (uint64_t)kv_dim);
        int ok = 1;
        for (uint32_t i = 0; i < q.frames && ok; i++) {
            wire_kv kv = { .layer = i, .pos0 = 0, .n = (uint32_t)batch, .dtype = q.dtype, .row_bytes = rb,
                           .k = rows, .v = rows };
            fb.len = 0;
            ok = wire_encode_kv(&fb, &kv) == 0 &&
                 wire_send(c, WIRE_KV, 1, q.zstd ? WIRE_FLAG_ZSTD : 0, fb.data, fb.len, err, sizeof err) == 0;
        }
        free(rows);
        wire_done d = { .n_positions = 0 };
        fb.len = 0;
        if (!ok || wire_encode_done(&fb, &d) || wire_send(c, WIRE_DONE, 1, 0, fb.data, fb.len, err, sizeof err)) break;
    }
    wire_buf_free(&fb);
}

typedef struct {
    int lfd, kv_dim, batch, one;
    volatile int stop;
    const void *secret;
    size_t secret_len;
    pthread_t th;
} bw_source;

static void *bw_source_main(void *arg) {
    bw_source *s = arg;
    while (!s->stop) {
        char err[512];
        int fd = wire_accept(s->lfd, 200, err, sizeof err);
        if (fd < 0) continue;
        wire_conn c;
        wire_conn_init(&c, fd, 60000);
        wire_hello mine, peer;
        bw_hello(&mine, WIRE_ROLE_PREFILL, "wire-source");
        if (wire_handshake(&c, &mine, s->secret, s->secret_len, &peer, err, sizeof err) == 0)
            bw_serve_conn(&c, s->kv_dim, s->batch);
        else
            fprintf(stderr, "bench-handoff: wire source: %s\n", err);
        wire_conn_close(&c);
        if (s->one) break;
    }
    return NULL;
}

/* Receiver: one run of q; bytes and seconds from the ask to the DONE. */
static int bw_run(wire_conn *c, const bw_ask *q, int kv_dim, uint8_t *cache, double *sec, uint64_t *payload,
                  uint64_t *wire, char *err, size_t errlen) {
    uint8_t ask[12];
    put_le32(ask, q->dtype); put_le32(ask + 4, q->frames); put_le32(ask + 8, q->zstd);
    uint64_t in0 = c->bytes_in;
    double t0 = gen_now_ms();
    if (wire_send(c, WIRE_PING, 0, 0, ask, sizeof ask, err, errlen)) return -1;
    uint32_t got = 0;
    *payload = 0;
    for (;;) {
        wire_header h;
        if (wire_recv(c, &h, err, errlen)) return -1;
        if (h.type == WIRE_DONE) break;
        wire_kv kv;
        if (h.type != WIRE_KV || wire_decode_kv(c->rx.data, c->rx.len, &kv, err, errlen)) {
            if (h.type != WIRE_KV) snprintf(err, errlen, "unexpected %s frame", wire_type_name(h.type));
            return -1;
        }
        size_t span = (size_t)kv.n * kv.row_bytes;
        memcpy(cache, kv.k, span);            /* the cache write handoff.c does */
        memcpy(cache + span, kv.v, span);
        *payload += c->rx.len;
        got++;
    }
    *sec = (gen_now_ms() - t0) / 1e3;
    *wire = c->bytes_in - in0;
    if (got != q->frames) { snprintf(err, errlen, "got %u of %u frames", got, q->frames); return -1; }
    (void)kv_dim;
    return 0;
}

static int bw_receiver(const bh_opts *o, const char *addr, const char *link, int kv_dim, const void *secret,
                       size_t secret_len, char *err, size_t errlen) {
    int fd = wire_connect(addr, 10000, err, errlen);
    if (fd < 0) return -1;
    wire_conn c;
    wire_conn_init(&c, fd, 60000);
    wire_hello mine, peer;
    bw_hello(&mine, WIRE_ROLE_DECODE, "wire-sink");
    int rc = -1;
    uint8_t *cache = NULL;
    char e2[400];
    if (wire_handshake(&c, &mine, secret, secret_len, &peer, e2, sizeof e2)) {
        snprintf(err, errlen, "handshake: %.400s", e2);
        goto out;
    }
    printf("| link | wire dtype | zstd | frame payload bytes | frames | payload GB/s | wire GB/s |\n");
    printf("|---|---|---|---:|---:|---:|---:|\n");
    for (int d = 0; d < o->n_dtypes; d++) {
        uint32_t dt = o->dtypes[d];
        size_t rb = (size_t)gguf_row_bytes(dt, (uint64_t)kv_dim);
        size_t fbytes = 20 + 2 * rb * (size_t)o->batch;
        free(cache);
        if (!(cache = malloc(2 * rb * (size_t)o->batch))) { snprintf(err, errlen, "out of memory"); goto out; }
        bw_ask q = { dt, (uint32_t)(BW_RUN_BYTES / fbytes) + 1, (uint32_t)o->zstd };
        double s, gp[64], gw[64];
        uint64_t pb, wb;
        if (bw_run(&c, &q, kv_dim, cache, &s, &pb, &wb, err, errlen)) goto out;   /* warm-up */
        int reps = o->reps < 64 ? o->reps : 64;
        for (int r = 0; r < reps; r++) {
            if (bw_run(&c, &q, kv_dim, cache, &s, &pb, &wb, err, errlen)) goto out;
            gp[r] = pb / s / 1e9;
            gw[r] = wb / s / 1e9;
        }
        double mp = 0, mw = 0, vp = 0, vw = 0;
        for (int r = 0; r < reps; r++) { mp += gp[r] / reps; mw += gw[r] / reps; }
        for (int r = 0; r < reps; r++) { vp += (gp[r] - mp) * (gp[r] - mp); vw += (gw[r] - mw) * (gw[r] - mw); }
        vp = reps > 1 ? sqrt(vp / (reps - 1)) : 0;
        vw = reps > 1 ? sqrt(vw / (reps - 1)) : 0;
        printf("| %s | %s | %s | %zu | %u | %.3f ± %.3f | %.3f ± %.3f |\n", link, kv_dtype_name(dt),
               o->zstd ? "yes" : "no", fbytes, q.frames, mp, vp, mw, vw);
        fflush(stdout);
    }
    rc = 0;
out:
    free(cache);
    wire_conn_close(&c);
    return rc;
}

/* --wire-only / --wire-source: the model only gives the row size. */
static int bw_main(const bh_opts *opts, const void *secret, size_t secret_len) {
    char err[512], addr[300];
    bh_opts oo = *opts;
    const bh_opts *o = &oo;
    model_opts mo = { .n_threads = 1, .n_batch = o->batch };
    model *m = NULL;
    if (model_load(&m, o->model, &mo, err, sizeof err)) { fprintf(stderr, "tandem bench-handoff: %s\n", err); return 1; }
    oo.batch = model_get_n_batch(m);   /* -b, else the CPU's pass: no backend computes here */
    const model_hparams *hp = model_get_hparams(m);
    int kv_dim = hp->n_head_kv * hp->head_dim_k;
    model_free(m);
    bw_source src = { .kv_dim = kv_dim, .batch = o->batch, .secret = secret, .secret_len = secret_len };
    src.lfd = wire_listen(o->wire_source ? o->wire_source : "127.0.0.1:0", err, sizeof err);
    if (src.lfd < 0 && (o->wire_source || !o->node)) { fprintf(stderr, "tandem bench-handoff: %s\n", err); return 1; }
    if (o->wire_source) {
        fprintf(stderr, "bench-handoff: wire source on %s (port %d), kv_dim %d, chunk %d\n", o->wire_source,
                wire_local_port(src.lfd), kv_dim, o->batch);
        bw_source_main(&src);
        close(src.lfd);
        return 0;
    }
    int local = !o->node;
    if (local) {
        snprintf(addr, sizeof addr, "127.0.0.1:%d", wire_local_port(src.lfd));
        src.one = 1;
        if (pthread_create(&src.th, NULL, bw_source_main, &src)) { fprintf(stderr, "tandem: no thread\n"); return 1; }
    } else {
        snprintf(addr, sizeof addr, "%s", o->node);
    }
    char link[128];
    snprintf(link, sizeof link, "%s", o->label ? o->label : local ? "loopback" : o->node);
    printf("bench-handoff --wire-only: kv_dim %d (%s), chunk %d positions per frame, %d rep(s) after a warm-up, "
           "source %s\n\n", kv_dim, o->model, o->batch, o->reps, local ? "in this process (127.0.0.1)" : addr);
    int rc = bw_receiver(o, addr, link, kv_dim, secret, secret_len, err, sizeof err);
    if (rc) fprintf(stderr, "tandem bench-handoff: %s\n", err);
    if (local) { src.stop = 1; pthread_join(src.th, NULL); }
    if (src.lfd >= 0) close(src.lfd);
    printf("\npayload GB/s = decoded KV frame payload bytes / time from the ask to the DONE; wire GB/s = bytes "
           "read from the socket (headers, tags, compressed payloads) / the same time.\n");
    return rc ? 1 : 0;
}

/* ==== Command ==== */

int cli_bench_handoff(int argc, char **argv) {
    bh_opts o;
    int pr = bh_parse(argc, argv, &o);
    if (pr) return pr > 0 ? CLI_EXIT_OK : CLI_EXIT_USAGE;
    signal(SIGPIPE, SIG_IGN);
    char err[512], addr[300], link[128];
    int max_n = 0;
    for (int i = 0; i < o.n_lengths; i++) if (o.lengths[i] > max_n) max_n = o.lengths[i];
    char *secret = NULL;
    size_t secret_len = 0;
    uint8_t rnd[32];
    char rnd_hex[65];
    if (o.node || o.secret_file || o.wire_source) {
        if (cliopt_load_secret(o.secret_file, &secret, &secret_len, err, sizeof err)) {
            fprintf(stderr, "tandem bench-handoff: %s\n", err);
            return 2;
        }
    } else {   /* our own node: a throwaway secret */
        if (wire_random(rnd, sizeof rnd)) { fprintf(stderr, "tandem bench-handoff: no randomness\n"); return 1; }
        for (int i = 0; i < 32; i++) snprintf(rnd_hex + 2 * i, 3, "%02x", rnd[i]);
        secret = strdup(rnd_hex);
        secret_len = 64;
    }
    model_opts mo = { .n_threads = o.threads, .n_batch = o.batch };
    bh_ctx x = { 0 };
    bh_local_node ln;
    memset(&ln, 0, sizeof ln);
    int32_t *toks = NULL;
    int rc = 1;
    if (!secret) { fprintf(stderr, "tandem bench-handoff: out of memory\n"); return 1; }
    if (o.wire_only || o.wire_source) {
        rc = bw_main(&o, secret, secret_len);
        memset(secret, 0, secret_len);
        free(secret);
        return rc;
    }
    if (model_load(&x.m, o.model, &mo, err, sizeof err)) { fprintf(stderr, "tandem bench-handoff: %s\n", err); goto out; }
    const model_hparams *hp = model_get_hparams(x.m);
    x.n_vocab = hp->n_vocab;
    x.n_layer = hp->n_layer;
    if (session_new(&x.s, x.m, max_n, GGML_TYPE_F16, err, sizeof err)) { fprintf(stderr, "tandem: %s\n", err); goto out; }
    x.logits = malloc(sizeof(float) * (size_t)x.n_vocab);
    toks = malloc(sizeof(int32_t) * (size_t)max_n);
    if (!x.logits || !toks) { fprintf(stderr, "tandem: out of memory\n"); goto out; }
    if (o.node) {
        snprintf(addr, sizeof addr, "%s", o.node);
    } else if (bh_local_start(&ln, &o, secret, secret_len, max_n, addr, sizeof addr, err, sizeof err)) {
        fprintf(stderr, "tandem bench-handoff: %s\n", err);
        goto out;
    }
    /* the prefill side's chunk: our node's model knows it; a remote node's
     * is taken to be the CPU's unless -b says otherwise */
    x.batch = o.batch > 0 ? o.batch : model_get_n_batch(ln.m ? ln.m : x.m);
    snprintf(link, sizeof link, "%s", o.label ? o.label : o.node ? o.node : "loopback");
    long cores = sysconf(_SC_NPROCESSORS_ONLN);
    printf("bench-handoff: %s (%s, %d layers, n_embd %d, %d KV heads x %d, %s), %d thread(s) per node, "
           "%d rep(s) after a warm-up, KV cache f16, prefill chunk %d%s\n",
           o.model, hp->arch_name, hp->n_layer, hp->n_embd, hp->n_head_kv, hp->head_dim_k, model_type_summary(x.m),
           o.threads, o.reps, x.batch, o.zstd ? ", zstd frames" : "");
    printf("prefill node: %s%s; this machine has %ld core(s)%s\n\n", addr, o.node ? "" : " (in this process)", cores,
           o.node ? "" : ": the prefill and decode sides share them");
    printf("| link | wire dtype | prompt tokens | prefill ms (remote compute) | KV bytes | wire bytes | transfer ms | "
           "exposed ms | exposed %% of prefill | effective GB/s | TTFT local ms | TTFT split ms | tail ms | top-1 agree |\n");
    printf("|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|\n");
    fflush(stdout);
    for (int d = 0; d < o.n_dtypes; d++) {
        if (bh_run_dtype(&x, &o, addr, link, o.dtypes[d], secret, secret_len, toks, err, sizeof err)) {
            fprintf(stderr, "tandem bench-handoff: %s wire: %s\n", kv_dtype_name(o.dtypes[d]), err);
            goto out;
        }
    }
    printf("\nexposed ms = TTFT split - TTFT local (mean). transfer ms = handoff wall time (request sent -> last KV "
           "frame in the cache) minus the remote compute before the first frame can leave (one layer of the first "
           "chunk); effective GB/s = wire bytes / transfer ms (where the prefill compute is slower than the link this is the "
           "rate the KV was produced, not the link's capacity). tail ms = handoff wall time minus the remote compute: "
           "the transfer left after the last layer was computed, measured without the local run's noise; exposed ms "
           "also holds the decode side's evaluation of the last prompt token. top-1 agree: runs whose first token "
           "matched the one-node run.\n");
    rc = 0;
out:
    bh_local_stop(&ln);
    free(toks);
    free(x.logits);
    session_free(x.s);
    model_free(x.m);
    if (secret) { memset(secret, 0, secret_len); free(secret); }
    return rc;
}

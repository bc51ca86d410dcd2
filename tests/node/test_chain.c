/* test_chain.c - layer-split (pipelined) prefill with real processes (issue 41).
 *
 * Slice nodes are `tandem serve --role prefill --layers A:B`; `tandem run
 * --prefill-node HOST:PORT/A:B,...` and a `tandem serve --role decode` node
 * are the decode side. Parts:
 *   1. every model file: chains of 2 nodes (a single-layer slice, then the
 *      rest) and of 3 (unequal slices) give exactly the tokens of a local run
 *      (hidden states travel as f32: the same arithmetic as one node); the
 *      slice nodes run -b 16, so each prompt crosses several chunks, and the
 *      first model also takes a long prompt (many chunks); f16 and bf16
 *      hidden states: agreement measured and printed; under ASan
 *      (TANDEM_ASAN) only qwen3-mini-Q8_0, the file with the long prompt;
 *   2. refusals before any work: a slice other than the spec's, a whole-model
 *      node in a chain, a node with another model (fingerprint);
 *   3. faults: a node that stops sending mid-prefill, kill -9 of the second
 *      node mid-prefill: a clear error, the surviving nodes serve the next
 *      chain; hostile ACT frames sent straight to a slice node (another
 *      request's id, wrong width, a gap) are refused;
 *   4. a decode node over a chain: generation equals tandem run, prefix reuse
 *      sends only the missing span, a dead chain falls back to local prefill;
 *   5. memory: a slice node's RSS after load against the whole-model node's.
 */
#include <errno.h>
#include <jansson.h>
#include <signal.h>
#include <stdarg.h>
#include <sys/stat.h>
#include <unistd.h>

#include "engine/gguf.h"
#include "net/wire_act.h"
#include "node/chain.h"
#include "node/handoff.h"
#include "proc.h"
#include "t.h"
#include "node/chain_nodes.h"

/* 32 random bytes in hex: nodes refuse a secret of less entropy */
#define CHAIN_SECRET "0837c38fea477fb2300f257308f3a2b377aa3d195c5b5d0f3b465e40b34c9113"

/* A slice node of half-block bounds lo2:hi2 ("1.5" is 3; wire_act.h). */
static int snode_start_half(snode *n, const char *model, int lo2, int hi2, const char *const *extra) {
    return snode_start_on(n, model, lo2, hi2, NULL, 60000, extra);
}

static int snode_start(snode *n, const char *model, int lo, int hi, const char *const *extra) {
    return snode_start_half(n, model, 2 * lo, 2 * hi, extra);
}

/* `tandem run` with ids out; spec NULL: local; act: --act-dtype (NULL: the
 * default). Returns the count (-1 on a failed run, then *errout holds its
 * stderr). */
static int run_chain(const char *model, const char *prompt_path, int n_pred, const char *spec, const char *act,
                     int32_t *ids, int cap, char **errout, int timeout_ms) {
    return chain_run(model, prompt_path, n_pred, spec, "3000", act ? "--act-dtype" : NULL, act, timeout_ms, ids, cap,
                     errout);
}

/* ==== 1. Correctness ==== */

static int g_act_n, g_act_same[2], g_act_first[2];

/* chain_chunk_rows: the rule, then a chain of slices at -b 512 picking
 * their rows for a long prompt (from their log lines) with the tokens of
 * the local run. */
static void part_chunk_rows(const char *path, const char *pf, int npred, const int32_t *ref, int nr, int L) {
    static int once;
    if (!once++) {
        int d = chain_min_rows(0, 0), moe = chain_min_rows(128, 8);
        CHECK(d == 128 && moe == 256 && chain_min_rows(8, 2) == 128 && chain_min_rows(4, 9) == 128,
              "chain_min_rows: 128 dense, 16 per expert (%d, %d)", d, moe);
        CHECK(chain_chunk_rows(512, 4096, 16, d) == 256 && chain_chunk_rows(512, 1024, 16, d) == 128 &&
              chain_chunk_rows(512, 16384, 16, d) == 512 && chain_chunk_rows(512, 4096, 1, d) == 512 &&
              chain_chunk_rows(16, 1000, 16, d) == 16 && chain_chunk_rows(4096, 4096, 16, d) == 256 &&
              chain_chunk_rows(512, 100, 16, d) == 128 && chain_chunk_rows(512, 4096, 0, d) == 512 &&
              chain_chunk_rows(512, 1024, 16, moe) == 256 && chain_chunk_rows(4096, 4096, 16, moe) == 256 &&
              chain_chunk_rows(512, 16384, 16, moe) == 512,
              "chain_chunk_rows: -b halved to >= 16 chunks, not below the model's fewest rows");
    }
    const char *const big[] = { "-b", "512", NULL };
    snode a, b;
    if (snode_start(&a, path, 0, 1, big) || snode_start(&b, path, 1, L, big)) {
        CHECK(0, "slice nodes at -b 512 start");
        snode_stop(&a); snode_stop(&b);
        return;
    }
    char spec[600];
    snode *c2[] = { &a, &b };
    spec_of(spec, sizeof spec, c2, 2);
    int32_t got[64];
    char *e = NULL;
    int ng = run_chain(path, pf, npred, spec, NULL, got, 64, &e, 120000);
    CHECK(ng == nr && !memcmp(got, ref, sizeof(int32_t) * (size_t)(nr > 0 ? nr : 0)),
          "long prompt through slices at -b 512 (their own chunk rows) equals the local run (%d tokens): %s", ng, e ? e : "");
    free(e);
    snode_stop(&a); snode_stop(&b);
    char *la = slurp(a.log), *lb = slurp(b.log);
    const char *ra = la ? strstr(la, " rows=") : NULL, *rb = lb ? strstr(lb, " rows=") : NULL;
    int rows_a = ra ? atoi(ra + 6) : -1, rows_b = rb ? atoi(rb + 6) : -1;
    CHECK(rows_a == 128 && rows_b == 128, "both slices cut the long prompt into 128-row chunks (%d, %d)", rows_a, rows_b);
    free(la); free(lb);
}

/* Bounds in half blocks: parsing, the K/V each slice owns, refusals. */
static void part_half_parse(void) {
    int lo, hi, used;
    char t[32];
    CHECK(wire_layers_parse("3.5:8", &lo, &hi, &used) == 0 && lo == 7 && hi == 16 && used == 5 &&
          wire_layers_kv(lo) == 4 && wire_layers_kv(hi) == 8, "\"3.5:8\" is half blocks 7:16, K/V of blocks 4..7");
    CHECK(wire_layers_parse("0:3.5", &lo, &hi, &used) == 0 && lo == 0 && hi == 7 && wire_layers_kv(hi) == 4,
          "\"0:3.5\" owns the K/V of blocks 0..3");
    wire_layers_format(t, sizeof t, 7, 16);
    CHECK(!strcmp(t, "3.5:8"), "format 7:16 -> %s", t);
    wire_layers_format(t, sizeof t, 0, 8);
    CHECK(!strcmp(t, "0:4"), "format 0:8 -> %s", t);
    const char *bad[] = { "3:3", "4:3.5", "3.2:4", "3.:4", "-1:2", ":4", "3:", "1025:1026", "3.5", "99999:100000" };
    for (size_t i = 0; i < sizeof bad / sizeof bad[0]; i++)
        CHECK(wire_layers_parse(bad[i], &lo, &hi, &used) != 0, "bounds \"%s\" refused", bad[i]);
    chain_spec sp;
    char err[300];
    CHECK(chain_spec_parse("a:1/0:0.5,b:2/0.5:1.5,c:3/1.5:4", &sp, err, sizeof err) == 0 && sp.n == 3 && sp.hi[0] == 1 &&
          sp.lo[2] == 3 && sp.hi[2] == 8, "a chain sharing blocks 0 and 1 parses (%s)", err);
    CHECK(chain_spec_parse("a:1/0:1.5,b:2/1.5:2,c:3/2:4", &sp, err, sizeof err) != 0 && strstr(err, "attention"),
          "a slice of one feed-forward only (1.5:2) refused: %s", err);
    CHECK(chain_spec_parse("a:1/0:1.5,b:2/1:4", &sp, err, sizeof err) != 0 && strstr(err, "starts at layer 1, but the slices before it end at 1.5"),
          "a gap or overlap at a half block refused: %s", err);
    /* one parser for the decode node and the router (net/chain_spec.c):
     * what the router said of a gap ("layers must be 1:B", part_router)
     * is in the same message */
    CHECK(chain_spec_parse("a:1/0:1.5,b:2/1:4", &sp, err, sizeof err) != 0 && strstr(err, "layers must be 1.5:B"),
          "the gap names the bound it needs: %s", err);
    CHECK(chain_spec_parse("a/0:4", &sp, err, sizeof err) != 0 && strstr(err, "'a/0:4' is not HOST:PORT/A:B"),
          "a member without a port refused: %s", err);
    CHECK(chain_spec_parse("", &sp, err, sizeof err) != 0 && strstr(err, "empty chain"), "an empty spec refused: %s", err);
    CHECK(chain_spec_parse("a:1/0:4,", &sp, err, sizeof err) == 0 && sp.n == 1 && !strcmp(sp.addr[0], "a:1"),
          "a trailing comma ends the spec (%s)", err);
    char big[40 * (CHAIN_SPEC_MAX + 1)];
    size_t o = 0;
    for (int i = 0; i <= CHAIN_SPEC_MAX; i++)
        o += (size_t)snprintf(big + o, sizeof big - o, "%sh:%d/%d:%d", i ? "," : "", i + 1, i, i + 1);
    CHECK(chain_spec_parse(big, &sp, err, sizeof err) != 0 && strstr(err, "at most 16 nodes"), "17 members refused: %s", err);
    big[strrchr(big, ',') - big] = 0;
    CHECK(chain_spec_parse(big, &sp, err, sizeof err) == 0 && sp.n == CHAIN_SPEC_MAX && sp.hi[15] == 32,
          "16 members taken (%s)", err);
    CHECK(chain_spec_desc_layers("qwen3 ...; layers 3.5:8", &lo, &hi) == 0 && lo == 7 && hi == 16 &&
          chain_spec_desc_layers("qwen3 ...", &lo, &hi) != 0, "a HELLO's slice read back");
}

/* Chains with slices sharing a block: 0:0.5 + 0.5:L, and 0:0.5 + 0.5:1.5 +
 * 1.5:L; greedy tokens equal the local run's. */
static void part_half_blocks(const char *name, const char *path, const char *pf, int npred, const int32_t *ref, int nr,
                             int L) {
    snode e, f, g, h;
    if (snode_start_half(&e, path, 0, 1, NULL) || snode_start_half(&f, path, 1, 2 * L, NULL) ||
        snode_start_half(&g, path, 1, 3, NULL) || snode_start_half(&h, path, 3, 2 * L, NULL)) {
        CHECK(0, "%s: half-block slice nodes start", name);
        snode_stop(&e); snode_stop(&f); snode_stop(&g); snode_stop(&h);
        return;
    }
    char s2[600], s3[900];
    snode *c2[] = { &e, &f }, *c3[] = { &e, &g, &h };
    spec_of(s2, sizeof s2, c2, 2);
    spec_of(s3, sizeof s3, c3, 3);
    for (int ci = 0; ci < 2; ci++) {
        int32_t got[64];
        char *er = NULL;
        int ng = run_chain(path, pf, npred, ci ? s3 : s2, NULL, got, 64, &er, 120000);
        CHECK(ng == nr && !memcmp(got, ref, sizeof(int32_t) * (size_t)(nr > 0 ? nr : 0)),
              "%s: a %d-node chain sharing blocks (%s) equals the local run exactly (%d tokens): %s", name, ci ? 3 : 2,
              ci ? s3 : s2, ng, er ? er : "");
        free(er);
    }
    snode_stop(&e); snode_stop(&f); snode_stop(&g); snode_stop(&h);
    static int once;   /* a slice of one feed-forward half owns no K/V: refused at load */
    if (once++) return;
    char log[300];
    snprintf(log, sizeof log, "%s/ffn-only.log", g_tmp);
    char *argv[] = { (char *)bin(), "serve", "--role", "prefill", "-m", (char *)path, "--secret-file", g_secret,
                     "--layers", "1.5:2", "-t", "1", NULL };
    int rc = wait_exit(spawn_io(argv, NULL, "/dev/null", log), 60000);
    char *lg = slurp(log);
    CHECK(rc != 0 && lg && strstr(lg, "compute no block's attention"), "%s: --layers 1.5:2 refused at load (rc %d): %s",
          name, rc, lg ? lg : "");
    free(lg);
}

static void part_models(void) {
    const char *names[] = { "stories260K", "stories260K-F16", "qwen3-mini-Q8_0", "qwen3-mini-Q4_K_M", "qwen2-mini-Q4_0",
                            "qwen3moe-mini-Q4_K_M", "qwen3-mini-F16", "qwen2-mini-F16", "qwen3moe-mini-F16" };
    char longp[8192];
    size_t o = 0;
    for (int i = 0; i < 20 && o + 300 < sizeof longp; i++) o += (size_t)snprintf(longp + o, sizeof longp - o, "%s ", PROMPT);
    for (size_t mi = 0; mi < sizeof names / sizeof names[0]; mi++) {
        /* sanitizer run: the same paths on one model (as test_spec): the
         * quantized qwen3 file, the one that also takes the long prompt
         * (the suite's run has the other eight) */
        if (asan() && mi != 2) continue;
        char path[512], rel[128];
        int gen = strstr(names[mi], "-F16") && strncmp(names[mi], "stories", 7);
        if (gen) snprintf(path, sizeof path, "%s/%s.gguf", t_models(), names[mi]);
        else { snprintf(rel, sizeof rel, "models/%s.gguf", names[mi]); t_fixture_path(path, sizeof path, rel); }
        if (!t_need(path)) continue;
        int L = model_layers(path);
        CHECK(L >= 3, "%s: %d layers", names[mi], L);
        if (L < 3) continue;
        snode a, b, c, d;
        if (snode_start(&a, path, 0, 1, NULL) || snode_start(&b, path, 1, L, NULL) || snode_start(&c, path, 1, L - 1, NULL) ||
            snode_start(&d, path, L - 1, L, NULL)) {
            CHECK(0, "%s: slice nodes start", names[mi]);
            snode_stop(&a); snode_stop(&b); snode_stop(&c); snode_stop(&d);
            continue;
        }
        char s2[600], s3[900];
        snode *c2[] = { &a, &b }, *c3[] = { &a, &c, &d };
        spec_of(s2, sizeof s2, c2, 2);
        spec_of(s3, sizeof s3, c3, 3);
        int npred = 8;
        const char *prompts[] = { PROMPT, longp };
        for (int pi = 0; pi < (mi == 2 ? 2 : 1); pi++) {
            char *pf = write_prompt(prompts[pi]);
            int32_t ref[64], got[64];
            char *e = NULL;
            int nr = run_chain(path, pf, npred, NULL, NULL, ref, 64, &e, 120000);
            free(e);
            CHECK(nr == npred, "%s: local run (%d)", names[mi], nr);
            for (int ci = 0; ci < 2; ci++) {
                e = NULL;
                int ng = run_chain(path, pf, npred, ci ? s3 : s2, NULL, got, 64, &e, 120000);
                CHECK(ng == nr && !memcmp(got, ref, sizeof(int32_t) * (size_t)(nr > 0 ? nr : 0)),
                      "%s: %s prompt through a %d-node chain (%s) equals the local run exactly (%d tokens): %s", names[mi],
                      pi ? "long" : "short", ci ? 3 : 2, ci ? "1 + L-2 + 1 layers" : "1 + L-1 layers", ng, e ? e : "");
                free(e);
            }
            /* slices sharing a block (bounds "L.5": attention in one slice,
             * feed-forward in the next), including a slice of one block's
             * attention alone and one that starts with a feed-forward and
             * ends the model */
            if (pi == 0) part_half_blocks(names[mi], path, pf, npred, ref, nr, L);
            /* the slices' own chunk rows (chain_chunk_rows): at -b 512 a
             * ~900-token prompt is cut into 128-row chunks, not 2 of 512 */
            if (pi == 1) part_chunk_rows(path, pf, npred, ref, nr, L);
            /* lossy hidden states: measured */
            const char *acts[] = { "f16", "bf16" };
            for (int ai = 0; ai < 2 && pi == 0; ai++) {
                e = NULL;
                int ng = run_chain(path, pf, npred, s3, acts[ai], got, 64, &e, 120000);
                CHECK(ng == nr, "%s: %s hidden states: run (%s)", names[mi], acts[ai], e ? e : "");
                free(e);
                if (ng != nr || nr <= 0) continue;
                g_act_first[ai] += got[0] == ref[0];
                g_act_same[ai] += !memcmp(got, ref, sizeof(int32_t) * (size_t)nr);
                if (ai == 0) g_act_n++;
            }
        }
        snode_stop(&a); snode_stop(&b); snode_stop(&c); snode_stop(&d);
    }
    printf("chain: lossy hidden states over %d model files (3-node chain, short prompt, 8 greedy tokens): "
           "f16 first token %d/%d, all tokens %d/%d; bf16 first token %d/%d, all tokens %d/%d\n", g_act_n,
           g_act_first[0], g_act_n, g_act_same[0], g_act_n, g_act_first[1], g_act_n, g_act_same[1], g_act_n);
    /* bf16 keeps 8 bits of the residual stream: a floor, not equality */
    CHECK(g_act_first[0] * 2 >= g_act_n, "f16 hidden states: first token on %d of %d files", g_act_first[0], g_act_n);
}

/* ==== 2, 3. Refusals and faults ==== */

static void part_faults(void) {
    char path[512], other[512];
    t_fixture_path(path, sizeof path, "models/qwen3-mini-Q8_0.gguf");
    t_fixture_path(other, sizeof other, "models/qwen3-mini-Q4_K_M.gguf");
    if (!t_need(path) || !t_need(other)) return;
    int L = model_layers(path);
    snode a, b, w, x;
    const char *slow[] = { "--debug-frame-delay-ms", "30", NULL };
    if (snode_start(&a, path, 0, 2, NULL) || snode_start(&b, path, 2, L, slow) || snode_start(&w, path, 0, 0, NULL) ||
        snode_start(&x, other, 2, L, NULL)) {
        CHECK(0, "fault nodes start");
        snode_stop(&a); snode_stop(&b); snode_stop(&w); snode_stop(&x);
        return;
    }
    char *pf = write_prompt(PROMPT);
    int32_t ids[64];
    char spec[700], *e = NULL;
    /* a slice other than the spec's */
    snprintf(spec, sizeof spec, "127.0.0.1:%d/0:1,127.0.0.1:%d/1:%d", a.port, b.port, L);
    int n = run_chain(path, pf, 4, spec, NULL, ids, 64, &e, 60000);
    CHECK(n < 0 && e && strstr(e, "chain refused") && strstr(e, "serves layers 0:2, the chain names it for 0:1"),
          "wrong slice refused by name: %s", e ? e : "");
    free(e);
    char *alog = slurp(a.log);
    CHECK(!strstr(alog, "done tokens"), "nothing computed for a refused chain");
    free(alog);
    /* a whole-model node named as a slice */
    snprintf(spec, sizeof spec, "127.0.0.1:%d/0:2,127.0.0.1:%d/2:%d", w.port, b.port, L);
    e = NULL;
    n = run_chain(path, pf, 4, spec, NULL, ids, 64, &e, 60000);
    CHECK(n < 0 && e && strstr(e, "serves no layer slice"), "whole-model node refused in a chain: %s", e ? e : "");
    free(e);
    /* another model's slice: the fingerprint */
    snprintf(spec, sizeof spec, "127.0.0.1:%d/0:2,127.0.0.1:%d/2:%d", a.port, x.port, L);
    e = NULL;
    n = run_chain(path, pf, 4, spec, NULL, ids, 64, &e, 60000);
    CHECK(n < 0 && e && strstr(e, "model mismatch"), "another model's slice refused: %s", e ? e : "");
    free(e);
    snode_stop(&w);
    snode_stop(&x);

    /* node 1's baseline after one whole chain request (its buffers made) */
    snprintf(spec, sizeof spec, "127.0.0.1:%d/0:2,127.0.0.1:%d/2:%d", a.port, b.port, L);
    e = NULL;
    n = run_chain(path, pf, 2, spec, NULL, ids, 64, &e, 60000);
    CHECK(n == 2, "chain before the faults: %s", e ? e : "");
    free(e);
    int fd0 = settled_fds(a.pid);
    long rss0 = rss_kb(a.pid);
    /* kill -9 of the second node mid-prefill (it sleeps 30 ms per KV frame) */
    char longp[8192];
    size_t o = 0;
    for (int i = 0; i < 12; i++) o += (size_t)snprintf(longp + o, sizeof longp - o, "%s ", PROMPT);
    char *lpf = write_prompt(longp);
    snprintf(spec, sizeof spec, "127.0.0.1:%d/0:2,127.0.0.1:%d/2:%d", a.port, b.port, L);
    char out[300], err[300];
    snprintf(out, sizeof out, "%s/kill.out", g_tmp);
    snprintf(err, sizeof err, "%s/kill.err", g_tmp);
    char *argv[] = { (char *)bin(), "run", "-m", path, "-f", lpf, "-n", "2", "--ids", "-t", "1", "--prefill-node", spec,
                     "--secret-file", g_secret, "--timeout-ms", "3000", NULL };
    int bfd = settled_fds(b.pid);
    double t0 = now_ms();
    pid_t rp = spawn_io(argv, NULL, out, err);
    /* mid-prefill: once the decode side's connection is there (its model
     * load takes seconds on a loaded machine), and a little after */
    for (int i = 0; i < 600 && count_fds(b.pid) <= bfd; i++) sleep_ms(50);
    sleep_ms(300);
    t0 = now_ms();
    kill(b.pid, SIGKILL);
    wait_exit(b.pid, 5000);
    b.pid = 0;
    int rc = wait_exit(rp, 30000);
    e = slurp(err);
    CHECK(rc != 0 && e && strstr(e, "chain node 2 of 2") && now_ms() - t0 < 15000,
          "kill -9 of node 2 mid-prefill: rc %d in %.0f ms: %s", rc, now_ms() - t0, e ? e : "");
    free(e);
    /* the first node is still healthy: a new second node, a full chain again */
    CHECK(kill(a.pid, 0) == 0, "node 1 alive after node 2 died");
    if (snode_start(&b, path, 2, L, NULL) == 0) {
        snprintf(spec, sizeof spec, "127.0.0.1:%d/0:2,127.0.0.1:%d/2:%d", a.port, b.port, L);
        int32_t ref[8];
        e = NULL;
        int nr = run_chain(path, pf, 4, NULL, NULL, ref, 8, NULL, 60000);
        n = run_chain(path, pf, 4, spec, NULL, ids, 64, &e, 60000);
        CHECK(n == 4 && nr == 4 && !memcmp(ids, ref, sizeof ref[0] * 4), "chain after a restart equals local: %s", e ? e : "");
        free(e);
        int fd1 = settled_fds(a.pid);
        long rss1 = rss_kb(a.pid);
        printf("chain: node 1 after kill -9 of node 2 and a new chain: fds %d -> %d, RSS %ld -> %ld KiB\n", fd0, fd1, rss0, rss1);
        /* a session's KV pages and the connection's buffers go with it; 4 MiB of allocator slack
         * (under AddressSanitizer freed memory waits in its quarantine: fds only) */
        int asan = getenv("TANDEM_ASAN") != NULL;
        CHECK(fd1 <= fd0 && (asan || rss1 <= rss0 + 4096), "node 1 back to baseline: fds %d -> %d, RSS %ld -> %ld KiB%s",
              fd0, fd1, rss0, rss1, asan ? " (RSS not judged under ASan)" : "");
    }
    snode_stop(&a);
    snode_stop(&b);

    /* a first node that stops sending after its first ACT frame */
    const char *stall[] = { "--debug-act-stall", "1", NULL };
    if (snode_start(&a, path, 0, 2, stall) || snode_start(&b, path, 2, L, NULL)) { CHECK(0, "stall nodes"); snode_stop(&a); snode_stop(&b); return; }
    snprintf(spec, sizeof spec, "127.0.0.1:%d/0:2,127.0.0.1:%d/2:%d", a.port, b.port, L);
    t0 = now_ms();
    e = NULL;
    n = run_chain(path, lpf, 2, spec, NULL, ids, 64, &e, 30000);
    CHECK(n < 0 && e && strstr(e, "timed out") && now_ms() - t0 < 15000, "stalled node: rc in %.0f ms: %s", now_ms() - t0,
          e ? e : "");
    free(e);
    sleep_ms(500);
    CHECK(kill(a.pid, 0) == 0 && kill(b.pid, 0) == 0, "both nodes alive after the stall");
    snode_stop(&a);
    snode_stop(&b);
}

/* Hostile ACT frames straight to a slice that takes hidden states. */
static void part_act_attack(void) {
    char path[512];
    t_fixture_path(path, sizeof path, "models/stories260K.gguf");
    if (!t_need(path)) return;
    snode b;
    if (snode_start(&b, path, 2, 5, NULL)) { CHECK(0, "attack node"); return; }
    model *m = NULL;
    char err[512], addr[64];
    model_opts mo = { .n_threads = 1, .fingerprint_later = 0 };
    if (model_load(&m, path, &mo, err, sizeof err)) { CHECK(0, "load: %s", err); snode_stop(&b); return; }
    snprintf(addr, sizeof addr, "127.0.0.1:%d", b.port);
    handoff_opts ho = { .secret = CHAIN_SECRET, .secret_len = strlen(CHAIN_SECRET), .timeout_ms = 3000, .node_id = "attacker" };
    int32_t toks[12] = { 1, 20, 30, 40, 50, 60, 70, 80, 90, 100, 110, 120 };
    float rows[12 * 64];
    for (int i = 0; i < 12 * 64; i++) rows[i] = 0.01f * (float)(i % 97);
    const char *what[] = { "another request's id", "a wrong width", "a gap in the positions" };
    for (int k = 0; k < 3; k++) {
        handoff_client *c = NULL;
        if (handoff_connect(&c, addr, m, GGML_TYPE_F16, &ho, err, sizeof err)) { CHECK(0, "connect: %s", err); break; }
        uint64_t req = handoff_send_request(c, toks, 12, 0, 11, 0, err, sizeof err);
        wire_conn *wc = handoff_conn(c);
        wire_buf fb = { 0 };
        int rc;
        if (k == 0) rc = chain_act_send(wc, req - (1ull << 32), 0, GGML_TYPE_F32, 0, 4, 64, rows, &fb, err, sizeof err);
        else if (k == 1) rc = chain_act_send(wc, req, 0, GGML_TYPE_F32, 0, 4, 32, rows, &fb, err, sizeof err);
        else {
            rc = chain_act_send(wc, req, 0, GGML_TYPE_F32, 0, 4, 64, rows, &fb, err, sizeof err);
            if (!rc) rc = chain_act_send(wc, req, 0, GGML_TYPE_F32, 6, 4, 64, rows, &fb, err, sizeof err);
        }
        wire_buf_free(&fb);
        /* the node answers with an ERROR and sends no DONE */
        int refused = 0, done = 0;
        for (int f = 0; f < 64 && rc == 0; f++) {
            wire_header h;
            if (wire_recv(wc, &h, err, sizeof err)) break;
            if (h.type == WIRE_ERROR) { refused = 1; break; }
            if (h.type == WIRE_DONE) { done = 1; break; }
        }
        CHECK(rc == 0 && refused && !done, "ACT with %s refused (error %d, done %d)", what[k], refused, done);
        handoff_close(c);
    }
    CHECK(kill(b.pid, 0) == 0, "slice node alive after hostile ACT frames");
    model_free(m);
    snode_stop(&b);
}

/* ==== 4. Decode node ==== */

static void part_decode(void) {
    char path[512];
    t_fixture_path(path, sizeof path, "models/qwen3-mini-Q8_0.gguf");
    if (!t_need(path)) return;
    int L = model_layers(path);
    snode a, b;
    if (snode_start(&a, path, 0, 1, NULL) || snode_start(&b, path, 1, L, NULL)) { CHECK(0, "decode part nodes"); snode_stop(&a); snode_stop(&b); return; }
    char spec[600];
    snprintf(spec, sizeof spec, "127.0.0.1:%d/0:1,127.0.0.1:%d/1:%d", a.port, b.port, L);
    int port;
    pid_t dp = dnode_start_on(path, spec, NULL, 60000, &port);
    CHECK(port > 0, "decode node over a chain starts");
    if (port <= 0) { snode_stop(&a); snode_stop(&b); return; }
    static node_auth_key key;
    node_auth_derive(&key, CHAIN_SECRET, strlen(CHAIN_SECRET), NODE_AUTH_LABEL_DECODE_API);
    sign_key = &key;
    chain_check_reuse(port, path, "CPU chain", 60000);
    /* the chain's second node dies: the request falls back to local prefill */
    kill(b.pid, SIGKILL);
    wait_exit(b.pid, 5000);
    b.pid = 0;
    int st;
    json_t *o = gen(port, "A completely different prompt about mountains and rivers.", 4, &st);
    CHECK(st == 200 && !strcmp(jstr(o, "prefill", "mode"), "local") && strstr(jstr(o, "prefill", "fallback_reason"), "127.0.0.1"),
          "dead chain node: local fallback (status %d, mode %s, reason %s)", st, jstr(o, "prefill", "mode"),
          jstr(o, "prefill", "fallback_reason"));
    json_decref(o);
    sign_key = NULL;
    CHECK(stop_proc(dp, 20000) == 0, "decode node exits cleanly");
    snode_stop(&a);
}

/* ==== 4b. Router ==== */

/* The chain spec of /v1/models' (or /v1/models/q's) model "q" when its
 * prefill_chains has one entry and that one is up; "" otherwise. */
static void models_chain(int rport, const char *path, char *out, size_t outlen) {
    char *body = NULL;
    out[0] = 0;
    int st = http(rport, "GET", path, NULL, &body);
    json_t *j = st == 200 && body ? json_loads(body, 0, NULL) : NULL;
    json_t *data = json_object_get(j, "data"), *m = data ? NULL : j;
    for (size_t i = 0; data && i < json_array_size(data); i++)
        if (!strcmp(jstr(json_array_get(data, i), "id", NULL), "q")) m = json_array_get(data, i);
    json_t *ch = json_object_get(m, "prefill_chains");
    if (json_array_size(ch) == 1 && json_is_true(json_object_get(json_array_get(ch, 0), "up")))
        snprintf(out, outlen, "%s", jstr(json_array_get(ch, 0), "chain", NULL));
    json_decref(j);
    free(body);
}

/* /v1/models and /v1/models/q list the chain (up) under the model it serves. */
static void models_show_chain(int rport, const char *spec) {
    char got[700] = "", one[700] = "";
    for (int i = 0; i < 100 && strcmp(got, spec); i++) {   /* the decode node's health check lists the model */
        models_chain(rport, "/v1/models", got, sizeof got);
        if (strcmp(got, spec)) sleep_ms(100);
    }
    CHECK(!strcmp(got, spec), "/v1/models lists the chain under its model: '%s'", got);
    models_chain(rport, "/v1/models/q", one, sizeof one);
    CHECK(!strcmp(one, spec), "/v1/models/q lists the chain: '%s'", one);
}

/* A router whose prefill entry is a chain: /health and /metrics show it up,
 * a completion is prefilled through it (X-Tandem-Prefill-Node names the
 * chain) and equals tandem run; a spec with a gap is refused at start. */
static void part_router(void) {
    char path[512];
    t_fixture_path(path, sizeof path, "models/qwen3-mini-Q8_0.gguf");
    if (!t_need(path)) return;
    int L = model_layers(path);
    char spec[600], pf[300], rpf[300], log[300], rlog[300], dp[300], rp[700];
    snprintf(rp, sizeof rp, "q=127.0.0.1:1/0:1,127.0.0.1:2/2:%d", L);
    char *bad[] = { (char *)bin(), "serve", "--role", "router", "--listen", "127.0.0.1:0", "--secret-file", g_secret,
                    "--prefill", rp, NULL };
    char *e = NULL;
    snprintf(rlog, sizeof rlog, "%s/router-bad.log", g_tmp);
    int rc = wait_exit(spawn_io(bad, NULL, "/dev/null", rlog), 10000);
    e = slurp(rlog);
    CHECK(rc == 2 && e && strstr(e, "layers must be 1:B"), "router refuses a chain with a gap (rc %d): %s", rc, e ? e : "");
    free(e);
    snode a, b;
    if (snode_start(&a, path, 0, 1, NULL) || snode_start(&b, path, 1, L, NULL)) { CHECK(0, "router part nodes"); snode_stop(&a); snode_stop(&b); return; }
    snprintf(spec, sizeof spec, "127.0.0.1:%d/0:1,127.0.0.1:%d/1:%d", a.port, b.port, L);
    snprintf(pf, sizeof pf, "%s/rdport", g_tmp);
    snprintf(log, sizeof log, "%s/rdecode.log", g_tmp);
    char *dargv[] = { (char *)bin(), "serve", "--role", "decode", "-m", path, "--secret-file", g_secret, "--listen",
                      "127.0.0.1:0", "--port-file", pf, "-t", "1", "--parallel", "1", NULL };
    pid_t dpid = spawn_io(dargv, NULL, "/dev/null", log);
    int dport = wait_port(pf, dpid, 60000);
    snprintf(dp, sizeof dp, "q=127.0.0.1:%d", dport);
    snprintf(rp, sizeof rp, "q=%s", spec);
    snprintf(rpf, sizeof rpf, "%s/rport", g_tmp);
    snprintf(rlog, sizeof rlog, "%s/router.log", g_tmp);
    char *rargv[] = { (char *)bin(), "serve", "--role", "router", "--listen", "127.0.0.1:0", "--secret-file", g_secret,
                      "--decode", dp, "--prefill", rp, "--split", "always", "--health-interval-ms", "200",
                      "--port-file", rpf, NULL };
    pid_t rpid = dport > 0 ? spawn_io(rargv, NULL, "/dev/null", rlog) : 0;
    int rport = rpid > 0 ? wait_port(rpf, rpid, 30000) : -1;
    CHECK(rport > 0, "router over a chain starts");
    if (rport > 0) {
        /* wait until the chain's health check passed */
        char series[900];
        snprintf(series, sizeof series, "tandem_node_up{node=\"%s\",role=\"prefill\",model=\"q\"}", spec);
        double up = 0;
        for (int i = 0; i < 100 && up != 1; i++) { up = metric_value(rport, series); if (up != 1) sleep_ms(100); }
        CHECK(up == 1, "/metrics shows the chain up: %s = %g", series, up);
        char *body = NULL;
        int st = http(rport, "GET", "/health", NULL, &body);
        CHECK(st == 200 && body && strstr(body, spec) && strstr(body, "chain of 2"), "/health lists the chain (%d): %.300s", st,
              body ? body : "");
        free(body);
        models_show_chain(rport, spec);
        char *pfile = write_prompt(PROMPT);
        char *largv[] = { (char *)bin(), "run", "-m", path, "-f", pfile, "-n", "4", "--ignore-eos", "-t", "1", NULL };
        char *want = run_capture(largv);
        if (want && *want && want[strlen(want) - 1] == '\n') want[strlen(want) - 1] = 0;   /* run ends its output with one */
        json_t *req = json_pack("{s:s, s:s, s:i, s:f, s:b}", "model", "q", "prompt", PROMPT, "max_tokens", 4, "temperature", 0.0,
                                "ignore_eos", 1);
        char *raw = NULL, *js = json_dumps(req, 0);
        st = http_raw(rport, "POST", "/v1/completions", "Content-Type: application/json\r\n", js, &raw);
        char hv[700] = "";
        http_header(raw ? raw : "", "X-Tandem-Prefill-Node", hv, sizeof hv);
        const char *bodyp = raw ? strstr(raw, "\r\n\r\n") : NULL;
        json_t *resp = bodyp ? json_loads(bodyp + 4, 0, NULL) : NULL;
        const char *text = resp ? jstr(json_array_get(json_object_get(resp, "choices"), 0), "text", NULL) : "";
        CHECK(raw && strstr(raw, " 200 ") && !strcmp(hv, spec), "completion prefilled through the chain (prefill node '%s')", hv);
        CHECK(want && text && !strcmp(text, want), "completion through the router and the chain equals tandem run: '%s' vs '%s'",
              text ? text : "", want ? want : "");
        json_decref(resp);
        free(want);
        /* the router learned the chain's rate from that request */
        snprintf(series, sizeof series, "tandem_node_prefill_tokens_per_second{node=\"%s\",role=\"prefill\",model=\"q\"}", spec);
        double tps = metric_value(rport, series);
        CHECK(tps > 0, "the router learned the chain's prefill rate: %g t/s", tps);
        free(js);
        free(raw);
        json_decref(req);
    }
    if (rpid > 0) CHECK(stop_proc(rpid, 20000) == 0, "router exits cleanly");
    if (dpid > 0) stop_proc(dpid, 20000);
    snode_stop(&a);
    snode_stop(&b);
}

/* ==== 5. Memory ==== */

static void part_memory(void) {
    char path[512];
    snprintf(path, sizeof path, "%s/qwen3-mini-F16.gguf", t_models());
    if (!t_need(path)) return;
    int L = model_layers(path);
    snode w, s0, s1;
    if (snode_start(&w, path, 0, 0, NULL) || snode_start(&s0, path, 0, 1, NULL) || snode_start(&s1, path, 1, L, NULL)) {
        CHECK(0, "memory nodes");
    } else {
        long rw = rss_kb(w.pid), r0 = rss_kb(s0.pid), r1 = rss_kb(s1.pid);
        printf("chain: qwen3-mini-F16 (%d layers) RSS after load: whole model %ld KiB, slice 0:1 %ld KiB, slice 1:%d %ld KiB\n",
               L, rw, r0, L, r1);
        /* slice 1:L holds no embedding and no output head: less than the whole */
        CHECK(r1 < rw && r0 < rw, "slices hold less than the whole model (%ld, %ld < %ld KiB)", r0, r1, rw);
    }
    snode_stop(&w); snode_stop(&s0); snode_stop(&s1);
}

int main(void) {
    signal(SIGPIPE, SIG_IGN);
    for (const char *const *v = (const char *const[]){ "TANDEM_SECRET", "TANDEM_LOG_LEVEL", "TANDEM_KERNELS", NULL }; *v; v++)
        unsetenv(*v);
    if (chain_tmp_open("/tmp/tandem-chain-XXXXXX", CHAIN_SECRET)) return 1;
    part_half_parse();
    part_act_attack();
    part_faults();
    part_decode();
    part_router();
    part_memory();
    part_models();
    chain_tmp_close();
    return t_done("test_chain");
}

/* test_chain_backend.c - layer-split prefill chains with slices on another
 * backend than the CPU (MLX or CUDA), and chains mixing them with CPU slices
 * (issue 41: activations are backend-neutral).
 *
 * The other backend X comes from TANDEM_PREFILL_BACKEND (the slices are
 * prefill nodes): mlx (the default) or cuda; what each needs is in BACKENDS
 * below. Run in the build that links X: make MLX=1 mlx (tools/mlx_check.sh
 * runs build-mlx/test_chain_backend with TANDEM_BIN=build-mlx/tandem) or make
 * CUDA=1 BUILD=build-cuda (tools/cuda_check.sh's step "chain", on a GPU, with
 * TANDEM_PREFILL_BACKEND=cuda); real processes on loopback, slice nodes
 * `tandem serve --role prefill --layers A:B --backend X|cpu -b 16` (every
 * prompt crosses several chunks), the CPU single-node `tandem run` giving the
 * references:
 *   1. chains of 2 and 3 slices: X only (a mid-block bound, one-block
 *      slices, slices of unequal length), X then CPU, CPU then X, and
 *      three mixing both ways (an attention-only X slice among them);
 *      each with a CPU decode side and an X one (`tandem run --backend
 *      X`); the first model also takes a long prompt (about 25 chunks).
 *      F16/F32 files: the greedy tokens exactly equal the CPU single-node
 *      run's; quantized files (weights round differently on the two
 *      backends): agreement measured, with test_handoff's floor for X
 *      (the first token on at least half of the runs);
 *   2. a decode node (CPU, then X) over an X chain: generation equals
 *      the CPU run, prefix reuse sends only the missing span; then kill -9
 *      of an X slice mid-prefill, after the decode node received part of
 *      its rows: the decode node falls back to local prefill and answers
 *      the CPU's tokens (the partial rows were dropped, not merged);
 *   3. memory: an X slice node's RSS is below an X whole-model node's.
 * TANDEM_HANDOFF_ONLY (as test_handoff) narrows part 1 to the model files
 * whose names contain it (MLX_QUICK: stories260K, the F32 and F16 files).
 * CUDA linked but no CUDA device here: a counted skip "cuda" (a failure
 * under TANDEM_REQUIRE=cuda, as tools/cuda_check.sh sets), as test_handoff.
 * X not linked (the plain build, CI): a slice node with --backend B refuses
 * at start-up, naming the build that has B, for every backend B of BACKENDS
 * this build lacks.
 */
#include <pthread.h>

#include "engine/backend.h"
#include "engine/gguf.h"
#include "net/wire_act.h"
#include "proc.h"
#include "t.h"
#include "node/chain_nodes.h"

/* ==== The other backend ==== */

/* The CUDA backend is compiled into the library (and every test) with
 * -DTANDEM_CUDA by make CUDA=1, so this test's own flags tell; MLX's
 * object is linked in afterwards, which backend_mlx_linked() tells. */
static int chain_cuda_linked(void) {
#ifdef TANDEM_CUDA
    return 1;
#else
    return 0;
#endif
}

typedef struct {
    const char *name;      /* --backend's value, TANDEM_PREFILL_BACKEND's */
    const char *label;     /* in messages */
    int (*linked)(void);   /* 1 where this build has it */
    const char *refusal;   /* what a build without it says at start-up (model.c, backend_mlx_absent.c) */
    int probe_device;      /* 1: a device may be missing (t_cuda_absent: a counted skip "cuda") */
    int q_floor_den;       /* quantized files: the first token on at least 1/den of the runs */
} slice_backend;

/* The floors are test_handoff's in its cross-backend runs (CUDA prefill
 * nodes, an MLX decode side): quantized files, the first token on at least
 * half of the runs; F16/F32 files exact on both backends. */
static const slice_backend BACKENDS[] = {
    { "mlx", "MLX", backend_mlx_linked, "make MLX=1 mlx", 0, 2 },
    { "cuda", "CUDA", chain_cuda_linked, "make CUDA=1", 1, 2 },
};
#define N_BACKENDS (int)(sizeof BACKENDS / sizeof BACKENDS[0])

static const slice_backend *X;   /* the backend under test */

/* 32 random bytes in hex: nodes refuse a secret of less entropy */
#define CM_SECRET "5b1e07d2c9a84f3e6d0b2a1c9e8f7d6c5b4a3928171605f4e3d2c1b0a9988776"

/* ==== Nodes and runs ==== */

/* A slice node of half-block bounds lo2:hi2 on backend be (X->name or "cpu"). */
static int snode_start(snode *n, const char *model, int lo2, int hi2, const char *be, const char *const *extra) {
    return snode_start_on(n, model, lo2, hi2, be, 120000, extra);
}

/* `tandem run` with ids out on backend be (NULL: the CPU); spec NULL:
 * local. The count, or -1 on a failed run (then *errout holds its stderr). */
static int run_chain(const char *model, const char *prompt_path, int n_pred, const char *spec, const char *be,
                     int32_t *ids, int cap, char **errout) {
    return chain_run(model, prompt_path, n_pred, spec, "20000", be ? "--backend" : NULL, be, 300000, ids, cap, errout);
}

/* The long prompt: PROMPT n times (about 50 tokens each). */
static void long_prompt(char *buf, size_t cap, int n) {
    size_t o = 0;
    buf[0] = 0;
    for (int i = 0; i < n && o + 300 < cap; i++) o += (size_t)snprintf(buf + o, cap - o, "%s ", PROMPT);
}

/* ==== 1. Chains ==== */

#define M "X"   /* the backend under test, X->name when started */
#define C "cpu"
/* a bound counted from the model's end, in half blocks: END(2) is block L-1 */
#define END(k) (10000 - (k))

typedef struct {
    const char *what;   /* '@': the backend under test's label */
    int n;
    const char *be[3];
    int b[4];   /* half blocks; END(k) = 2L - k */
} chain_def;

static const chain_def CHAINS[] = {
    { "@ + @, a mid-block bound", 2, { M, M }, { 0, 3, END(0) } },
    { "@ x3: one block, L-2 blocks, one block", 3, { M, M, M }, { 0, 2, END(2), END(0) } },
    { "@ then CPU", 2, { M, C }, { 0, 4, END(0) } },
    { "CPU then @, a mid-block bound", 2, { C, M }, { 0, 3, END(0) } },
    { "CPU, @, CPU (one block, 1.5 blocks, the rest)", 3, { C, M, C }, { 0, 2, 5, END(0) } },
    { "@ (block 0's attention), CPU, @ (the last block)", 3, { M, C, M }, { 0, 1, END(2), END(0) } },
};
#define N_CHAINS (int)(sizeof CHAINS / sizeof CHAINS[0])

static int g_q_n, g_q_first, g_q_all, g_exact_runs;   /* quantized runs and their agreement; exact runs */

static int bound_of(int b, int L) { return b > 5000 ? 2 * L - (10000 - b) : b; }

static const char *be_of(const char *b) { return strcmp(b, M) ? b : X->name; }

/* A chain's description with '@' replaced by X's label. */
static void what_of(char *out, size_t len, const char *what) {
    size_t o = 0;
    for (const char *p = what; *p && o + 8 < len; p++) {
        if (*p == '@') o += (size_t)snprintf(out + o, len - o, "%s", X->label);
        else out[o++] = *p;
    }
    out[o] = 0;
}

/* One chain's nodes on model path: 0, or -1 (nodes stopped). */
static int chain_start(const chain_def *d, const char *path, int L, snode *ns) {
    for (int i = 0; i < d->n; i++) {
        if (snode_start(&ns[i], path, bound_of(d->b[i], L), bound_of(d->b[i + 1], L), be_of(d->be[i]), NULL) == 0) continue;
        for (int j = 0; j < i; j++) snode_stop(&ns[j]);
        return -1;
    }
    return 0;
}

static void part_model(const char *name, const char *path, int exact, int with_long) {
    int L = model_layers(path);
    CHECK(L >= 4, "%s: %d layers", name, L);
    if (L < 4) return;
    char longp[8192];
    long_prompt(longp, sizeof longp, 4);   /* ~400 tokens: 25 chunks of 16 (stories260K: 512 of context) */
    const char *prompts[] = { PROMPT, longp };
    char *pfs[2] = { NULL, NULL };
    int32_t ref[2][64];
    int nref[2], npred = 8;
    for (int pi = 0; pi < 1 + with_long; pi++) {
        char path_copy[300];
        snprintf(path_copy, sizeof path_copy, "%s", write_prompt(prompts[pi]));
        pfs[pi] = strdup(path_copy);
        char *e = NULL;
        nref[pi] = run_chain(path, pfs[pi], npred, NULL, NULL, ref[pi], 64, &e);
        CHECK(nref[pi] == npred, "%s: CPU single-node run (%d tokens): %s", name, nref[pi], nref[pi] < 0 && e ? e : "");
        free(e);
    }
    for (int ci = 0; ci < N_CHAINS; ci++) {
        const chain_def *d = &CHAINS[ci];
        char what[128];
        what_of(what, sizeof what, d->what);
        snode ns[3];
        if (chain_start(d, path, L, ns)) { CHECK(0, "%s: %s: slice nodes start", name, what); continue; }
        char spec[900];
        snode *pn[3] = { &ns[0], &ns[1], &ns[2] };
        spec_of(spec, sizeof spec, pn, d->n);
        for (int pi = 0; pi < 1 + with_long; pi++) {
            for (int di = 0; di < 2; di++) {
                const char *dbe = di ? X->name : NULL;
                int32_t got[64];
                char *e = NULL;
                int ng = run_chain(path, pfs[pi], npred, spec, dbe, got, 64, &e);
                int same = ng == nref[pi] && nref[pi] > 0 && !memcmp(got, ref[pi], sizeof(int32_t) * (size_t)nref[pi]);
                if (exact) {
                    CHECK(same, "%s: %s (%s), %s prompt, %s decode side: the CPU single-node tokens exactly (%d): %s",
                          name, what, spec, pi ? "long" : "short", dbe ? X->label : "CPU", ng, same ? "" : e ? e : "");
                    g_exact_runs += same;
                } else {
                    CHECK(ng == npred, "%s: %s, %s decode side: the run completes (%d): %s", name, what,
                          dbe ? X->label : "CPU", ng, ng == npred ? "" : e ? e : "");
                    g_q_n++;
                    g_q_first += ng > 0 && nref[pi] > 0 && got[0] == ref[pi][0];
                    g_q_all += same;
                }
                free(e);
            }
        }
        for (int i = 0; i < d->n; i++) {
            CHECK(kill(ns[i].pid, 0) == 0, "%s: %s: slice %d alive after its requests", name, what, i + 1);
            snode_stop(&ns[i]);
        }
    }
    free(pfs[0]);
    free(pfs[1]);
}

static void part_chains(void) {
    const char *names[] = { "stories260K-F16", "stories260K", "qwen3-mini-F16", "qwen2-mini-F16", "qwen3moe-mini-F16",
                            "qwen3-mini-Q8_0", "qwen3-mini-Q4_K_M", "qwen2-mini-Q4_0", "qwen3moe-mini-Q4_K_M" };
    const char *only = getenv("TANDEM_HANDOFF_ONLY");
    double t0 = now_ms();
    int files = 0;
    for (size_t mi = 0; mi < sizeof names / sizeof names[0]; mi++) {
        if (only && *only && !strstr(names[mi], only)) continue;
        char path[512], rel[128];
        int gen = strstr(names[mi], "-F16") && strncmp(names[mi], "stories", 7);
        if (gen) snprintf(path, sizeof path, "%s/%s.gguf", t_models(), names[mi]);
        else { snprintf(rel, sizeof rel, "models/%s.gguf", names[mi]); t_fixture_path(path, sizeof path, rel); }
        if (!t_need(path)) continue;
        int exact = strstr(names[mi], "-F16") || !strcmp(names[mi], "stories260K");
        part_model(names[mi], path, exact, mi == 0);
        files++;
    }
    printf("chain_%s: %d model files x %d chains x 2 decode sides: %d runs equal the CPU single-node tokens "
           "exactly (F16/F32); quantized: first token %d/%d, all 8 tokens %d/%d; %.1f s\n", X->name, files, N_CHAINS,
           g_exact_runs, g_q_first, g_q_n, g_q_all, g_q_n, (now_ms() - t0) / 1e3);
    /* quantized weights round differently on the two backends: test_handoff's floor */
    if (g_q_n)
        CHECK(g_q_first * X->q_floor_den >= g_q_n, "%s: quantized files: first token agrees on %d of %d runs, need 1/%d",
              X->label, g_q_first, g_q_n, X->q_floor_den);
}

/* ==== 2. A decode node over an X chain ==== */

static pid_t dnode_start(const char *path, const char *spec, const char *be, int *port) {
    return dnode_start_on(path, spec, be, 120000, port);
}

typedef struct { int port, st; const char *prompt; json_t *o; } greq;

static void *greq_run(void *arg) {
    greq *g = arg;
    g->o = gen(g->port, g->prompt, 6, &g->st);
    return NULL;
}

/* Prefix reuse through the chain (a, b) on decode node port. */
static void decode_reuse(const char *be, const char *path, int port) {
    char who[64];
    snprintf(who, sizeof who, "%s decode node, %s chain", be, X->label);
    chain_check_reuse(port, path, who, 300000);
}

/* "(N of M positions complete)" in a fallback reason: N, M (-1 when absent). */
static void reason_positions(const char *r, int *n, int *m) {
    *n = *m = -1;
    const char *e = r ? strstr(r, " positions complete)") : NULL;
    const char *o = e;
    while (o && o > r && *o != '(') o--;
    if (o && *o == '(' && sscanf(o, "(%d of %d", n, m) != 2) *n = *m = -1;
}

/* One try: a fresh decode node over (a, c) with c an X slice slowed to
 * 200 ms a KV frame; its first request (a long prompt, 25 chunks) is sent,
 * and kill -9 ends c wait_ms after c's connection came. The request falls
 * back to local prefill with the CPU's tokens, the next one too. Returns
 * the positions the decode node had from c before the kill (-1 unknown). */
static int decode_kill_try(const char *be, const char *path, snode *a, int lo2, int hi2, int wait_ms) {
    const char *slow[] = { "--debug-frame-delay-ms", "200", NULL };
    snode c;
    if (snode_start(&c, path, lo2, hi2, X->name, slow)) { CHECK(0, "slowed %s slice starts", X->label); return -1; }
    char spec[600];
    snode *pn[] = { a, &c };
    spec_of(spec, sizeof spec, pn, 2);
    int port;
    pid_t dp = dnode_start(path, spec, be, &port);
    CHECK(port > 0, "%s decode node over a slowed %s chain starts", be, X->label);
    if (port <= 0) { wait_exit(dp, 0); snode_stop(&c); return -1; }
    char longp[8192];
    long_prompt(longp, sizeof longp, 4);
    int32_t ref[16];
    int nr = run_chain(path, write_prompt(longp), 6, NULL, NULL, ref, 16, NULL);
    int cfd = settled_fds(c.pid);
    greq g = { .port = port, .prompt = longp };
    pthread_t th;
    pthread_create(&th, NULL, greq_run, &g);
    int seen = 0;   /* the chain's connection reached the slice: its prefill is under way */
    for (int i = 0; i < 600 && !(seen = count_fds(c.pid) > cfd); i++) sleep_ms(20);
    sleep_ms(wait_ms);
    kill(c.pid, SIGKILL);
    wait_exit(c.pid, 5000);
    c.pid = 0;
    pthread_join(th, NULL);
    const char *why = jstr(g.o, "prefill", "fallback_reason");
    int got, total;
    reason_positions(why, &got, &total);
    printf("chain_%s: %s decode node, %s slice killed %d ms into its prefill: status %d, mode %s, %s\n", X->name, be,
           X->label, wait_ms, g.st, jstr(g.o, "prefill", "mode"), why);
    CHECK(seen, "%s decode node: the chain's connection reached the %s slice before the kill", be, X->label);
    CHECK(g.st == 200 && !strcmp(jstr(g.o, "prefill", "mode"), "local") && strstr(why, "127.0.0.1") &&
          same_ids(json_object_get(g.o, "tokens"), ref, nr),
          "%s decode node: kill -9 of an %s slice mid-prefill: local fallback with the CPU's tokens (status %d, mode %s, "
          "reason %s)", be, X->label, g.st, jstr(g.o, "prefill", "mode"), why);
    json_decref(g.o);
    /* the node serves on: the next request (the chain still down) too */
    int st;
    json_t *o = gen(port, PROMPT, 6, &st);
    int32_t r2[16];
    int n2 = run_chain(path, write_prompt(PROMPT), 6, NULL, NULL, r2, 16, NULL);
    CHECK(st == 200 && same_ids(json_object_get(o, "tokens"), r2, n2), "%s decode node: the next request equals the CPU "
          "run (status %d, mode %s)", be, st, jstr(o, "prefill", "mode"));
    json_decref(o);
    CHECK(stop_proc(dp, 20000) == 0, "%s decode node exits cleanly", be);
    return got > 0 && got < total ? got : -1;
}

/* kill -9 of an X slice mid-prefill, until one try killed it with part
 * of its rows already at the decode node (a later kill each try: how far
 * a loaded machine got is not known ahead); those rows must not count. */
static void decode_kill(const char *be, const char *path, snode *a, int lo2, int hi2) {
    const int waits[] = { 1200, 2500, 5000 };   /* 1500 ms: 32 of 397 rows at load 4.6 (4 KV frames a chunk) */
    int part = -1;
    for (int i = 0; i < 3 && part < 0; i++) part = decode_kill_try(be, path, a, lo2, hi2, waits[i]);
    CHECK(part > 0, "%s decode node: an %s slice killed with part of its rows received (%d), the answer still the CPU's",
          be, X->label, part);
}

static void part_decode(void) {
    char path[512];
    t_fixture_path(path, sizeof path, "models/stories260K-F16.gguf");
    if (!t_need(path)) return;
    int L = model_layers(path);
    static node_auth_key key;
    node_auth_derive(&key, CM_SECRET, strlen(CM_SECRET), NODE_AUTH_LABEL_DECODE_API);
    sign_key = &key;
    const char *bes[] = { "cpu", X->name };
    for (int bi = 0; bi < 2; bi++) {
        snode a, b;
        if (snode_start(&a, path, 0, 3, X->name, NULL) || snode_start(&b, path, 3, 2 * L, X->name, NULL)) {
            CHECK(0, "decode part: %s slice nodes start", X->label);
            snode_stop(&a); snode_stop(&b);
            continue;
        }
        char spec[600];
        snode *pn[] = { &a, &b };
        spec_of(spec, sizeof spec, pn, 2);
        int port;
        pid_t dp = dnode_start(path, spec, bes[bi], &port);
        CHECK(port > 0, "%s decode node over an %s chain starts", bes[bi], X->label);
        if (port > 0) decode_reuse(bes[bi], path, port);
        if (dp > 0) CHECK(stop_proc(dp, 20000) == 0, "%s decode node exits cleanly", bes[bi]);
        decode_kill(bes[bi], path, &a, 3, 2 * L);
        CHECK(kill(a.pid, 0) == 0 && kill(b.pid, 0) == 0, "the other %s slices alive after the kill", X->label);
        snode_stop(&a); snode_stop(&b);
    }
    sign_key = NULL;
}

/* ==== 3. Memory ==== */

static void part_memory(void) {
    char path[512];
    snprintf(path, sizeof path, "%s/qwen3-mini-F16.gguf", t_models());
    if (!t_need(path)) return;
    int L = model_layers(path);
    snode w, s0, s1;
    if (snode_start(&w, path, 0, 0, X->name, NULL) || snode_start(&s0, path, 0, 2, X->name, NULL) ||
        snode_start(&s1, path, 2, 2 * L, X->name, NULL)) {
        CHECK(0, "memory: %s nodes start", X->label);
    } else {
        long rw = rss_kb(w.pid), r0 = rss_kb(s0.pid), r1 = rss_kb(s1.pid);
        printf("chain_%s: qwen3-mini-F16 (%d layers) on %s, RSS after load: whole model %ld KiB, slice 0:1 %ld KiB, "
               "slice 1:%d %ld KiB\n", X->name, L, X->label, rw, r0, L, r1);
        /* each slice converts only its bound weights (1:L has no embedding, 0:1 one block) */
        CHECK(r0 < rw && r1 < rw, "%s slices hold less than the %s whole model (%ld, %ld < %ld KiB)", X->label, X->label,
              r0, r1, rw);
    }
    snode_stop(&w); snode_stop(&s0); snode_stop(&s1);
}

/* ==== Without the backend ==== */

/* A slice node with --backend b->name, in a build without it, refuses at
 * start-up and names the build that has it. */
static void check_absent(const slice_backend *b) {
    char path[512], log[300];
    t_fixture_path(path, sizeof path, "models/stories260K-F16.gguf");
    if (!t_need(path)) return;
    snprintf(log, sizeof log, "%s/absent-%s.log", g_tmp, b->name);
    char *argv[] = { (char *)bin(), "serve", "--role", "prefill", "-m", path, "--secret-file", g_secret, "--layers", "0:2",
                     "--backend", (char *)b->name, "--listen", "127.0.0.1:0", NULL };
    int rc = wait_exit(spawn_io(argv, NULL, "/dev/null", log), 60000);
    char *lg = slurp(log);
    CHECK(rc != 0 && lg && strstr(lg, b->refusal), "a slice node with --backend %s refuses, naming %s (rc %d): %s",
          b->name, b->refusal, rc, lg ? lg : "");
    free(lg);
}

/* 1 if X is linked but cannot start here for want of a device: a counted
 * skip "cuda" (t_cuda_absent; TANDEM_REQUIRE=cuda makes it a failure), or
 * a failure with the cause where it fails otherwise (as test_handoff). */
static int chain_device_missing(void) {
    if (!X->probe_device) return 0;
    char path[512];
    t_fixture_path(path, sizeof path, "models/stories260K.gguf");
    if (!t_need(path)) return 1;
    char *err = NULL;
    int32_t ids[4];
    int n = run_chain(path, write_prompt("Once"), 1, NULL, X->name, ids, 4, &err);
    int missing = n < 0 && t_cuda_absent(err);
    if (!missing) CHECK(n == 1, "tandem run --backend %s: %s", X->name, n == 1 ? "" : err ? err : "");
    free(err);
    return missing || n != 1;
}

/* TANDEM_PREFILL_BACKEND's entry of BACKENDS (default mlx), NULL if unknown. */
static const slice_backend *chain_backend_chosen(void) {
    const char *e = getenv("TANDEM_PREFILL_BACKEND");
    const char *name = e && *e ? e : "mlx";
    for (int i = 0; i < N_BACKENDS; i++)
        if (!strcmp(BACKENDS[i].name, name)) return &BACKENDS[i];
    CHECK(0, "TANDEM_PREFILL_BACKEND=%s: not a backend of this test (mlx, cuda)", name);
    return NULL;
}

int main(void) {
    signal(SIGPIPE, SIG_IGN);
    if (chain_tmp_open("/tmp/tandem-chain-backend-XXXXXX", CM_SECRET)) return 1;
    X = chain_backend_chosen();
    if (X && !X->linked()) {
        /* every backend this build lacks: the plain build checks both */
        printf("(built without %s: a slice node with --backend %s must refuse; so must every backend not linked)\n",
               X->label, X->name);
        for (int i = 0; i < N_BACKENDS; i++)
            if (!BACKENDS[i].linked()) check_absent(&BACKENDS[i]);
    } else if (X && !chain_device_missing()) {
        part_chains();
        part_decode();
        part_memory();
    }
    chain_tmp_close();
    return t_done("test_chain_backend");
}

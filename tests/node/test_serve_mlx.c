/* test_serve_mlx.c - serving nodes on the MLX backend (`serve --backend mlx`).
 *
 * Linked with the MLX object (make MLX=1 mlx; tools/mlx_check.sh runs it
 * with TANDEM_BIN=build-mlx/tandem), on the F16 fixture stories260K-F16,
 * real processes on loopback, a CPU local node (one slot) giving the
 * references:
 *   - a router in front of an MLX local node answers /v1/completions with
 *     the text and finish reason a router in front of the CPU node gives;
 *   - continuous batching: 6 requests at once on the MLX node (staggered,
 *     different lengths, streamed and not) each get the CPU node's greedy
 *     tokens, and the node batched them (more tokens than passes);
 *   - prefix sharing: a request whose first 48 tokens a finished one had
 *     computes from start_pos >= 48, and two arriving together with a
 *     shared 96-token prefix compute it once; the CPU's tokens each time;
 *   - speculative verification (`--lookup 8`): the CPU's greedy tokens,
 *     alone and 6 at once, with drafts verified; the same prompts alone
 *     on the node without lookup;
 *   - the first request a fresh MLX node evaluates (after its start-up
 *     calibration pass, made on another thread) gets the CPU's tokens;
 *   - the KV store (`--kv-cache-ram`, one slot): a prefix stored when its
 *     request ended, after another prompt took the slot, is loaded, not
 *     recomputed, and gives the CPU's tokens. The MLX backend stores F16
 *     rows on its side and writes the host cache only when a reader asks
 *     (session_rows_read before kvstore_put; the prefix check above covers
 *     the copy between slots): without that, the store keeps stale rows.
 * Without the MLX object (every other build) it checks that `serve
 * --backend mlx` refuses at start-up with the message naming the MLX build.
 */
#include "proc.h"

#include <pthread.h>

#include "engine/backend.h"

#define N_REQ 6
#define MAX_GEN 40

typedef struct {
    int port;
    int32_t prompt[200];
    int n_prompt, max_tokens, stream, delay_ms;
    int status, n_tok, start_pos;
    int32_t tok[MAX_GEN];
} req;

/* ==== Requests ==== */

static void req_run(req *r) {
    if (r->delay_ms) sleep_ms(r->delay_ms);
    json_t *o = gen_tokens(r->port, gen_req(r->prompt, r->n_prompt, r->max_tokens, r->stream, NULL), r->stream, r->tok,
                           MAX_GEN, &r->n_tok, &r->status);
    r->start_pos = (int)jint(o, "prefill", "start_pos");
    json_decref(o);
}

static void *req_thread(void *arg) { req_run(arg); return NULL; }

static void run_all(req *r, int n) {
    pthread_t th[N_REQ];
    for (int i = 0; i < n; i++) pthread_create(&th[i], NULL, req_thread, &r[i]);
    for (int i = 0; i < n; i++) pthread_join(th[i], NULL);
}

/* The same request alone on the CPU node: its tokens (the reference). */
static req ref_of(const req *r, int cpu_port) {
    req c = *r;
    c.port = cpu_port;
    c.delay_ms = 0;
    c.stream = 0;
    req_run(&c);
    return c;
}

static int same_tokens(const req *a, const req *b) {
    return a->status == 200 && b->status == 200 && a->n_tok == a->max_tokens && a->n_tok == b->n_tok &&
           !memcmp(a->tok, b->tok, sizeof(int32_t) * (size_t)a->n_tok);
}

static uint32_t rng(uint32_t *s) { *s = *s * 1664525u + 1013904223u; return *s >> 8; }

/* ==== The router ==== */

/* The same completion through a router before each node: equal text. */
static void check_router(const char *dir, int mlx_port, int cpu_port) {
    char dm[64], dc[64];
    snprintf(dm, sizeof dm, "m=127.0.0.1:%d", mlx_port);
    snprintf(dc, sizeof dc, "m=127.0.0.1:%d", cpu_port);
    char *rm[] = { "--role", "router", "--quiet", "--listen", "127.0.0.1:0", "--decode", dm, NULL };
    char *rc[] = { "--role", "router", "--quiet", "--listen", "127.0.0.1:0", "--decode", dc, NULL };
    int pm, pc;
    pid_t a = start_serve(dir, "router-mlx", rm, 1, &pm), b = start_serve(dir, "router-cpu", rc, 1, &pc);
    CHECK(pm > 0 && pc > 0, "routers did not start");
    const char *body = "{\"model\":\"m\",\"prompt\":\"Once upon a time, there was a\",\"max_tokens\":32,\"temperature\":0}";
    char *om = NULL, *oc = NULL;
    int sm = pm > 0 ? http(pm, "POST", "/v1/completions", body, &om) : -1;
    int sc = pc > 0 ? http(pc, "POST", "/v1/completions", body, &oc) : -1;
    json_t *jm = sm == 200 && om ? json_loads(om, 0, NULL) : NULL, *jc = sc == 200 && oc ? json_loads(oc, 0, NULL) : NULL;
    json_t *cm = json_array_get(json_object_get(jm, "choices"), 0), *cc = json_array_get(json_object_get(jc, "choices"), 0);
    const char *tm = json_string_value(json_object_get(cm, "text")), *tc = json_string_value(json_object_get(cc, "text"));
    const char *fm = json_string_value(json_object_get(cm, "finish_reason"));
    const char *fc = json_string_value(json_object_get(cc, "finish_reason"));
    CHECK(sm == 200 && sc == 200 && tm && tc && strlen(tc) > 8, "router completions: status %d (mlx), %d (cpu)", sm, sc);
    CHECK(tm && tc && !strcmp(tm, tc) && fm && fc && !strcmp(fm, fc), "router on MLX: \"%.80s\" (%s), on CPU \"%.80s\" (%s)",
          tm ? tm : "-", fm ? fm : "-", tc ? tc : "-", fc ? fc : "-");
    printf("router: MLX node's completion equals the CPU node's (%zu bytes, %s)\n", tc ? strlen(tc) : 0, fc ? fc : "-");
    json_decref(jm);
    json_decref(jc);
    free(om);
    free(oc);
    CHECK(stop_proc(a, 10000) == 0 && stop_proc(b, 10000) == 0, "routers' exit status");
}

/* ==== Continuous batching ==== */

static void check_batching(int mlx_port, int cpu_port) {
    static req r[N_REQ], ref[N_REQ];
    uint32_t seed = 46;
    for (int i = 0; i < N_REQ; i++) {
        memset(&r[i], 0, sizeof r[i]);
        r[i].port = mlx_port;
        r[i].n_prompt = 4 + (int)(rng(&seed) % 40);
        for (int j = 0; j < r[i].n_prompt; j++) r[i].prompt[j] = 10 + (int32_t)(rng(&seed) % 490);
        r[i].max_tokens = 16 + (int)(rng(&seed) % 25);
        r[i].stream = i % 2;
        r[i].delay_ms = 40 * i;
        ref[i] = ref_of(&r[i], cpu_port);
    }
    long long s0 = stat_int(mlx_port, "batch_steps"), t0 = stat_int(mlx_port, "batched_tokens");
    run_all(r, N_REQ);
    long long steps = stat_int(mlx_port, "batch_steps") - s0, toks = stat_int(mlx_port, "batched_tokens") - t0;
    int same = 0;
    for (int i = 0; i < N_REQ; i++) {
        int eq = same_tokens(&ref[i], &r[i]);
        CHECK(eq, "batched req %d (%s, %d prompt, %d tokens): status %d, %d tokens, not the CPU's", i,
              r[i].stream ? "stream" : "full", r[i].n_prompt, r[i].max_tokens, r[i].status, r[i].n_tok);
        same += eq;
    }
    CHECK(steps > 0 && toks > steps, "MLX node: %lld tokens in %lld passes (no batching?)", toks, steps);
    printf("batching: %d/%d concurrent requests equal the CPU's greedy tokens; %lld tokens in %lld passes\n", same, N_REQ,
           toks, steps);
}

/* ==== Prefix sharing ==== */

static void check_prefix(int mlx_port, int cpu_port) {
    /* after a finished request: its slot's rows are copied */
    static req a, b;
    memset(&a, 0, sizeof a);
    a.port = mlx_port;
    a.n_prompt = 64;
    for (int i = 0; i < 64; i++) a.prompt[i] = 100 + 3 * i;
    a.max_tokens = 8;
    b = a;
    for (int i = 48; i < 64; i++) b.prompt[i] = 300 + i;
    req ra = ref_of(&a, cpu_port), rb = ref_of(&b, cpu_port);
    req_run(&a);
    req_run(&b);
    CHECK(same_tokens(&ra, &a), "prefix: first request not the CPU's tokens");
    CHECK(b.start_pos >= 48, "prefix: the second request computed from %d, not >= 48", b.start_pos);
    CHECK(same_tokens(&rb, &b), "prefix: the request reusing rows is not the CPU's tokens");
    /* two arriving together with a new 96-token prefix: computed once */
    static req twin[2], tref[2];
    for (int k = 0; k < 2; k++) {
        memset(&twin[k], 0, sizeof twin[k]);
        twin[k].port = mlx_port;
        twin[k].n_prompt = 112;
        for (int i = 0; i < 112; i++) twin[k].prompt[i] = i < 96 ? 20 + (5 * i) % 470 : 40 + (11 * i + k) % 450;   /* ids < 512 */
        twin[k].max_tokens = 8;
        tref[k] = ref_of(&twin[k], cpu_port);
    }
    run_all(twin, 2);
    CHECK(twin[0].start_pos >= 95 || twin[1].start_pos >= 95, "prefix: simultaneous shared prefix computed twice (%d, %d)",
          twin[0].start_pos, twin[1].start_pos);
    for (int k = 0; k < 2; k++) CHECK(same_tokens(&tref[k], &twin[k]), "prefix: twin %d not the CPU's tokens", k);
    printf("prefix: start_pos %d after a finished request, %d/%d for twins; tokens equal the CPU's\n", b.start_pos,
           twin[0].start_pos, twin[1].start_pos);
}

/* ==== The KV store ==== */

static void check_store(int store_port, int cpu_port) {
    static req a, other, b;
    memset(&a, 0, sizeof a);
    a.port = store_port;
    a.n_prompt = 140;
    for (int i = 0; i < 140; i++) a.prompt[i] = 30 + (7 * i) % 460;
    a.max_tokens = 12;
    other = a;
    for (int i = 0; i < 140; i++) other.prompt[i] = 400 - (3 * i) % 380;
    b = a;
    b.n_prompt = 150;
    for (int i = 128; i < 150; i++) b.prompt[i] = 25 + (13 * i) % 470;
    req ra = ref_of(&a, cpu_port), ro = ref_of(&other, cpu_port), rb = ref_of(&b, cpu_port);
    req_run(&a);       /* its 140 rows go to the store when it ends */
    req_run(&other);   /* takes the only slot: a's rows leave it */
    req_run(&b);       /* a's first 128 positions come from the store */
    CHECK(same_tokens(&ra, &a) && same_tokens(&ro, &other), "store: the first two requests are not the CPU's tokens");
    CHECK(b.start_pos >= 128, "store: the stored prefix was not loaded (computed from %d, not >= 128)", b.start_pos);
    CHECK(same_tokens(&rb, &b), "store: the request on stored rows (from %d) is not the CPU's tokens", b.start_pos);
    printf("store: a prefix stored from the MLX node's rows, loaded after another prompt took the slot: start_pos %d, "
           "the CPU's tokens\n", b.start_pos);
}

/* ==== Speculative verification ==== */

/* Prompts that repeat themselves (a story twice), so prompt lookup drafts. */
static void check_lookup(int spec_port, int cpu_port, int plain_port) {
    static req r[N_REQ], ref[N_REQ];
    uint32_t seed = 4646;
    for (int i = 0; i < N_REQ; i++) {
        memset(&r[i], 0, sizeof r[i]);
        r[i].port = spec_port;
        int half = 12 + (int)(rng(&seed) % 20);
        for (int j = 0; j < half; j++) r[i].prompt[j] = r[i].prompt[j + half] = 10 + (int32_t)(rng(&seed) % 490);
        for (int j = 0; j < 8; j++) r[i].prompt[2 * half + j] = r[i].prompt[j];
        r[i].n_prompt = 2 * half + 8;
        r[i].max_tokens = 24;
        r[i].stream = i % 2;
        ref[i] = ref_of(&r[i], cpu_port);
    }
    int alone = 0, together = 0;
    /* The node's first request ever: it follows the node's start-up
     * calibration pass (prefill_rate_calibrate, on the main thread, no
     * logits read), whose results MLX left lazy on the main thread's
     * stream; evaluated later from the scheduler thread they came out one
     * pass behind (the first token wrong, the CPU's then a step late)
     * until backend_mlx.cpp computed on one stream for all threads. */
    req first = r[0];
    first.stream = 0;
    for (int j = 0; j < first.n_prompt; j++) first.prompt[j] = r[0].prompt[first.n_prompt - 1 - j];   /* no prefix of r[0] */
    req fref = ref_of(&first, cpu_port);
    req_run(&first);
    CHECK(same_tokens(&fref, &first), "the first request on a fresh MLX node (%d tokens): first token %d, the CPU's %d",
          first.n_prompt, first.n_tok ? first.tok[0] : -1, fref.n_tok ? fref.tok[0] : -1);
    for (int i = 0; i < N_REQ; i++) {
        req x = r[i];
        req_run(&x);
        alone += same_tokens(&ref[i], &x);
        if (!same_tokens(&ref[i], &x)) {
            int d = 0;
            while (d < x.n_tok && d < ref[i].n_tok && x.tok[d] == ref[i].tok[d]) d++;
            printf("lookup alone %d: status %d, %d tokens, first difference at %d (%d vs the CPU's %d)\n", i, x.status,
                   x.n_tok, d, d < x.n_tok ? x.tok[d] : -1, d < ref[i].n_tok ? ref[i].tok[d] : -1);
        }
    }
    /* the same prompts alone on the MLX node without --lookup: whether a
     * difference is the verification's or the plain pass's */
    int plain = 0;
    for (int i = 0; i < N_REQ; i++) {
        req x = r[i];
        x.port = plain_port;
        req_run(&x);
        plain += same_tokens(&ref[i], &x);
    }
    run_all(r, N_REQ);
    for (int i = 0; i < N_REQ; i++) together += same_tokens(&ref[i], &r[i]);
    long long drafted = stat_int(spec_port, "spec_drafted"), accepted = stat_int(spec_port, "spec_accepted");
    CHECK(alone == N_REQ, "lookup on MLX: %d of %d alone equal the CPU's greedy tokens", alone, N_REQ);
    CHECK(together == N_REQ, "lookup on MLX: %d of %d at once equal the CPU's greedy tokens", together, N_REQ);
    CHECK(plain == N_REQ, "repeating prompts on the MLX node without lookup: %d of %d alone equal the CPU's", plain, N_REQ);
    CHECK(drafted > 0, "lookup on MLX: no drafts verified (%lld)", drafted);
    printf("lookup: %d/%d alone, %d/%d at once equal the CPU's (without lookup: %d/%d alone); %lld drafted, %lld accepted\n",
           alone, N_REQ, together, N_REQ, plain, N_REQ, drafted, accepted);
}

/* ==== Without MLX ==== */

static void check_absent(const char *dir, const char *mp) {
    char log[512];
    snprintf(log, sizeof log, "%s/absent.log", dir);
    char *argv[] = { (char *)bin(), "serve", "--role", "local", "--backend", "mlx", "-m", (char *)mp, "--listen",
                     "127.0.0.1:0", NULL };
    pid_t pid = spawn(argv, log);
    int st = wait_exit(pid, 10000);
    char *text = read_text(log);
    CHECK(st > 0 && text && strstr(text, "make MLX=1 mlx"), "serve --backend mlx without MLX: status %d, log: %.200s", st,
          text ? text : "-");
    free(text);
}

int main(void) {
    signal(SIGPIPE, SIG_IGN);
    char dir[] = "/tmp/tandem-test-serve-mlx-XXXXXX";
    if (!mkdtemp(dir)) return 1;
    char mp[1024];
    t_fixture_path(mp, sizeof mp, "models/stories260K-F16.gguf");
    if (!t_need(mp)) return t_done("test_serve_mlx");
    if (!backend_mlx_linked()) {
        printf("(built without the MLX object: serve --backend mlx must refuse)\n");
        check_absent(dir, mp);
        return t_done("test_serve_mlx");
    }
    char *cpu[] = { "--role", "local", "-m", mp, "-t", "1", "-c", "512", "--parallel", "1", "--listen", "127.0.0.1:0", NULL };
    char *mlx[] = { "--role", "local", "--backend", "mlx", "-m", mp, "-t", "1", "-c", "512", "--parallel", "4",
                    "--listen", "127.0.0.1:0", NULL };
    char *spec[] = { "--role", "local", "--backend", "mlx", "-m", mp, "-t", "1", "-c", "512", "--parallel", "4",
                     "--listen", "127.0.0.1:0", "--lookup", "8", NULL };
    char *store[] = { "--role", "local", "--backend", "mlx", "-m", mp, "-t", "1", "-c", "512", "--parallel", "1",
                      "--listen", "127.0.0.1:0", "--kv-cache-ram", "16000000", NULL };
    int cp, mpo, sp, stp;
    pid_t c = start_serve(dir, "cpu", cpu, 1, &cp), m = start_serve(dir, "mlx", mlx, 1, &mpo),
          s = start_serve(dir, "mlx-lookup", spec, 1, &sp), st = start_serve(dir, "mlx-store", store, 1, &stp);
    CHECK(cp > 0 && mpo > 0 && sp > 0 && stp > 0, "nodes did not start (logs in %s)", dir);
    if (cp > 0 && mpo > 0) {
        double t0 = now_ms();
        check_router(dir, mpo, cp);
        double t1 = now_ms();
        check_batching(mpo, cp);
        double t2 = now_ms();
        check_prefix(mpo, cp);
        double t3 = now_ms();
        if (sp > 0) check_lookup(sp, cp, mpo);
        double t4 = now_ms();
        if (stp > 0) check_store(stp, cp);
        printf("test_serve_mlx: router %.1f s, batching %.1f s, prefix %.1f s, lookup %.1f s, store %.1f s\n",
               (t1 - t0) / 1e3, (t2 - t1) / 1e3, (t3 - t2) / 1e3, (t4 - t3) / 1e3, (now_ms() - t4) / 1e3);
    }
    CHECK(stop_proc(c, 20000) == 0 && stop_proc(m, 20000) == 0 && stop_proc(s, 20000) == 0 && stop_proc(st, 20000) == 0,
          "nodes' exit status");
    printf("test_serve_mlx: logs in %s\n", dir);
    return t_done("test_serve_mlx");
}

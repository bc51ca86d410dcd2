/* test_handoff.c - the KV handoff with real processes over loopback TCP.
 *
 * A `tandem serve --role prefill` node is started per scenario (it writes its
 * port to a file); `tandem run --prefill-node` processes and, for the
 * memory/fd check, this process itself (through handoff.h) act as decode
 * nodes. Scenarios:
 *   1. golden prompts: split run prints exactly what the one-process run prints,
 *      and the decode side computed exactly one prompt position;
 *   2. q8_0 wire: top-1 agreement measured and printed (sanity floor only);
 *   3. kill -9 of the prefill node mid-stream -> clear error, no hang;
 *   4. prefill node stalls (SIGSTOP) -> timeout error within --timeout-ms;
 *   5. corrupted frame (fault injection) -> checksum error; a sealed byte
 *      flipped with the CRC fixed -> authentication tag error;
 *   6. wrong model, 7. wrong secret -> refused with a clear message;
 *   8. decode node killed mid-stream -> prefill node stops and stays healthy;
 *   9. many requests in a row -> prefill node's VmRSS and fd count flat;
 *  plus, in-process: the received KV is byte-identical to a local prefill,
 *  a decode node holding a prefix receives only the rest, q8_0 conversion.
 * TANDEM_HANDOFF_ALL=1 runs every golden prompt of every model (slow);
 * TANDEM_ASAN=1 scales counts down and deadlines up.
 * TANDEM_PREFILL_BACKEND=cuda (a build with CUDA=1, on a GPU machine): the
 * prefill nodes compute on that backend and the decode side stays on the
 * CPU, the cross-backend KV proof: on F16/F32 files the split output must
 * equal the CPU-only output token for token; on quantized files (the device
 * multiplies dequantized F16 weights, the CPU int8 products) the agreement
 * is measured and printed, with the same floor as the q8_0 wire. Only the
 * golden part runs then (the fault scenarios do not depend on the backend).
 * TANDEM_HANDOFF_ONLY=substring: only the model files whose name holds it.
 * TANDEM_DECODE_BACKEND=mlx (a build with MLX=1): the same golden part with
 * the CPU prefill node handing off to a decode side (`tandem run
 * --prefill-node`) computing on that backend, held to the same rules.
 */
#include <dirent.h>
#include <errno.h>
#include <fcntl.h>
#include <jansson.h>
#include <math.h>
#include <signal.h>
#include <stdarg.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

#include "node/handoff.h"
#include "engine/kvcache.h"
#include "engine/model.h"
#include "proc.h"

static char g_tmp[256];
static const char *g_bin;
static int g_asan, g_all;
static int g_slow = 1;          /* deadline multiplier (ASan) */
static int g_q8_first, g_q8_all, g_q8_n, g_f16_prompts;
static const char *g_pbe;       /* TANDEM_PREFILL_BACKEND, or NULL for the CPU */
static const char *g_dbe;       /* TANDEM_DECODE_BACKEND (the split run's own side), or NULL */
static const char *g_xbe;       /* the other backend of a cross-backend run: g_pbe, else g_dbe */
static int g_xq_first, g_xq_all, g_xq_n;   /* cross-backend runs on quantized files */
static int g_q8_models, g_xq_models;      /* model files whose agreement prompts were to run */

/* ==== Processes ==== */

typedef struct { char *v[64]; int n; char store[64][512]; } args;

static void arg(args *a, const char *fmt, ...) {
    if (a->n >= 63) return;
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(a->store[a->n], sizeof a->store[0], fmt, ap);
    va_end(ap);
    a->v[a->n] = a->store[a->n];
    a->v[++a->n] = NULL;
}

/* Runs a command to completion; rc, or -1 if it had to be killed. */
static int run(args *a, int timeout_ms, char **out, char **err) {
    char po[300], pe[300];
    snprintf(po, sizeof po, "%s/run.out", g_tmp);
    snprintf(pe, sizeof pe, "%s/run.err", g_tmp);
    int rc = wait_exit(spawn_io(a->v, NULL, po, pe), timeout_ms);
    if (out) *out = slurp(po);
    if (err) *err = slurp(pe);
    return rc;
}

typedef struct { pid_t pid; int port; char log[300]; } tnode;

/* Starts a prefill node; extra: NULL-terminated extra arguments. */
static int node_start(tnode *n, const char *model, const char *secret_file, const char *const *extra) {
    static int seq;
    char pf[300];
    snprintf(pf, sizeof pf, "%s/port.%d", g_tmp, ++seq);
    snprintf(n->log, sizeof n->log, "%s/node.%d.log", g_tmp, seq);
    args a = { 0 };
    arg(&a, "%s", g_bin); arg(&a, "serve"); arg(&a, "--role"); arg(&a, "prefill");
    arg(&a, "-m"); arg(&a, "%s", model); arg(&a, "--secret-file"); arg(&a, "%s", secret_file);
    arg(&a, "--listen"); arg(&a, "127.0.0.1:0"); arg(&a, "--port-file"); arg(&a, "%s", pf);
    arg(&a, "--node-id"); arg(&a, "test-prefill-%d", seq);
    for (int i = 0; extra && extra[i]; i++) arg(&a, "%s", extra[i]);
    n->port = 0;
    n->pid = spawn_io(a.v, NULL, "/dev/null", n->log);
    int port = wait_port(pf, n->pid, 30000 * g_slow);
    if (port > 0) { n->port = port; return 0; }
    char *log = slurp(n->log);
    fprintf(stderr, "prefill node for %s did not start:\n%s\n", model, log);
    free(log);
    wait_exit(n->pid, 0);   /* killed and reaped */
    n->pid = 0;
    return -1;
}

/* SIGTERM, and the node must exit cleanly (0) within a few seconds. */
static int node_stop(tnode *n) {
    int rc = stop_proc(n->pid, 20000 * g_slow);
    n->pid = 0;
    return rc;
}

static int node_alive(const tnode *n) { return n->pid > 0 && kill(n->pid, 0) == 0; }

/* Whether the node's log shows `what` within a few seconds (it may log
 * just after the peer process exits). */
static int log_has(const tnode *n, const char *what) {
    double t0 = now_ms();
    for (;;) {
        char *s = slurp(n->log);
        int r = strstr(s, what) != NULL;
        free(s);
        if (r || now_ms() - t0 > 3000.0 * g_slow) return r;
        sleep_ms(20);
    }
}

/* ==== tandem run ==== */

typedef struct {
    const char *model, *prompt_file, *secret_file, *wire;
    int port, timeout_ms, n;
} runspec;

static void run_args(args *a, const runspec *r) {
    arg(a, "%s", g_bin); arg(a, "run"); arg(a, "-m"); arg(a, "%s", r->model);
    arg(a, "-f"); arg(a, "%s", r->prompt_file); arg(a, "-n"); arg(a, "%d", r->n ? r->n : 16);
    arg(a, "--ids"); arg(a, "--ignore-eos"); arg(a, "-t"); arg(a, "1");
    if (r->port) {
        arg(a, "--prefill-node"); arg(a, "127.0.0.1:%d", r->port);
        arg(a, "--secret-file"); arg(a, "%s", r->secret_file);
        if (r->wire) { arg(a, "--wire-dtype"); arg(a, "%s", r->wire); }
        if (r->timeout_ms) { arg(a, "--timeout-ms"); arg(a, "%d", r->timeout_ms); }
        if (g_dbe) { arg(a, "--backend"); arg(a, "%s", g_dbe); }
    }
}

/* Parses "handoff: N positions received ... (computed remotely R, locally L)". */
static int parse_handoff(const char *err, int *recv, int *remote, int *local) {
    const char *h = strstr(err, "handoff: ");
    if (!h || sscanf(h, "handoff: %d positions received", recv) != 1) return -1;
    const char *c = strstr(h, "computed remotely ");
    if (!c || sscanf(c, "computed remotely %d, locally %d", remote, local) != 2) return -1;
    return 0;
}

/* ==== 1 + 2: golden prompts ==== */

static int first_id(const char *s) { return atoi(s); }

static void check_prompt(const char *model, const char *name, const char *prompt, int n_ids,
                         int port, const char *secret, int q8, int exact) {
    char pf[300];
    snprintf(pf, sizeof pf, "%s/prompt.txt", g_tmp);
    write_text(pf, prompt);
    runspec r = { .model = model, .prompt_file = pf };
    args a = { 0 };
    run_args(&a, &r);
    char *lo = NULL, *le = NULL, *ro = NULL, *re = NULL;
    int lrc = run(&a, 120000 * g_slow, &lo, &le);
    r.port = port;
    r.secret_file = secret;
    args b = { 0 };
    run_args(&b, &r);
    int rrc = run(&b, 120000 * g_slow, &ro, &re);
    CHECK(lrc == 0 && rrc == 0, "%s %s: exit codes local %d remote %d: %s", model, name, lrc, rrc, re);
    /* self-consistency (tandem split vs tandem in one process, not a
     * fidelity check: test_golden is that): exact equality */
    if (exact)
        CHECK(strlen(lo) > 0 && !strcmp(lo, ro), "%s %s: self-consistency: split output differs from one-process "
              "output:\n local:  %s remote: %s", model, name, lo, ro);
    else {
        g_xq_n++;
        g_xq_first += rrc == 0 && first_id(ro) == first_id(lo);
        g_xq_all += rrc == 0 && !strcmp(ro, lo);
    }
    int recv = -1, rem = -1, loc = -1;
    CHECK(parse_handoff(re, &recv, &rem, &loc) == 0, "%s %s: no handoff line in: %s", model, name, re);
    CHECK(loc == 1 && rem == n_ids - 1 && recv == n_ids - 1,
          "%s %s: %d prompt tokens, received %d, computed remotely %d, locally %d", model, name, n_ids, recv, rem, loc);
    g_f16_prompts += exact;
    if (q8) {
        r.wire = "q8_0";
        args c = { 0 };
        run_args(&c, &r);
        char *qo = NULL, *qe = NULL;
        int qrc = run(&c, 120000 * g_slow, &qo, &qe);
        CHECK(qrc == 0, "%s %s: q8_0 wire run failed: %s", model, name, qe);
        g_q8_n++;
        g_q8_first += qrc == 0 && first_id(qo) == first_id(lo);
        g_q8_all += qrc == 0 && !strcmp(qo, lo);
        free(qo); free(qe);
    }
    free(lo); free(le); free(ro); free(re);
}

/* Removes the test's scratch folder and everything in it. */
static void tmp_remove(void) {
    char cmd[600];
    snprintf(cmd, sizeof cmd, "rm -rf '%s'", g_tmp);
    if (system(cmd)) {}
}

/* 1 if the prefill backend cannot start here: a counted "skipped: cuda"
 * line where the machine has no CUDA device (t_cuda_absent), a failure
 * with the cause otherwise. */
static int pbe_missing(void) {
    char model[512], pf[300];
    t_fixture_path(model, sizeof model, "models/stories260K.gguf");
    snprintf(pf, sizeof pf, "%s/probe.txt", g_tmp);
    write_text(pf, "Once");
    args a = { 0 };
    arg(&a, "%s", g_bin); arg(&a, "run"); arg(&a, "-m"); arg(&a, "%s", model); arg(&a, "-f"); arg(&a, "%s", pf);
    arg(&a, "-n"); arg(&a, "1"); arg(&a, "--backend"); arg(&a, "%s", g_xbe);
    char *out = NULL, *err = NULL;
    int rc = run(&a, 60000 * g_slow, &out, &err);
    /* no device: a counted skip; any other failure (a build without CUDA,
     * a driver that fails, a bad --device) is a failure with its cause */
    int missing = rc != 0 && t_cuda_absent(err);
    if (!missing) CHECK(rc == 0, "tandem run --backend %s: %s", g_xbe, err ? err : "");
    free(out);
    free(err);
    return missing || rc != 0;
}

/* Whether a fixture file is an F16/F32 one (exact across backends). */
static int model_is_float(const char *model) {
    return strstr(model, "-F16") || (strstr(model, "stories260K") && !strstr(model, "-Q"));
}

/* Picks k prompts spread over the file (all when k >= count). */
static int prompt_selected(int i, int count, int k) {
    if (k >= count) return 1;
    for (int j = 0; j < k; j++)
        if (i == (k == 1 ? 0 : j * (count - 1) / (k - 1))) return 1;
    return 0;
}

static void test_golden_model(const char *model, const char *golden, int k, int max_ids, int q8,
                              const char *secret, const char *const *node_extra) {
    if (!t_need(model) || !t_need(golden)) return;
    FILE *f = fopen(golden, "r");
    CHECK(f != NULL, "golden file %s", golden);
    if (!f) return;
    tnode n;
    if (node_start(&n, model, secret, node_extra)) { CHECK(0, "prefill node for %s", model); fclose(f); return; }
    char *line = NULL;
    size_t cap = 0;
    int idx = -1, count = 0;
    /* count the prompts short enough for this run; the selection spreads over those */
    while (getline(&line, &cap, f) > 0) {
        json_error_t je;
        json_t *j = json_loads(line, 0, &je);
        json_t *ids = j ? json_object_get(j, "prompt_ids") : NULL;
        count += ids && (g_all || (int)json_array_size(ids) <= max_ids);
        json_decref(j);
    }
    rewind(f);
    int done = 0, want = k < count ? k : count;
    double t0 = now_ms();
    if (q8) g_q8_models++;
    if (g_xbe && !model_is_float(model)) g_xq_models++;
    while (getline(&line, &cap, f) > 0) {
        json_error_t je;
        json_t *j = json_loads(line, 0, &je);
        json_t *ids = j ? json_object_get(j, "prompt_ids") : NULL;
        int n_ids = ids ? (int)json_array_size(ids) : 0;
        if (ids && json_object_get(j, "prompt") && (g_all || n_ids <= max_ids)) {
            if (prompt_selected(++idx, count, k)) {
                check_prompt(model, json_string_value(json_object_get(j, "name")),
                             json_string_value(json_object_get(j, "prompt")), n_ids, n.port, secret, q8,
                             !g_xbe || model_is_float(model));
                done++;
            }
        }
        json_decref(j);
    }
    free(line);
    fclose(f);
    CHECK(node_alive(&n), "prefill node for %s still up", model);
    CHECK(node_stop(&n) == 0, "prefill node for %s shuts down cleanly on SIGTERM", model);
    /* a floor on prompts run: every selected prompt, and at least one */
    CHECK(want > 0 && done == want, "%s: %d of %d selected golden prompts ran (%d in the file)", model, done, want, count);
    printf("handoff: self-consistency (tandem split vs tandem one-process, not a fidelity check): %s: %d prompts "
           "split == local (%.1f s)\n", strrchr(model, '/') + 1, done, (now_ms() - t0) / 1e3);
}

/* ==== 3, 4, 8: faults with a slow stream ==== */

/* Waits until the node holds one more fd than `base` (a decode node connected). */
static int wait_conn(const tnode *n, int base, int timeout_ms) {
    double t0 = now_ms();
    while (now_ms() - t0 < timeout_ms) {
        if (count_fds(n->pid) > base) return 0;
        sleep_ms(5);
    }
    return -1;
}

static void test_faults(const char *model, const char *long_prompt, const char *short_prompt, const char *secret) {
    /* 16-position chunks x 4 layers, 150 ms per frame: the digits prompt
     * streams for several seconds, so there is time to interfere. */
    int delay = 150;
    char ds[16];
    snprintf(ds, sizeof ds, "%d", delay);
    const char *extra[] = { "-b", "16", "--debug-frame-delay-ms", ds, "-t", "1", NULL };
    tnode n;
    if (node_start(&n, model, secret, extra)) { CHECK(0, "slow prefill node"); return; }
    int base = count_fds(n.pid);
    char po[300], pe[300];
    snprintf(po, sizeof po, "%s/bg.out", g_tmp);
    snprintf(pe, sizeof pe, "%s/bg.err", g_tmp);

    /* 8: the decode node dies mid-stream. */
    runspec r = { .model = model, .prompt_file = long_prompt, .port = n.port, .secret_file = secret };
    args a = { 0 };
    run_args(&a, &r);
    pid_t dec = spawn_io(a.v, NULL, po, pe);
    CHECK(wait_conn(&n, base, 30000 * g_slow) == 0, "decode process connected");
    sleep_ms(3 * delay);
    kill(dec, SIGKILL);
    waitpid(dec, NULL, 0);
    double t0 = now_ms();
    int seen = log_has(&n, "decode node went away");
    CHECK(seen, "prefill node logged that the decode node went away");
    char *log = slurp(n.log);
    const char *l = strstr(log, "decode node went away");
    if (l) printf("handoff: %.*s\n", (int)strcspn(l, "\n"), l);
    CHECK(l && strstr(l, "stopping request"), "it stopped the request");
    free(log);
    runspec ok = { .model = model, .prompt_file = short_prompt, .port = n.port, .secret_file = secret };
    args b = { 0 };
    run_args(&b, &ok);
    char *o1 = NULL, *e1 = NULL;
    int rc = run(&b, 60000 * g_slow, &o1, &e1);
    CHECK(rc == 0 && strstr(e1, "handoff: "), "a request after the decode node died succeeds: %d %s", rc, e1);
    free(o1); free(e1);

    /* 4: the prefill node stalls; the decode side gives up after --timeout-ms. */
    r.timeout_ms = 1500;
    args c = { 0 };
    run_args(&c, &r);
    base = count_fds(n.pid);
    dec = spawn_io(c.v, NULL, po, pe);
    CHECK(wait_conn(&n, base, 30000 * g_slow) == 0, "decode process connected (stall)");
    sleep_ms(2 * delay);
    kill(n.pid, SIGSTOP);
    t0 = now_ms();
    rc = wait_exit(dec, 15000 * g_slow);
    double waited = now_ms() - t0;
    kill(n.pid, SIGCONT);
    char *e2 = slurp(pe);
    CHECK(rc == 1, "stalled transfer: decode exits with an error (rc %d)", rc);
    CHECK(strstr(e2, "timed out") && strstr(e2, "1500 ms"), "timeout message: %s", e2);
    CHECK(waited < 1500 + delay + 1500.0 * g_slow, "gave up %.0f ms after the stall (limit 1500 ms + one frame)", waited);
    printf("handoff: stall: decode gave up %.0f ms after SIGSTOP (--timeout-ms 1500): %.*s\n", waited,
           (int)strcspn(e2, "\n"), e2);
    free(e2);
    CHECK(node_alive(&n), "prefill node survives a stall and a vanished decode node");

    /* 3: kill -9 of the prefill node mid-stream. */
    r.timeout_ms = 0;
    args d = { 0 };
    run_args(&d, &r);
    sleep_ms(200);
    base = count_fds(n.pid);
    dec = spawn_io(d.v, NULL, po, pe);
    CHECK(wait_conn(&n, base, 30000 * g_slow) == 0, "decode process connected (kill)");
    sleep_ms(3 * delay);
    kill(n.pid, SIGKILL);
    waitpid(n.pid, NULL, 0);
    n.pid = 0;
    t0 = now_ms();
    rc = wait_exit(dec, 15000 * g_slow);
    waited = now_ms() - t0;
    char *e3 = slurp(pe);
    char *o3 = slurp(po);
    CHECK(rc == 1, "prefill node killed: decode exits with an error (rc %d)", rc);
    CHECK(strstr(e3, "closed the connection mid-transfer"), "kill -9 message: %s", e3);
    CHECK(o3[0] == 0, "nothing on stdout after a failed handoff: %s", o3);
    CHECK(waited < 3000.0 * g_slow, "decode exited %.0f ms after the kill", waited);
    printf("handoff: kill -9: decode exited %.0f ms after the kill: %.*s\n", waited, (int)strcspn(e3, "\n"), e3);
    free(e3); free(o3);
}

/* ==== 5, 6, 7: bad frames and refused handshakes ==== */

static void test_refusals(const char *model, const char *other_model, const char *prompt, const char *secret,
                          const char *bad_secret) {
    const char *corrupt[] = { "--debug-corrupt-frame", "2", NULL };
    tnode n;
    if (node_start(&n, model, secret, corrupt)) { CHECK(0, "corrupting prefill node"); return; }
    runspec r = { .model = model, .prompt_file = prompt, .port = n.port, .secret_file = secret };
    args a = { 0 };
    run_args(&a, &r);
    char *o = NULL, *e = NULL;
    int rc = run(&a, 60000 * g_slow, &o, &e);
    CHECK(rc == 1, "corrupted frame: exit 1 (got %d)", rc);
    CHECK(strstr(e, "corrupted frame") && strstr(e, "checksum"), "corrupted frame message: %s", e);
    printf("handoff: corrupt: %.*s\n", (int)strcspn(e, "\n"), e);
    free(o); free(e);
    CHECK(node_alive(&n), "node alive after the rejected frame");
    CHECK(node_stop(&n) == 0, "corrupting node stops cleanly");

    /* 5b: a sealed byte flipped and the CRC fixed (what an attacker on the
     * path would do): the tag refuses it. */
    const char *tamper[] = { "--debug-tamper-frame", "2", NULL };
    if (node_start(&n, model, secret, tamper)) { CHECK(0, "tampering prefill node"); return; }
    r.port = n.port;
    args t = { 0 };
    run_args(&t, &r);
    rc = run(&t, 60000 * g_slow, &o, &e);
    CHECK(rc == 1 && strstr(e, "failed authentication") && strstr(e, "authentication tag mismatch in KV frame"),
          "tampered frame: rc %d: %s", rc, e);
    CHECK(o[0] == 0, "nothing on stdout after a tampered frame: %s", o);
    printf("handoff: tampered: %.*s\n", (int)strcspn(e, "\n"), e);
    free(o); free(e);
    CHECK(node_stop(&n) == 0, "tampering node stops cleanly");

    if (node_start(&n, other_model, secret, NULL)) { CHECK(0, "other-model node"); return; }
    r.port = n.port;
    args b = { 0 };
    run_args(&b, &r);
    rc = run(&b, 60000 * g_slow, &o, &e);
    const char *mb = strrchr(model, '/') + 1, *ob = strrchr(other_model, '/') + 1;
    CHECK(rc == 1 && strstr(e, "model mismatch") && strstr(e, mb) && strstr(e, ob),
          "wrong model: rc %d, message names %s and %s: %s", rc, mb, ob, e);
    printf("handoff: wrong model: %.*s\n", (int)strcspn(e, "\n"), e);
    free(o); free(e);
    CHECK(log_has(&n, "model mismatch"), "the prefill node logged the mismatch too");
    CHECK(node_stop(&n) == 0, "other-model node stops cleanly");

    if (node_start(&n, model, secret, NULL)) { CHECK(0, "node for the secret test"); return; }
    r.port = n.port;
    r.secret_file = bad_secret;
    args c = { 0 };
    run_args(&c, &r);
    rc = run(&c, 60000 * g_slow, &o, &e);
    CHECK(rc == 1 && strstr(e, "authentication failed"), "wrong secret: rc %d: %s", rc, e);
    printf("handoff: wrong secret: %.*s\n", (int)strcspn(e, "\n"), e);
    free(o); free(e);
    CHECK(log_has(&n, "authentication failed"), "the prefill node logged the failed authentication");
    CHECK(node_stop(&n) == 0, "secret-test node stops cleanly");
}

/* ==== 9 + in-process checks ==== */

static int load_golden_ids(const char *golden, int32_t ids[][2048], int *lens, int cap) {
    FILE *f = fopen(golden, "r");
    if (!f) return 0;
    char *line = NULL;
    size_t lcap = 0;
    int n = 0;
    while (n < cap && getline(&line, &lcap, f) > 0) {
        json_error_t je;
        json_t *j = json_loads(line, 0, &je);
        json_t *arr = j ? json_object_get(j, "prompt_ids") : NULL;
        if (arr && json_array_size(arr) <= 2048) {
            size_t i;
            json_t *v;
            json_array_foreach(arr, i, v) ids[n][i] = (int32_t)json_integer_value(v);
            lens[n++] = (int)json_array_size(arr);
        }
        json_decref(j);
    }
    free(line);
    fclose(f);
    return n;
}

/* Byte comparison of positions [p0, p1) in every layer of two caches. */
static int kv_same(session *a, session *b, int p0, int p1) {
    kvcache *ka = session_kv(a), *kb = session_kv(b);
    size_t bytes = kv_row_bytes(ka) * (size_t)(p1 - p0);
    uint8_t *x = malloc(2 * bytes + 1), *y = malloc(2 * bytes + 1);
    char err[128];
    int same = x && y;
    for (int l = 0; same && l < kv_n_layer(ka); l++)
        same = !kv_read_span(ka, l, p0, p1 - p0, x, x + bytes, err, sizeof err) &&
               !kv_read_span(kb, l, p0, p1 - p0, y, y + bytes, err, sizeof err) && !memcmp(x, y, 2 * bytes);
    free(x); free(y);
    return same;
}

static void test_in_process(const char *model_path, const char *golden, const char *secret) {
    static int32_t ids[8][2048];
    int lens[8];
    int np = load_golden_ids(golden, ids, lens, 8);
    CHECK(np >= 4, "golden prompt ids from %s", golden);
    if (np < 4) return;
    char err[512];
    model *m = NULL;
    model_opts mo = { .n_threads = 1, .n_batch = 512 };
    CHECK(model_load(&m, model_path, &mo, err, sizeof err) == 0, "load %s: %s", model_path, err);
    if (!m) return;
    const char *extra[] = { "-b", "16", "-t", "1", NULL };
    tnode n;
    if (node_start(&n, model_path, secret, extra)) { CHECK(0, "node for in-process checks"); model_free(m); return; }
    char hp[64];
    snprintf(hp, sizeof hp, "127.0.0.1:%d", n.port);
    const char *sec = "handoff-test-secret-5f0c2a9e7b1d4c3a8e6f9b2d1c0a7e5f";
    handoff_opts ho = { .timeout_ms = 10000 * g_slow, .secret = sec, .secret_len = strlen(sec), .node_id = "test" };
    session *loc = NULL, *rem = NULL;
    session_new(&loc, m, 2048, GGML_TYPE_F16, err, sizeof err);
    session_new(&rem, m, 2048, GGML_TYPE_F16, err, sizeof err);
    CHECK(loc && rem, "sessions");
    int n_vocab = model_get_hparams(m)->n_vocab;
    float *la = malloc(sizeof(float) * (size_t)n_vocab), *lb = malloc(sizeof(float) * (size_t)n_vocab);

    /* The received KV equals a local prefill byte for byte; with a prefix
     * already held, only the rest is sent; q8_0 wire converts on arrival. */
    int pi = 1;   /* a 65-token prompt: two 64-position chunks on the node */
    const int32_t *t = ids[pi];
    int len = lens[pi];
    handoff_client *c = NULL;
    handoff_stats st;
    if (loc && rem && handoff_connect(&c, hp, m, GGML_TYPE_F16, &ho, err, sizeof err) == 0) {
        CHECK(model_eval(m, loc, t, len, la, NULL, NULL, err, sizeof err) == 0, "local eval");
        int rc = handoff_prefill(c, rem, t, len, 0, &st, err, sizeof err);
        CHECK(rc == 0 && session_pos(rem) == len - 1 && st.n_sent == len - 1 && st.n_computed_remote == len - 1,
              "handoff: rc %d pos %d sent %d computed %d: %s", rc, session_pos(rem), st.n_sent, st.n_computed_remote, err);
        CHECK(kv_same(loc, rem, 0, len - 1), "received KV is byte-identical to a local prefill");
        CHECK(model_eval(m, rem, t + len - 1, 1, lb, NULL, NULL, err, sizeof err) == 0 &&
              !memcmp(la, lb, sizeof(float) * (size_t)n_vocab), "last-token logits identical");
        /* a decode node that already holds 20 positions */
        session_reset(rem, 20);
        rc = handoff_prefill(c, rem, t, len, 20, &st, err, sizeof err);
        CHECK(rc == 0 && st.n_sent == len - 21 && session_pos(rem) == len - 1, "prefix: sent %d of %d: %s", st.n_sent, len - 1, err);
        CHECK(kv_same(loc, rem, 0, len - 1), "prefix handoff KV identical");
        CHECK(st.n_computed_remote == 0, "the node reused its own copy of the prompt (computed %d)", st.n_computed_remote);
        handoff_close(c);
    } else {
        CHECK(0, "connect: %s", err);
    }
    handoff_opts hq = ho;
    hq.wire_dtype = GGML_TYPE_Q8_0;
    hq.zstd = 1;
    c = NULL;
    if (handoff_connect(&c, hp, m, GGML_TYPE_F16, &hq, err, sizeof err) == 0) {
        session_reset(rem, 0);
        int rc = handoff_prefill(c, rem, t, len, 0, &st, err, sizeof err);
        CHECK(rc == 0 && session_pos(rem) == len - 1, "q8_0 handoff: %s", err);
        CHECK(st.kv_bytes < (uint64_t)2 * 4 * (len - 1) * 2 * 256 * 2 / 3, "q8_0 halves the bytes (%llu)", (unsigned long long)st.kv_bytes);
        model_eval(m, rem, t + len - 1, 1, lb, NULL, NULL, err, sizeof err);
        int am = 0, bm = 0;
        for (int i = 1; i < n_vocab; i++) { if (la[i] > la[am]) am = i; if (lb[i] > lb[bm]) bm = i; }
        double md = 0;
        for (int i = 0; i < n_vocab; i++) { double d = fabs((double)la[i] - lb[i]); if (d > md) md = d; }
        printf("handoff: in-process q8_0 wire: max logit difference %.4f, argmax %s, KV %llu B, wire %llu B (zstd)\n",
               md, am == bm ? "same" : "differs", (unsigned long long)st.kv_bytes, (unsigned long long)st.wire_bytes);
        CHECK(md < 2.0, "q8_0 KV keeps logits close (max diff %.3f)", md);
        handoff_close(c);
    } else {
        CHECK(0, "connect q8_0: %s", err);
    }

    /* 9: many requests, each on a new connection: the node must not grow. */
    int total = g_asan ? 12 : 30, warm = g_asan ? 4 : 8;
    long rss0 = 0;
    int fd0 = 0, fails = 0;
    double t0 = now_ms();
    for (int i = 0; i < total; i++) {
        if (i == warm) { rss0 = rss_kb(n.pid); fd0 = count_fds(n.pid); }
        int k = i % np;
        if (lens[k] > 200) k = 0;
        c = NULL;
        session_reset(rem, 0);
        if (handoff_connect(&c, hp, m, GGML_TYPE_F16, &ho, err, sizeof err) ||
            handoff_prefill(c, rem, ids[k], lens[k], 0, &st, err, sizeof err)) {
            fails++;
            fprintf(stderr, "request %d: %s\n", i, err);
        }
        handoff_close(c);
    }
    sleep_ms(300);   /* the node closes its side after we do */
    long rss1 = rss_kb(n.pid);
    int fd1 = count_fds(n.pid);
    CHECK(fails == 0, "%d of %d requests failed", fails, total);
    CHECK(rss1 - rss0 < 4096, "node VmRSS grew %ld kB over %d requests (%ld -> %ld kB)", rss1 - rss0, total - warm, rss0, rss1);
    CHECK(fd1 <= fd0, "node fds %d -> %d", fd0, fd1);
    printf("handoff: %d requests in a row (%.1f s): node VmRSS %ld -> %ld kB, fds %d -> %d\n", total,
           (now_ms() - t0) / 1e3, rss0, rss1, fd0, fd1);
    CHECK(node_stop(&n) == 0, "node stops cleanly");
    free(la); free(lb);
    session_free(loc);
    session_free(rem);
    model_free(m);
}

/* ==== main ==== */

int main(void) {
    signal(SIGPIPE, SIG_IGN);
    g_bin = getenv("TANDEM_BIN") && *getenv("TANDEM_BIN") ? getenv("TANDEM_BIN") : "build/tandem";
    g_asan = getenv("TANDEM_ASAN") && atoi(getenv("TANDEM_ASAN"));
    g_all = getenv("TANDEM_HANDOFF_ALL") && atoi(getenv("TANDEM_HANDOFF_ALL"));
    g_slow = g_asan ? 4 : 1;
    g_pbe = getenv("TANDEM_PREFILL_BACKEND") && *getenv("TANDEM_PREFILL_BACKEND") ? getenv("TANDEM_PREFILL_BACKEND") : NULL;
    g_dbe = getenv("TANDEM_DECODE_BACKEND") && *getenv("TANDEM_DECODE_BACKEND") ? getenv("TANDEM_DECODE_BACKEND") : NULL;
    g_xbe = g_pbe ? g_pbe : g_dbe;
    if (g_asan) {
        /* ASan's quarantine keeps freed memory resident, which would read as
         * growth in the VmRSS check; LeakSanitizer checks the nodes at exit. */
        char env[512];
        const char *cur = getenv("ASAN_OPTIONS");
        snprintf(env, sizeof env, "%s%squarantine_size_mb=4", cur ? cur : "", cur && *cur ? ":" : "");
        setenv("ASAN_OPTIONS", env, 1);
    }
    if (access(g_bin, X_OK)) { CHECK(0, "tandem binary %s (set TANDEM_BIN)", g_bin); return t_done("test_handoff"); }
    snprintf(g_tmp, sizeof g_tmp, "/tmp/tandem-handoff-XXXXXX");
    if (!mkdtemp(g_tmp)) { CHECK(0, "mkdtemp"); return t_done("test_handoff"); }
    if (g_xbe && pbe_missing()) {
        tmp_remove();
        return t_done("test_handoff");
    }
    char secret[300], bad[300];
    snprintf(secret, sizeof secret, "%s/secret", g_tmp);
    snprintf(bad, sizeof bad, "%s/bad-secret", g_tmp);
    write_text(secret, "handoff-test-secret-5f0c2a9e7b1d4c3a8e6f9b2d1c0a7e5f\n");
    write_text(bad, "not-the-secret-9d8c7b6a5f4e3d2c1b0a9f8e7d6c5b4a3f2e\n");
    const char *fx = t_fixtures(), *md = t_models();
    char m[16][512], g[16][512];
    const char *names[] = { "stories260K", "stories260K-F16", "qwen3-mini-Q8_0", "qwen3moe-mini-Q4_K_M",
                            "qwen2-mini-Q4_0", "qwen3-mini-Q4_K_M", "qwen3-mini-F16", "qwen3moe-mini-F16",
                            "qwen2-mini-F16" };
    /* prompts per model (spread over the file), longest prompt, q8_0 wire */
    int k[] = { 8, 4, 4, 2, 2, 1, 1, 1, 1 };
    int q8[] = { 1, 0, 1, 1, 0, 0, 0, 0, 0 };
    int nm = (int)(sizeof names / sizeof names[0]);
    double t0 = now_ms();
    const char *b32[] = { "-b", "32", NULL, NULL, NULL };   /* several chunks per prompt on the node */
    const char *pbe[] = { NULL, NULL, NULL };
    if (g_pbe) {
        b32[2] = pbe[0] = "--backend";
        b32[3] = pbe[1] = g_pbe;
    }
    const char *only = getenv("TANDEM_HANDOFF_ONLY");
    for (int i = 0; i < nm; i++) {
        if (only && *only && !strstr(names[i], only)) continue;
        int gen = strstr(names[i], "-F16") && strncmp(names[i], "stories", 7);
        snprintf(m[i], sizeof m[i], "%s/%s.gguf", gen ? md : fx, names[i]);
        if (gen) snprintf(m[i], sizeof m[i], "%s/%s.gguf", md, names[i]);
        else {
            char rel[128];
            snprintf(rel, sizeof rel, "models/%s.gguf", names[i]);
            t_fixture_path(m[i], sizeof m[i], rel);
        }
        char grel[128];
        snprintf(grel, sizeof grel, "golden/visible/%s.jsonl", names[i]);
        t_fixture_path(g[i], sizeof g[i], grel);
        int kk = g_all ? 8 : g_asan ? (k[i] > 2 ? 2 : 1) : k[i];
        if (g_asan && i >= 5) continue;   /* the other F16/Q4_K files add time, not coverage */
        if (g_xbe) kk = 8;   /* the cross-backend proof: the golden part only, more prompts */
        test_golden_model(m[i], g[i], kk, g_all ? 1 << 30 : 100, !g_xbe && (g_all || q8[i]), secret,
                          i == 2 ? b32 : pbe);
    }
    if (g_xbe) {
        printf("handoff: self-consistency: %s prefill -> %s decode: F16/F32 files: %d golden prompts split == "
               "CPU-only output (exact)\n", g_pbe ? g_pbe : "cpu", g_dbe ? g_dbe : "cpu", g_f16_prompts);
        printf("handoff: self-consistency: %s prefill -> %s decode: quantized files (%d): first token %d/%d, all 16 "
               "tokens %d/%d (floor: first token on at least half, at least 4 prompts per file)\n",
               g_pbe ? g_pbe : "cpu", g_dbe ? g_dbe : "cpu", g_xq_models, g_xq_first, g_xq_n, g_xq_all, g_xq_n);
        /* quantized weights on two backends round differently: agreement, not
         * equality, with a floor on how many prompts ran (each file runs 8) */
        CHECK(g_xq_n >= 4 * g_xq_models, "quantized files: %d prompts ran for %d files, need at least 4 each", g_xq_n,
              g_xq_models);
        CHECK(g_xq_first * 2 >= g_xq_n, "quantized files: first token agrees on %d of %d, need at least half",
              g_xq_first, g_xq_n);
        tmp_remove();
        return t_done("test_handoff");
    }
    printf("handoff: self-consistency: f16 wire: %d golden prompts, split output == one-process output (exact) for "
           "all that passed above\n", g_f16_prompts);
    printf("handoff: self-consistency: q8_0 wire (lossy) top-1 agreement over %d files: first token %d/%d, all 16 "
           "tokens %d/%d (floor: first token on at least half, at least one prompt per file)\n", g_q8_models,
           g_q8_first, g_q8_n, g_q8_all, g_q8_n);
    CHECK(g_q8_n >= g_q8_models, "q8_0 wire: %d prompts ran for %d files", g_q8_n, g_q8_models);
    CHECK(g_q8_first * 2 >= g_q8_n, "q8_0 wire sanity floor: first token agrees on %d of %d, need at least half",
          g_q8_first, g_q8_n);
    printf("handoff: golden part took %.1f s\n", (now_ms() - t0) / 1e3);

    char longp[300], shortp[300];
    snprintf(longp, sizeof longp, "%s/long.txt", g_tmp);
    snprintf(shortp, sizeof shortp, "%s/short.txt", g_tmp);
    /* about 95 tokens: six 16-position chunks on the slow node */
    write_text(longp, "Digits: 3.14159265358979 2.71828182845904 1.41421356237309 1.73205080756887 "
                      "0.57721566490153 1.61803398874989 2.50290787509589 4.66920160910299 and 42, 1729, 65536.");
    write_text(shortp, "Hi");
    t0 = now_ms();
    if (t_need(m[2])) test_faults(m[2], longp, shortp, secret);
    if (t_need(m[0]) && t_need(m[1])) test_refusals(m[0], m[1], shortp, secret, bad);
    if (t_need(m[2]) && t_need(g[2])) test_in_process(m[2], g[2], secret);
    printf("handoff: fault and load part took %.1f s\n", (now_ms() - t0) / 1e3);

    tmp_remove();
    return t_done("test_handoff");
}

/* chain_nodes.h - what test_chain and test_chain_backend share: slice
 * nodes of a layer-split chain (real `tandem serve --role prefill --layers
 * A:B` processes), the chain spec naming them, prompt files, and `tandem
 * run` with ids out, locally or through a chain.
 *
 * Include after proc.h and t.h. The including test calls chain_tmp_open
 * (g_tmp, the node secret in g_secret) before starting anything.
 */
#ifndef TANDEM_TEST_CHAIN_NODES_H
#define TANDEM_TEST_CHAIN_NODES_H

#include "engine/gguf.h"
#include "net/wire_act.h"
#include "proc.h"

#define CN_FN static __attribute__((unused))

static char g_tmp[256], g_secret[300];
static int g_pf;   /* prompt file counter */

/* the prompt every chain test starts from (about 50 tokens) */
static const char *PROMPT =
    "Once upon a time, in a small village by the sea, there lived an old fisherman and his wife. Every morning "
    "he walked down to the harbour, checked his nets and rowed out past the rocks where the gulls nested.";

typedef struct { pid_t pid; int port; char log[300]; int lo, hi; } snode;   /* lo, hi: half blocks */

/* ==== Slice nodes ==== */

/* A slice node of half-block bounds lo2:hi2 ("1.5" is 3; wire_act.h;
 * hi2 0: the whole model), `-t 1 -b 16` (every prompt crosses several
 * chunks), on backend be (NULL: no --backend, the CPU), up when its port
 * file names a port within wait_ms. */
CN_FN int snode_start_on(snode *n, const char *model, int lo2, int hi2, const char *be, int wait_ms,
                         const char *const *extra) {
    static int seq;
    char pf[300], layers[32], id[32];
    snprintf(pf, sizeof pf, "%s/port.%d", g_tmp, ++seq);
    snprintf(n->log, sizeof n->log, "%s/node.%d.log", g_tmp, seq);
    wire_layers_format(layers, sizeof layers, lo2, hi2);
    snprintf(id, sizeof id, "slice-%d", seq);
    char *argv[32] = { (char *)bin(), "serve", "--role", "prefill", "-m", (char *)model, "--secret-file", g_secret,
                       "--port-file", pf, "--node-id", id, "-t", "1", "-b", "16" };
    int k = 16;
    if (be) { argv[k++] = "--backend"; argv[k++] = (char *)be; }
    if (hi2 > 0) { argv[k++] = "--layers"; argv[k++] = layers; }
    for (int i = 0; extra && extra[i] && k < 30; i++) argv[k++] = (char *)extra[i];
    argv[k] = NULL;
    n->lo = lo2;
    n->hi = hi2;
    n->pid = spawn_io(argv, NULL, "/dev/null", n->log);
    n->port = wait_port(pf, n->pid, wait_ms);
    if (n->port > 0) return 0;
    char *log = slurp(n->log);
    fprintf(stderr, "%s slice node %s %s did not start:\n%s\n", be ? be : "cpu", model, hi2 > 0 ? layers : "(whole)",
            log ? log : "");
    free(log);
    wait_exit(n->pid, 0);
    n->pid = 0;
    return -1;
}

CN_FN void snode_stop(snode *n) {
    if (n->pid > 0) stop_proc(n->pid, 20000);
    n->pid = 0;
}

/* The chain spec "127.0.0.1:PORT/A:B,..." of k started slice nodes. */
CN_FN void spec_of(char *out, size_t len, snode *const *ns, int k) {
    size_t o = 0;
    out[0] = 0;
    for (int i = 0; i < k; i++) {
        char t[32];
        wire_layers_format(t, sizeof t, ns[i]->lo, ns[i]->hi);
        o += (size_t)snprintf(out + o, len - o, "%s127.0.0.1:%d/%s", i ? "," : "", ns[i]->port, t);
    }
}

/* ==== Runs ==== */

/* text in a fresh prompt file under g_tmp; its path (until the next call) */
CN_FN char *write_prompt(const char *text) {
    static char path[300];
    snprintf(path, sizeof path, "%s/prompt.%d", g_tmp, ++g_pf);
    write_text(path, text);
    return path;
}

/* `tandem run --ids --ignore-eos -t 1` on a prompt file; spec NULL: local,
 * else through that chain with --timeout-ms node_timeout; opt, val: one
 * more option (NULL: none). Killed past timeout_ms. The count, or -1 on a
 * failed run (then *errout holds its stderr). */
CN_FN int chain_run(const char *model, const char *prompt_path, int n_pred, const char *spec, const char *node_timeout,
                    const char *opt, const char *val, int timeout_ms, int32_t *ids, int cap, char **errout) {
    char np[16], out[300], err[300];
    snprintf(np, sizeof np, "%d", n_pred);
    snprintf(out, sizeof out, "%s/run.out", g_tmp);
    snprintf(err, sizeof err, "%s/run.err", g_tmp);
    char *argv[32] = { (char *)bin(), "run", "-m", (char *)model, "-f", (char *)prompt_path, "-n", np, "--ids",
                       "--ignore-eos", "-t", "1" };
    int k = 12;
    if (spec) {
        argv[k++] = "--prefill-node"; argv[k++] = (char *)spec;
        argv[k++] = "--secret-file"; argv[k++] = g_secret;
        argv[k++] = "--timeout-ms"; argv[k++] = (char *)node_timeout;
    }
    if (opt) { argv[k++] = (char *)opt; argv[k++] = (char *)val; }
    argv[k] = NULL;
    int rc = wait_exit(spawn_io(argv, NULL, out, err), timeout_ms);
    if (errout) *errout = slurp(err);
    if (rc != 0) return -1;
    char *o = slurp(out);
    int n = o ? ids_parse(o, ids, cap) : 0;
    free(o);
    return n;
}

/* The file's block count (its architecture's block_count), or -1. */
CN_FN int model_layers(const char *path) {
    gguf_file *f = NULL;
    char err[256];
    if (gguf_open_file(&f, path, err, sizeof err)) return -1;
    gguf_str a;
    int64_t n = -1;
    char key[96];
    if (gguf_get_str(f, "general.architecture", &a) == 0) {
        snprintf(key, sizeof key, "%.*s.block_count", (int)(a.len > 60 ? 60 : a.len), a.ptr);
        if (gguf_get_i64(f, key, &n)) n = -1;
    }
    gguf_close(f);
    return (int)n;
}

/* ==== Decode nodes and requests ==== */

/* A decode node over chain spec (`--parallel 2 -t 1`) on backend be (NULL:
 * no --backend, the CPU); its pid, *port > 0 once it listens within wait_ms. */
CN_FN pid_t dnode_start_on(const char *path, const char *spec, const char *be, int wait_ms, int *port) {
    static int seq;
    char pf[300], log[300];
    snprintf(pf, sizeof pf, "%s/dport.%d", g_tmp, ++seq);
    snprintf(log, sizeof log, "%s/decode.%d.log", g_tmp, seq);
    char *argv[] = { (char *)bin(), "serve", "--role", "decode", "-m", (char *)path, "--secret-file", g_secret, "--listen",
                     "127.0.0.1:0", "--port-file", pf, "--prefill-node", (char *)spec, "-t", "1", "--parallel", "2",
                     be ? "--backend" : NULL, (char *)be, NULL };
    pid_t dp = spawn_io(argv, NULL, "/dev/null", log);
    *port = wait_port(pf, dp, wait_ms);
    return dp;
}

/* POST /v1/generate of prompt, n tokens, prefill "remote": the reply (NULL
 * when none), *st its status. */
CN_FN json_t *gen(int port, const char *prompt, int n, int *st) {
    json_t *r = json_object();
    json_object_set_new(r, "prompt", json_string(prompt));
    json_object_set_new(r, "max_tokens", json_integer(n));
    json_object_set_new(r, "ignore_eos", json_true());
    json_object_set_new(r, "prefill", json_string("remote"));
    return post_json(port, r, st);
}

/* A decode node (port) over a chain answers PROMPT with the tokens of a
 * local CPU run, then PROMPT plus a sentence reusing its prefix: only the
 * new span comes from the chain. who names the case in the messages;
 * run_ms bounds each local reference run. */
CN_FN void chain_check_reuse(int port, const char *path, const char *who, int run_ms) {
    char ext[2048];
    snprintf(ext, sizeof ext, "%s The fisherman's wife baked bread while he was away.", PROMPT);
    int32_t ref[16], ref2[16];
    int nr = chain_run(path, write_prompt(PROMPT), 6, NULL, NULL, NULL, NULL, run_ms, ref, 16, NULL);
    int nr2 = chain_run(path, write_prompt(ext), 6, NULL, NULL, NULL, NULL, run_ms, ref2, 16, NULL);
    int st;
    json_t *o = gen(port, PROMPT, 6, &st);
    CHECK(st == 200 && !strcmp(jstr(o, "prefill", "mode"), "remote") && same_ids(json_object_get(o, "tokens"), ref, nr),
          "%s: decode node through the chain equals the CPU run (status %d, mode %s, %s)", who, st,
          jstr(o, "prefill", "mode"), jstr(o, "prefill", "fallback_reason"));
    long long n1 = jint(o, "usage", "prompt_tokens");
    json_decref(o);
    o = gen(port, ext, 6, &st);
    long long n2 = jint(o, "usage", "prompt_tokens");
    CHECK(st == 200 && !strcmp(jstr(o, "prefill", "mode"), "remote") && jint(o, "prefill", "start_pos") == n1 &&
          jint(o, "prefill", "positions_received") == n2 - n1 - 1 && same_ids(json_object_get(o, "tokens"), ref2, nr2),
          "%s: prefix reuse through the chain: start %lld (want %lld), received %lld of %lld new, tokens equal", who,
          jint(o, "prefill", "start_pos"), n1, jint(o, "prefill", "positions_received"), n2 - n1);
    json_decref(o);
}

/* ==== The test's folder ==== */

/* g_tmp from the mkdtemp template tmpl, and the node secret in g_secret;
 * 0, or -1 (perror'd). */
CN_FN int chain_tmp_open(const char *tmpl, const char *secret) {
    snprintf(g_tmp, sizeof g_tmp, "%s", tmpl);
    if (!mkdtemp(g_tmp)) { perror("mkdtemp"); return -1; }
    snprintf(g_secret, sizeof g_secret, "%s/secret", g_tmp);
    write_text(g_secret, secret);
    return 0;
}

/* g_tmp and everything in it, gone. */
CN_FN void chain_tmp_close(void) {
    char cmd[400];
    snprintf(cmd, sizeof cmd, "rm -rf %s", g_tmp);
    if (system(cmd)) {}
}

#endif

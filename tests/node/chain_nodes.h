/* chain_nodes.h - what test_chain and test_chain_backend share: slice
 * nodes of a layer-split chain (real `tandem serve --role prefill --layers
 * A:B` processes), the chain spec naming them, prompt files, and `tandem
 * run` with ids out, locally or through a chain.
 *
 * Include after proc.h and t.h. The including test makes g_tmp (mkdtemp)
 * and writes the node secret to g_secret before starting anything.
 */
#ifndef TANDEM_TEST_CHAIN_NODES_H
#define TANDEM_TEST_CHAIN_NODES_H

#include "engine/gguf.h"
#include "net/wire_act.h"
#include "proc.h"

#define CN_FN static __attribute__((unused))

static char g_tmp[256], g_secret[300];
static int g_pf;   /* prompt file counter */

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

static const char *PROMPT =
    "Once upon a time, in a small village by the sea, there lived an old fisherman and his wife. Every morning "
    "he walked down to the harbour, checked his nets and rowed out past the rocks where the gulls nested.";

#endif

/* serve.c - `tandem serve --role prefill|decode|local`: the long-running
 * nodes. Options common to every role are parsed here; each role has one
 * function below that takes the loaded model and the parsed options.
 *
 *   prefill  computes prompts' KV for decode nodes (node_prefill.c)
 *   decode   keeps sessions, samples, takes generation requests (node_decode.c)
 *   local    decode and prefill in one process (node_decode.c)
 */
#include "cmd/cli.h"

#include <errno.h>
#include <signal.h>
#ifdef __GLIBC__
#include <malloc.h>
#endif
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "base/cliopt.h"
#include "node/chain.h"
#include "node/handoff.h"
#include "engine/kvcache.h"
#include "base/log.h"
#include "engine/model.h"
#include "node/node_decode.h"
#include "node/node_drain.h"
#include "net/node_register.h"
#include "net/wire_act.h"
#include "router/router.h"
#include "engine/quant.h"

/* ==== Options ==== */

enum serve_role { SERVE_PREFILL = 1, SERVE_DECODE, SERVE_LOCAL };

typedef struct {
    enum serve_role role;
    const char *model, *listen, *secret_file, *kv_type, *node_id, *port_file, *backend;
    const char *router, *model_name, *advertise;   /* registration with a router */
    const char *metrics_listen, *metrics_port_file;  /* prefill role: GET /metrics */
    const char *kv_cache_dir;                      /* prefill role: KV store (kvstore.h) */
    uint64_t kv_cache_ram, kv_cache_disk;
    int n_threads, n_ctx, n_batch, timeout_ms, max_conns, device;
    int max_preauth, handshake_ms, idle_ms, request_ms;   /* prefill node limits (0 = default) */
    int drain_timeout_ms;                                 /* node_drain.h */
    int debug_frame_delay_ms, debug_layer_delay_ms, debug_corrupt_frame, debug_tamper_frame;   /* fault injection (tests) */
    int debug_act_stall;  /* prefill slice: stop sending after the Nth ACT frame (tests) */
    int chain_chunks;     /* prefill slice: --chain-chunks (chain.h CHAIN_MIN_CHUNKS) */
    int layer_lo, layer_hi;   /* prefill role: --layers A:B (0, 0 = the whole model) */
    int ffn_first, attn_last; /* --layers bounds "L.5" (model_opts) */
    const char *draft_model;  /* prefill role: --draft-model FILE (a draft node: draft_serve.h) */
    int draft_slots;          /* --draft-slots N */
    uint32_t kv_dtype;
    char *secret;
    size_t secret_len;
    volatile int *stop;   /* set by SIGINT / SIGTERM (cliopt_stop_on_signals) */
} serve_opts;

static void serve_usage(FILE *f) {
    fprintf(f,
        "usage: tandem serve --role ROLE [options]\n"
        "Roles (`tandem serve --role ROLE --help` lists each one's options):\n"
        "  prefill   computes prompts' KV and streams it to decode nodes\n"
        "  decode    keeps sessions and generates; OpenAI-compatible HTTP API; may use prefill nodes\n"
        "  local     decode and prefill in one process (no prefill nodes)\n"
        "  router    OpenAI-compatible front end over decode and prefill nodes (loads no model)\n"
        "\n"
        "usage: tandem serve --role prefill -m MODEL.gguf [options]\n"
        "  --listen HOST:PORT   address to listen on (default 127.0.0.1:0 = any free port)\n"
        "  --secret-file FILE   shared secret for node authentication (or env TANDEM_SECRET);\n"
        "                       required for network roles\n"
        "  -t N                 threads (default 2)\n"
        "  -c N                 context per request (default: the model's, at most 4096)\n"
        "  -b N                 prefill chunk size (default: the backend's, 512 on the CPU, 4096\n"
        "                       with cuda)\n"
        "  --kv-type T          KV cache type: f16 (default), bf16, q8_0\n"
        "  --node-id NAME       this node's name in handshakes and logs\n"
        "  --timeout-ms N       per-frame I/O deadline (default 10000)\n"
        "  --port-file FILE     write the bound port there once listening\n"
        "  --max-conns N        concurrent connections (default 16)\n"
        "  --router URL         register with (and heartbeat to) the router at URL (http://HOST:PORT)\n"
        "  --model-name NAME    the model name to register and to label /metrics with\n"
        "                       (default: the file name without .gguf)\n"
        "  --advertise HOST[:PORT]  the address the router should use (default: the listen address)\n"
        "  --log-level LEVEL    error, warn, info (default) or debug; or env TANDEM_LOG_LEVEL\n"
        "Prefill role:\n"
        "  --max-preauth N      connections still in their handshake (default 16; the oldest\n"
        "                       is dropped for a new one)\n"
        "  --handshake-ms N     handshake deadline (default 2000)\n"
        "  --idle-ms N          close a connection that sends no request for N ms (default 300000)\n"
        "  --request-ms N       limit on one request, queue wait included (default: 300000, or\n"
        "                       50 ms per position asked for when that is more: 819 s for 16,384)\n"
        "  --drain-timeout MS   on SIGTERM/SIGINT: deregister, stop accepting, let handoffs in flight\n"
        "                       finish this long (default 20000), then cut them\n"
        "  --metrics-listen HOST:PORT  serve GET /metrics (Prometheus text, no authentication) there\n"
        "  --metrics-port-file FILE    write the bound metrics port there\n"
        "  --kv-cache-ram BYTES, --kv-cache-dir DIR, --kv-cache-disk BYTES  a KV prefix store as on\n"
        "                       decode nodes: a repeated prefix is loaded, not recomputed\n"
        "  --layers A:B         serve blocks A..B-1 only (end exclusive; a slice of a layer-split\n"
        "                       prefill chain: docs/layer-split.md); a bound L.5 is the middle of\n"
        "                       block L (after its attention), shared with the neighbouring slice\n"
        "  --chain-chunks N     (slice) cut a prompt into at least N chunks, halving -b down to\n"
        "                       128 rows, to shrink the pipeline's bubble (default 16; 1 = -b rows)\n"
        "  --draft-model FILE   also a draft node: decode nodes started with --draft-node HOST:PORT\n"
        "                       get speculative drafts of this model (same tokenizer as -m) over\n"
        "                       the wire protocol (docs/wire-protocol.md 4.10)\n"
        "  --draft-slots N      sequences the draft node keeps at once, one draft KV cache each\n"
        "                       (1-64, default 8; the least recently asked gives way)\n");
    cliopt_usage_backend(f, 20);
    fprintf(f,
        "Fault injection for tests (prefill role):\n"
        "  --debug-frame-delay-ms N   sleep N ms before each KV frame\n"
        "  --debug-layer-delay-ms N   sleep N ms after each layer's computation (a slow node)\n"
        "  --debug-corrupt-frame N    flip a byte of the Nth KV frame of each request after its CRC\n"
        "  --debug-tamper-frame N     flip a sealed byte of the Nth KV frame and fix its CRC\n"
        "  --debug-act-stall N        (slice) stop sending anything after the Nth ACT frame\n");
}

#define SERVE "tandem serve"

static int serve_int(const char *opt, const char *v, int lo, int hi, int *out) {
    return cliopt_int(SERVE, opt, v, lo, hi, out);
}

static const char *const serve_roles[] = { "prefill", "decode", "local", "router", NULL };

static int serve_role_parse(const char *s, enum serve_role *r) {
    int k;
    if (cliopt_choice(SERVE, "--role", s, serve_roles, &k) || k == 3) return -1;
    *r = (enum serve_role)(k + 1);   /* SERVE_PREFILL = 1; router never gets here */
    return 0;
}

/* --layers A:B: 0 <= A < B <= 1024, each a block or the middle of one
 * ("3.5"; the file's block count is checked at load). */
static int serve_layers(const char *opt, const char *v, serve_opts *o) {
    int a, b, n = 0;
    if (!v || wire_layers_parse(v, &a, &b, &n) || v[n]) {
        fprintf(stderr, SERVE ": %s wants A:B with 0 <= A < B (end exclusive; L or L.5), got '%s'\n", opt, v ? v : "");
        return -1;
    }
    o->layer_lo = a / 2;
    o->ffn_first = a % 2;
    o->layer_hi = (b + 1) / 2;
    o->attn_last = b % 2;
    return 0;
}

/* Parses the options; 0, or -1 after printing what is wrong. */
static int serve_parse(int argc, char **argv, serve_opts *o) {
    memset(o, 0, sizeof *o);
    o->n_threads = 2; o->n_batch = 0; o->kv_type = "f16"; o->timeout_ms = 10000; o->listen = "127.0.0.1:0";
    o->drain_timeout_ms = NODE_DRAIN_DEFAULT_MS;
    for (int i = 0; i < argc; i += 2) {   /* every option here takes a value */
        const char *a = argv[i], *v = i + 1 < argc ? argv[i + 1] : NULL;
        int bad = 0;
        if (!strcmp(a, "--role")) bad = serve_role_parse(v, &o->role);
        else if (!strcmp(a, "-m")) bad = cliopt_str(SERVE, a, v, &o->model);
        else if (!strcmp(a, "--listen")) bad = cliopt_str(SERVE, a, v, &o->listen);
        else if (!strcmp(a, "--secret-file")) bad = cliopt_str(SERVE, a, v, &o->secret_file);
        else if (!strcmp(a, "--kv-type")) bad = cliopt_str(SERVE, a, v, &o->kv_type);
        else if (!strcmp(a, "--node-id")) bad = cliopt_str(SERVE, a, v, &o->node_id);
        else if (!strcmp(a, "--port-file")) bad = cliopt_str(SERVE, a, v, &o->port_file);
        else if (!strcmp(a, "--router")) bad = cliopt_str(SERVE, a, v, &o->router);
        else if (!strcmp(a, "--model-name")) bad = cliopt_str(SERVE, a, v, &o->model_name);
        else if (!strcmp(a, "--advertise")) bad = cliopt_str(SERVE, a, v, &o->advertise);
        else if (!strcmp(a, "--metrics-listen")) bad = cliopt_str(SERVE, a, v, &o->metrics_listen);
        else if (!strcmp(a, "--metrics-port-file")) bad = cliopt_str(SERVE, a, v, &o->metrics_port_file);
        else if (!strcmp(a, "-t")) bad = serve_int(a, v, 1, 256, &o->n_threads);
        else if (!strcmp(a, "-c")) bad = serve_int(a, v, 1, 1 << 24, &o->n_ctx);
        else if (!strcmp(a, "-b")) bad = serve_int(a, v, 1, 1 << 16, &o->n_batch);
        else if (!strcmp(a, "--timeout-ms")) bad = serve_int(a, v, 1, 3600000, &o->timeout_ms);
        else if (!strcmp(a, "--max-conns")) bad = serve_int(a, v, 1, 256, &o->max_conns);
        else if (!strcmp(a, "--backend")) bad = cliopt_backend(SERVE, v, &o->backend);
        else if (!strcmp(a, "--device")) bad = serve_int(a, v, 0, 63, &o->device);
        else if (!strcmp(a, "--debug-frame-delay-ms")) bad = serve_int(a, v, 0, 60000, &o->debug_frame_delay_ms);
        else if (!strcmp(a, "--debug-layer-delay-ms")) bad = serve_int(a, v, 0, 60000, &o->debug_layer_delay_ms);
        else if (!strcmp(a, "--debug-corrupt-frame")) bad = serve_int(a, v, 0, 1 << 30, &o->debug_corrupt_frame);
        else if (!strcmp(a, "--debug-tamper-frame")) bad = serve_int(a, v, 0, 1 << 30, &o->debug_tamper_frame);
        else if (!strcmp(a, "--max-preauth")) bad = serve_int(a, v, 1, 256, &o->max_preauth);
        else if (!strcmp(a, "--handshake-ms")) bad = serve_int(a, v, 1, 600000, &o->handshake_ms);
        else if (!strcmp(a, "--idle-ms")) bad = serve_int(a, v, 1, 86400000, &o->idle_ms);
        else if (!strcmp(a, "--request-ms")) bad = serve_int(a, v, 1, 86400000, &o->request_ms);
        else if (!strcmp(a, "--kv-cache-ram")) bad = cliopt_u64(SERVE, a, v, 0, UINT64_C(1) << 50, &o->kv_cache_ram);
        else if (!strcmp(a, "--kv-cache-disk")) bad = cliopt_u64(SERVE, a, v, 1, UINT64_C(1) << 60, &o->kv_cache_disk);
        else if (!strcmp(a, "--kv-cache-dir")) bad = cliopt_str(SERVE, a, v, &o->kv_cache_dir);
        else if (!strcmp(a, "--layers")) bad = serve_layers(a, v, o);
        else if (!strcmp(a, "--draft-model")) bad = cliopt_str(SERVE, a, v, &o->draft_model);
        else if (!strcmp(a, "--draft-slots")) bad = serve_int(a, v, 1, 64, &o->draft_slots);
        else if (!strcmp(a, "--debug-act-stall")) bad = serve_int(a, v, 0, 1 << 30, &o->debug_act_stall);
        else if (!strcmp(a, "--chain-chunks")) bad = serve_int(a, v, 1, 4096, &o->chain_chunks);
        else if (!strcmp(a, "--drain-timeout")) bad = serve_int(a, v, 0, 3600000, &o->drain_timeout_ms);
        else { fprintf(stderr, SERVE ": unknown option %s (see tandem serve --help)\n", a); return -1; }
        if (bad) return -1;   /* cliopt said what is wrong */
    }
    if (!o->role || !o->model) {
        if (argc) fprintf(stderr, SERVE ": %s\n", !o->role ? "give --role prefill|decode|local|router" : "give -m MODEL.gguf");
        serve_usage(stderr);
        return -1;
    }
    o->kv_dtype = kv_dtype_parse(o->kv_type);
    if (o->kv_dtype == UINT32_MAX) { fprintf(stderr, "tandem serve: unknown KV type %s\n", o->kv_type); return -1; }
    return 0;
}

/* ==== Roles ==== */

static int serve_prefill(model *m, model *dm, const serve_opts *o) {
    static volatile int port;
    node_register *reg = NULL;
    char err[512], name[128];
    if (o->router) {
        node_register_default_model(o->model, name, sizeof name);
        node_register_opts ro = { .router_url = o->router, .role = "prefill", .model = o->model_name ? o->model_name : name,
                                  .advertise = o->advertise, .listen = o->listen, .port = &port,
                                  .secret = o->secret, .secret_len = o->secret_len };
        if (node_register_start(&reg, &ro, err, sizeof err)) { log_error(NULL, "%s", err); return 2; }
    }
    prefill_node_opts po = {
        .listen = o->listen, .secret = o->secret, .secret_len = o->secret_len,
        .node_id = o->node_id ? o->node_id : "prefill", .n_ctx = o->n_ctx, .kv_dtype = o->kv_dtype,
        .timeout_ms = o->timeout_ms, .stop = o->stop, .port_file = o->port_file,
        .max_conns = o->max_conns, .debug_frame_delay_ms = o->debug_frame_delay_ms,
        .debug_layer_delay_ms = o->debug_layer_delay_ms,
        .debug_corrupt_frame = o->debug_corrupt_frame, .debug_tamper_frame = o->debug_tamper_frame,
        .max_preauth = o->max_preauth, .handshake_ms = o->handshake_ms, .idle_ms = o->idle_ms,
        .request_ms = o->request_ms, .port_out = &port,
        .metrics_listen = o->metrics_listen, .metrics_port_file = o->metrics_port_file,
        .model_name = o->model_name, .model_path = o->model, .debug_act_stall = o->debug_act_stall,
        .chain_min_chunks = o->chain_chunks ? o->chain_chunks : CHAIN_MIN_CHUNKS,
        .kv_cache_ram = o->kv_cache_ram, .kv_cache_dir = o->kv_cache_dir, .kv_cache_disk = o->kv_cache_disk,
        .drain_timeout_ms = o->drain_timeout_ms, .reg = reg, .draft_model = dm, .draft_slots = o->draft_slots,
    };
    int rc = 0;
    if (prefill_node_run(m, &po, err, sizeof err)) { log_error(NULL, "%s", err); rc = 1; }
    node_register_stop(reg);
    return rc;
}

/* --help: the usage of the role given with it, or the overview and prefill's. */
static int serve_help(int argc, char **argv) {
    const char *role = NULL;
    for (int i = 0; i + 1 < argc; i++)
        if (!strcmp(argv[i], "--role")) role = argv[i + 1];
    if (role && !strcmp(role, "router")) router_usage(stdout);
    else if (role && (!strcmp(role, "decode") || !strcmp(role, "local"))) decode_node_usage(stdout);
    else serve_usage(stdout);
    return CLI_EXIT_OK;
}

/* --log-level (every role) and the role named on each log line. 0, or -1
 * after printing what is wrong. */
static int serve_log_setup(int *argc, char **argv) {
    char err[160];
    if (log_cli_take(argc, argv, err, sizeof err)) { fprintf(stderr, "tandem serve: %s\n", err); return -1; }
    for (int i = 0; i + 1 < *argc; i++)
        if (!strcmp(argv[i], "--role")) {
            const char *r = argv[i + 1];
            if (!strcmp(r, "router") || !strcmp(r, "prefill") || !strcmp(r, "decode") || !strcmp(r, "local")) log_set_role(r);
        }
    return 0;
}

int cli_serve(int argc, char **argv) {
    /* Each connection's thread would otherwise get its own malloc arena and
     * keep its freed KV caches mapped: two arenas bound a node's footprint. */
#ifdef __GLIBC__
    mallopt(M_ARENA_MAX, 2);
    /* KV caches (megabytes each) are always mmapped and go back to the system
     * when a session ends; glibc's sliding threshold would otherwise move
     * them into the heap after the first free and keep them resident. */
    mallopt(M_MMAP_THRESHOLD, 1 << 20);
#endif
    if (cliopt_wants_help(argc, argv)) return serve_help(argc, argv);
    if (serve_log_setup(&argc, argv)) return 2;
    /* decode and local parse their own, larger option set (node_decode.c) */
    for (int i = 0; i + 1 < argc; i++)
        if (!strcmp(argv[i], "--role") && (!strcmp(argv[i + 1], "decode") || !strcmp(argv[i + 1], "local")))
            return decode_node_cli(argc, argv, !strcmp(argv[i + 1], "local"));
    /* the router loads no model and has its own options (router.c) */
    for (int i = 0; i + 1 < argc; i++)
        if (!strcmp(argv[i], "--role") && !strcmp(argv[i + 1], "router")) return router_cli(argc, argv);
    serve_opts o;
    if (serve_parse(argc, argv, &o)) return 2;
    char err[512];
    if (cliopt_load_secret(o.secret_file, &o.secret, &o.secret_len, err, sizeof err)) {
        log_error(NULL, "refusing to start a network node: %s", err);
        return 2;
    }
    o.stop = cliopt_stop_on_signals();
    model_opts mo = { .n_threads = o.n_threads, .n_batch = o.n_batch, .backend = o.backend, .device = o.device,
                      .layer_lo = o.layer_lo, .layer_hi = o.layer_hi, .ffn_first = o.ffn_first,
                      .attn_last = o.attn_last };
    model *m = NULL, *dm = NULL;
    int rc = 1;
    if (model_load(&m, o.model, &mo, err, sizeof err)) {   /* err names the file */
        log_error(NULL, "%s", err);
        goto out;
    }
    model_opts dmo = { .n_threads = o.n_threads, .n_batch = o.n_batch, .backend = o.backend, .device = o.device };
    if (o.draft_model && model_load(&dm, o.draft_model, &dmo, err, sizeof err)) {
        log_error(NULL, "draft model: %s", err);
        goto out;
    }
    int train = model_get_hparams(m)->n_ctx_train;
    if (!o.n_ctx) o.n_ctx = train > 0 && train < 4096 ? train : 4096;
    else if (train > 0 && o.n_ctx > train)
        log_warn(NULL, "-c %d is beyond the model's trained context of %d tokens", o.n_ctx, train);
    switch (o.role) {
    case SERVE_PREFILL: rc = serve_prefill(m, dm, &o); break;
    case SERVE_DECODE:
    case SERVE_LOCAL:
        fprintf(stderr, "tandem serve: role %s is not available in this build\n", o.role == SERVE_DECODE ? "decode" : "local");
        rc = 2;
        break;
    }
out:
    model_free(dm);
    model_free(m);
    free(o.secret);
    return rc;
}

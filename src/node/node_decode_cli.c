/* node_decode_cli.c - `tandem serve --role decode|local`: the decode node's
 * command line (options, their checks, the chat template, the draft model,
 * registration with a router), then decode_node_run (node_decode.c). */
#include "node/node_decode.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "base/cliopt.h"
#include "base/log.h"
#include "engine/model.h"
#include "engine/spec.h"
#include "engine/tokenizer.h"
#include "net/node_register.h"
#include "node/chain.h"
#include "node/draft.h"
#include "node/node_drain.h"

/* ==== Command line ==== */

void decode_node_usage(FILE *f) {
    fprintf(f,
        "usage: tandem serve --role decode|local -m MODEL.gguf [options]\n"
        "  --listen HOST:PORT        HTTP address (default 127.0.0.1:8080; port 0 = any free port)\n"
        "  --port-file F             write the bound port to F once listening\n"
        "  --prefill-node HOST:PORT  a prefill node (repeatable; decode role only), or a layer-split\n"
        "                            chain HOST:PORT/0:A,HOST:PORT/A:B,... (docs/layer-split.md)\n"
        "  --secret-file F           shared secret (or env TANDEM_SECRET): authenticates the prefill nodes,\n"
        "                            the router's requests to this node and our registration\n"
        "  -t N                      threads (default 2)\n"
        "  -c N                      context per session (default: the model's, at most 4096)\n"
        "  -b N                      prefill chunk (default 512)\n"
        "  --parallel N              sequences decoded together, each with its KV cache\n"
        "                            (default: what half the free memory holds, at most 8)\n"
        "  --prefill-budget N        prompt tokens per step while others decode (default 256)\n"
        "  --queue N                 requests that may wait (default 16; more get 503)\n"
        "  --min-split-tokens N      \"auto\" prefills remotely from this prompt length (default 32)\n"
        "  --kv-type T               cache type: f16 (default), bf16, q8_0\n"
        "  --wire-dtype T            handoff dtype: the cache type (default) or q8_0; q8_0 with an\n"
        "                            f16/bf16 cache is lossy: split prompts' greedy output can differ\n"
        "                            from local prefill (less than half the bytes on the wire)\n"
        "  --act-dtype T             hidden states between a chain's slices: f32 (default), f16, bf16\n"
        "  --zstd                    ask for zstd-compressed frames\n"
        "  --timeout-ms N            handoff stall timeout: no frame from the prefill node for N ms\n"
        "                            and the request prefills locally (default 10000)\n"
        "  --handoff-deadline-ms N   a handoff may take N ms in all, however it progresses (default:\n"
        "                            300000, or 50 ms per prompt position when that is more: 819 s\n"
        "                            for 16,384; the prefill node's --request-ms should not be less)\n"
        "  --lookup N                speculative decoding with prompt lookup: up to N drafts per step\n"
        "                            copied from the prompt and text so far (1-16; default off)\n"
        "  --draft-model FILE        speculative decoding with a draft model (same tokenizer)\n"
        "  --draft-max N             drafts per step from the draft model (1-16, default 8)\n"
        "  --draft-node HOST:PORT    speculative decoding with drafts from a draft node (a prefill node\n"
        "                            started with --draft-model; needs --secret-file; not with\n"
        "                            --draft-model here); up to --draft-max drafts per step\n"
        "  --draft-timeout-ms N      a draft node exchange's deadline: later, the step goes on without\n"
        "                            drafts (default 100)\n"
        "  --draft-fixed             always the most drafts, whatever their acceptance (benchmarks,\n"
        "                            tests; default: each sequence's draft length adapts to it)\n"
        "  --node-id NAME            our name towards prefill nodes\n"
        "  --router URL              register with (and heartbeat to) the router at URL (http://HOST:PORT)\n"
        "  --chat-template NAME|FILE chat format: chatml, llama3, llama3.1, or a ChatML / Llama 3 template\n"
        "                            file (default: the model's; a model without one chats in ChatML)\n"
        "  --model-name NAME         the model name to register and to label /metrics with\n"
        "                            (default: the file name without .gguf)\n"
        "  --advertise HOST[:PORT]   the address the router should use (default: the listen address)\n"
        "  --client-share PCT        percent of slots + queue one client may hold (default 50; 100 = no\n"
        "                            share); the client is the router's X-Tandem-Client on signed\n"
        "                            requests; without a secret, the peer's address (only when given)\n"
        "  --max-conns N             HTTP connections in all (default 4 x (queue + slots + 32) + 64)\n"
        "  --max-conns-per-ip N      HTTP connections per client address other than the router's\n"
        "                            (default a 16th of what the router's reserve leaves, at least 4)\n"
        "  --request-deadline-ms N   a request must arrive whole within N ms (default 10000)\n"
        "  --kv-cache-ram BYTES      keep finished sequences' KV rows by 64-token block in this much\n"
        "                            host memory (default 0: only the slots hold prefixes)\n"
        "  --kv-cache-dir DIR        and on disk under DIR (0700, ours, not writable by others), so\n"
        "                            a prefix outlives a restart; DIR may be shared by nodes\n"
        "  --kv-cache-disk BYTES     the disk tier's budget (default 4 GiB); least recently used out first\n"
        "  --drain-timeout MS        on SIGTERM/SIGINT: deregister, stop accepting, let requests in flight\n"
        "                            finish this long (default 20000), then end them with an error\n"
        "  --log-level LEVEL         error, warn, info (default) or debug; or env TANDEM_LOG_LEVEL\n");
    cliopt_usage_backend(f, 25);   /* --backend, --device: the model's and the draft model's */
}

static void dn_usage(void) { decode_node_usage(stderr); }

#define DN_CMD "tandem serve"

static int dn_cli_int(const char *opt, const char *v, int lo, int hi, int *out) {
    return cliopt_int(DN_CMD, opt, v, lo, hi, out);
}

static const char *const dn_cli_roles[] = { "decode", "local", NULL };

/* A value that must be one of names, kept as its string. */
static int dn_cli_choice(const char *opt, const char *v, const char *const *names, const char **out) {
    int k;
    if (cliopt_choice(DN_CMD, opt, v, names, &k)) return -1;
    *out = names[k];
    return 0;
}

/* --act-dtype f32|f16|bf16 (a chain's hidden states on the wire). */
static int dn_cli_act(const char *opt, const char *v, uint32_t *out) {
    static const char *const names[] = { "f32", "f16", "bf16", NULL };
    static const uint32_t types[] = { GGML_TYPE_F32, GGML_TYPE_F16, GGML_TYPE_BF16 };
    int k;
    if (cliopt_choice(DN_CMD, opt, v, names, &k)) return -1;
    *out = types[k];
    return 0;
}

typedef struct {
    decode_node_opts o;
    const char *model, *kv, *wire, *secret_file, *draft_model;
    const char *router, *model_name, *advertise, *chat_template, *backend;
    int threads, batch, device;
} dn_cli;

/* A template file is text of a few KiB (Qwen3's is 4 KiB): a bigger file is
 * the wrong one, refused unread. */
#define DN_MAX_TEMPLATE_FILE (256 * 1024)

/* --chat-template: a built-in name or a file's template for the model; a
 * model with none and no option chats in ChatML (llama-server's fallback),
 * said once at start-up. 0, or -1 with a message. */
static int dn_cli_chat_template(dn_cli *c, model *m, char *err, size_t errlen) {
    const gguf_file *f = model_get_gguf(m);
    gguf_str t;
    if (!c->chat_template) {
        if (chat_template_get(f, &t) == 0) return 0;
        c->o.chat_source = "fallback";
        log_warn(NULL, "the model has no tokenizer.chat_template: chat requests are rendered as ChatML "
                 "(--chat-template chatml|llama3|FILE chooses)");
        return chat_set_template(f, "chatml", err, errlen);
    }
    c->o.chat_source = "option";
    const char *s = c->chat_template;
    if (!strcmp(s, "chatml") || !strcmp(s, "llama3") || !strcmp(s, "llama3.1")) return chat_set_template(f, s, err, errlen);
    size_t n = 0;
    char ferr[300];
    char *text = cliopt_read_text(s, DN_MAX_TEMPLATE_FILE, &n, ferr, sizeof ferr);
    if (!text) {
        snprintf(err, errlen, "--chat-template: %s", ferr);
        return -1;
    }
    int rc = strlen(text) == n ? chat_set_template(f, text, err, errlen) : -1;
    if (strlen(text) != n) snprintf(err, errlen, "--chat-template: %s holds a NUL byte", s);
    free(text);
    return rc;
}

/* One more --prefill-node HOST:PORT. */
static int dn_cli_prefill_node(dn_cli *c, const char *opt, const char *v) {
    const char *node;
    if (cliopt_str(DN_CMD, opt, v, &node)) return -1;
    if (c->o.n_prefill_nodes == DECODE_MAX_PREFILL_NODES) {
        fprintf(stderr, DN_CMD ": %s: at most %d prefill nodes\n", opt, DECODE_MAX_PREFILL_NODES);
        return -1;
    }
    c->o.prefill_nodes[c->o.n_prefill_nodes++] = node;
    return 0;
}

/* Every --prefill-node names a port of 1-65535 (one past it used to wrap). */
static int dn_cli_check_nodes(const dn_cli *c, char *err, size_t errlen) {
    for (int i = 0; i < c->o.n_prefill_nodes; i++)
        if (cliopt_check_hostport("--prefill-node", c->o.prefill_nodes[i], 0, err, errlen)) return -1;
    return 0;
}

/* Parses the options; 0, or -1 after printing what is wrong (cliopt.h:
 * each bad value is named with its valid range). */
static int dn_cli_parse(int argc, char **argv, dn_cli *c) {
    for (int i = 0; i < argc; i++) {
        const char *a = argv[i], *v = i + 1 < argc ? argv[i + 1] : NULL, *role;
        int bad = 0;
        if (!strcmp(a, "--zstd")) { c->o.zstd = 1; continue; }
        if (!strcmp(a, "--draft-fixed")) { c->o.draft_fixed = 1; continue; }
        if (!strcmp(a, "--role")) bad = dn_cli_choice(a, v, dn_cli_roles, &role);
        else if (!strcmp(a, "-m")) bad = cliopt_str(DN_CMD, a, v, &c->model);
        else if (!strcmp(a, "--listen")) bad = cliopt_str(DN_CMD, a, v, &c->o.listen);
        else if (!strcmp(a, "--port-file")) bad = cliopt_str(DN_CMD, a, v, &c->o.port_file);
        else if (!strcmp(a, "--secret-file")) bad = cliopt_str(DN_CMD, a, v, &c->secret_file);
        else if (!strcmp(a, "--node-id")) bad = cliopt_str(DN_CMD, a, v, &c->o.node_id);
        else if (!strcmp(a, "--kv-type")) bad = dn_cli_choice(a, v, kv_dtype_names, &c->kv);
        else if (!strcmp(a, "--wire-dtype")) bad = dn_cli_choice(a, v, kv_dtype_names, &c->wire);
        else if (!strcmp(a, "--act-dtype")) bad = dn_cli_act(a, v, &c->o.act_dtype);
        else if (!strcmp(a, "--prefill-node")) bad = dn_cli_prefill_node(c, a, v);
        else if (!strcmp(a, "-t")) bad = dn_cli_int(a, v, 1, 256, &c->threads);
        else if (!strcmp(a, "-c")) bad = dn_cli_int(a, v, 1, 1 << 20, &c->o.n_ctx);
        else if (!strcmp(a, "-b")) bad = dn_cli_int(a, v, 1, 1 << 16, &c->batch);
        else if (!strcmp(a, "--backend")) bad = cliopt_backend(DN_CMD, v, &c->backend);
        else if (!strcmp(a, "--device")) bad = dn_cli_int(a, v, 0, 63, &c->device);
        else if (!strcmp(a, "--parallel") || !strcmp(a, "--sessions")) bad = dn_cli_int(a, v, 1, 256, &c->o.n_sessions);
        else if (!strcmp(a, "--prefill-budget")) bad = dn_cli_int(a, v, 1, 1 << 20, &c->o.prefill_budget);
        else if (!strcmp(a, "--queue")) bad = dn_cli_int(a, v, 1, 4096, &c->o.queue_max);
        else if (!strcmp(a, "--min-split-tokens")) bad = dn_cli_int(a, v, 1, 1 << 20, &c->o.min_split_tokens);
        else if (!strcmp(a, "--timeout-ms")) bad = dn_cli_int(a, v, 1, 3600000, &c->o.timeout_ms);
        else if (!strcmp(a, "--handoff-deadline-ms")) bad = dn_cli_int(a, v, 1, 86400000, &c->o.handoff_deadline_ms);
        else if (!strcmp(a, "--lookup")) bad = dn_cli_int(a, v, 1, SPEC_MAX_DRAFT, &c->o.lookup);
        else if (!strcmp(a, "--draft-model")) bad = cliopt_str(DN_CMD, a, v, &c->draft_model);
        else if (!strcmp(a, "--draft-node")) bad = cliopt_str(DN_CMD, a, v, &c->o.draft_node);
        else if (!strcmp(a, "--draft-timeout-ms")) bad = dn_cli_int(a, v, 1, 60000, &c->o.draft_timeout_ms);
        else if (!strcmp(a, "--draft-max")) bad = dn_cli_int(a, v, 1, SPEC_MAX_DRAFT, &c->o.draft_max);
        else if (!strcmp(a, "--router")) bad = cliopt_str(DN_CMD, a, v, &c->router);
        else if (!strcmp(a, "--model-name")) bad = cliopt_str(DN_CMD, a, v, &c->model_name);
        else if (!strcmp(a, "--chat-template")) bad = cliopt_str(DN_CMD, a, v, &c->chat_template);
        else if (!strcmp(a, "--advertise")) bad = cliopt_str(DN_CMD, a, v, &c->advertise);
        else if (!strcmp(a, "--max-conns")) bad = dn_cli_int(a, v, 1, 100000, &c->o.max_conns);
        else if (!strcmp(a, "--max-conns-per-ip")) bad = dn_cli_int(a, v, 1, 100000, &c->o.max_conns_per_ip);
        else if (!strcmp(a, "--client-share")) bad = dn_cli_int(a, v, 1, 100, &c->o.client_share);
        else if (!strcmp(a, "--request-deadline-ms")) bad = dn_cli_int(a, v, 100, 3600000, &c->o.request_deadline_ms);
        else if (!strcmp(a, "--kv-cache-ram")) bad = cliopt_u64(DN_CMD, a, v, 0, UINT64_C(1) << 50, &c->o.kv_cache_ram);
        else if (!strcmp(a, "--kv-cache-disk")) bad = cliopt_u64(DN_CMD, a, v, 1, UINT64_C(1) << 60, &c->o.kv_cache_disk);
        else if (!strcmp(a, "--kv-cache-dir")) bad = cliopt_str(DN_CMD, a, v, &c->o.kv_cache_dir);
        else if (!strcmp(a, "--drain-timeout")) bad = dn_cli_int(a, v, 0, 3600000, &c->o.drain_timeout_ms);
        else { fprintf(stderr, DN_CMD ": unknown option %s (see tandem serve --role decode --help)\n", a); return -1; }
        if (bad) return -1;   /* cliopt said what is wrong */
        i++;
    }
    if (!c->model) { fprintf(stderr, DN_CMD ": give -m MODEL.gguf\n"); dn_usage(); return -1; }
    char perr[600];
    if ((c->o.listen && cliopt_check_hostport("--listen", c->o.listen, 1, perr, sizeof perr)) ||
        dn_cli_check_nodes(c, perr, sizeof perr)) {
        fprintf(stderr, DN_CMD ": %s\n", perr);
        return -1;
    }
    if (c->o.draft_node && (cliopt_check_hostport("--draft-node", c->o.draft_node, 0, perr, sizeof perr) ||
                            (c->draft_model && snprintf(perr, sizeof perr, "--draft-node and --draft-model exclude "
                                                        "each other (the draft model runs on one node)") > 0))) {
        fprintf(stderr, DN_CMD ": %s\n", perr);
        return -1;
    }
    if (c->o.local_only && c->o.n_prefill_nodes) {
        fprintf(stderr, DN_CMD ": --role local uses no prefill node\n");
        return -1;
    }
    return 0;
}

/* --router: announce this node (as "decode"; a local node is one too). */
static int dn_cli_register(dn_cli *c, node_register **reg, char *err, size_t errlen) {
    char name[128];
    node_register_default_model(c->model, name, sizeof name);
    node_register_opts ro = { .router_url = c->router, .role = "decode", .model = c->model_name ? c->model_name : name,
                              .advertise = c->advertise, .listen = c->o.listen ? c->o.listen : "127.0.0.1:8080",
                              .port = c->o.port_out, .secret = c->o.secret, .secret_len = c->o.secret_len };
    return node_register_start(reg, &ro, err, errlen);
}

/* The model and, with --draft-model, the draft model (c->o.draft_model). */
static int dn_cli_load(dn_cli *c, const model_opts *mo, model **m, model **dm, char *err, size_t errlen) {
    if (model_load(m, c->model, mo, err, errlen)) return -1;
    if (c->draft_model && model_load(dm, c->draft_model, mo, err, errlen)) return -1;
    c->o.draft_model = *dm;
    return 0;
}

int decode_node_cli(int argc, char **argv, int local_only) {
    dn_cli c;
    memset(&c, 0, sizeof c);
    c.o.local_only = local_only;
    c.o.drain_timeout_ms = NODE_DRAIN_DEFAULT_MS;
    c.threads = 2;
    if (dn_cli_parse(argc, argv, &c)) return 2;
    char err[512];
    c.o.kv_dtype = kv_dtype_parse(c.kv ? c.kv : "f16");
    c.o.wire_dtype = c.wire ? kv_dtype_parse(c.wire) : c.o.kv_dtype;
    if (c.o.kv_dtype == UINT32_MAX || c.o.wire_dtype == UINT32_MAX) {
        fprintf(stderr, "tandem serve: unknown KV or wire type (use f16, bf16, q8_0)\n");
        return 2;
    }
    /* the secret authenticates us to prefill nodes (needed as soon as one
     * can be used), the router to us, and our registration */
    char *secret = NULL;
    if ((c.secret_file || getenv("TANDEM_SECRET") || c.o.n_prefill_nodes || c.router) &&
        cliopt_load_secret(c.secret_file, &secret, &c.o.secret_len, err, sizeof err)) {
        fprintf(stderr, "tandem serve: %s\n", err);
        return 2;
    }
    c.o.secret = secret;
    c.o.model_path = c.model;
    c.o.model_name = c.model_name;
    c.o.stop = cliopt_stop_on_signals();
    model_opts mo = { .n_threads = c.threads, .n_batch = c.batch, .backend = c.backend, .device = c.device };
    model *m = NULL;
    int rc = 1;
    static volatile int port;
    c.o.port_out = &port;
    node_register *reg = NULL;
    model *dm = NULL;
    if (dn_cli_load(&c, &mo, &m, &dm, err, sizeof err)) log_error(NULL, "%s", err);   /* err names the file */
    else if (dn_cli_chat_template(&c, m, err, sizeof err)) log_error(NULL, "%s", err);
    else if (c.router && dn_cli_register(&c, &reg, err, sizeof err)) log_error(NULL, "%s", err);
    else if ((c.o.reg = reg, decode_node_run(m, &c.o, err, sizeof err))) log_error(NULL, "%s", err);
    else rc = 0;
    node_register_stop(reg);
    model_free(dm);
    model_free(m);
    if (secret) { memset(secret, 0, c.o.secret_len); free(secret); }
    return rc;
}

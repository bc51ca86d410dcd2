/* router_config.c - the router's configuration: the JSON config file
 * (router_config_load) and the command line (router_cli).
 *
 * The rule of every router file: the registry, the measured rates and the
 * metrics live under one mutex (router.mu); no lock is held across I/O.
 */
#include "router/router_chain.h"
#include "router/router_internal.h"

/* ==== Config ==== */

void router_config_default(router_config *c) {
    memset(c, 0, sizeof *c);
    snprintf(c->listen, sizeof c->listen, "127.0.0.1:8000");
    c->split = ROUTER_SPLIT_AUTO;
    c->min_split_tokens = 32;          /* below this a handoff's fixed cost dominates */
    c->link_gbps = 10.0;               /* a datacentre link until measured */
    c->default_prefill_tps = 500.0;    /* order of magnitude of a CPU node on a small model */
    /* Counting a prompt's tokens on a decode node is one local HTTP round
     * trip and a tokenizer pass (well under 10 ms for 4k tokens); past this
     * the router estimates from bytes and says so in the decision. */
    c->tokenize_timeout_ms = 500;
    api_limits_default(&c->lim);
    c->max_body_bytes = 1 << 20;       /* 1 MiB: far above max_prompt_bytes + JSON overhead */
    c->max_concurrent = 64;
    c->request_timeout_ms = 300000;
    c->idle_timeout_ms = 30000;
    c->connect_timeout_ms = 2000;
    c->max_attempts = 3;
    c->health_interval_ms = 1000;
    /* One or two lost probes are noise on a loaded host (issue 40: under
     * heavy load every node was marked down for minutes); three in a row,
     * each with a timeout grown with the node's usual round trip
     * (router_probe_timeout_ms), is a node in trouble. A node whose
     * requests find its port closed is marked down at once instead. */
    c->down_after = 3;
    c->cache_aware = 1;                /* route by held prefixes (router_cache.c) */
    c->heartbeat_ttl_ms = 5000;
    /* HTTP server (httpd.h): room for many slow or idle clients beside the
     * real work; one address gets a quarter of it; 30 s to send a request
     * (a 1 MiB body at ~35 KB/s). */
    c->max_conns = 1024;
    /* 0: a 16th of max_connections (router_start), so that 16 addresses
     * cannot hold every connection; issue 39 saw 20 addresses at 256 each
     * leave the router serving 0 of 40 legitimate requests. */
    c->max_conns_per_ip = 0;
    c->request_deadline_ms = 30000;
    /* Long enough for a typical answer in flight to finish (a few hundred
     * tokens at tens of tokens a second), short enough for an orchestrator's
     * grace period (Kubernetes: 30 s before SIGKILL). */
    c->drain_timeout_ms = 20000;
}

void router_config_free(router_config *c) {
    if (c->secret) { OPENSSL_cleanse(c->secret, c->secret_len); free(c->secret); }
    c->secret = NULL;
    c->secret_len = 0;
}

int router_config_add_node(router_config *c, const char *role, const char *model, const char *addr,
                           char *err, size_t errlen) {
    int r = !strcmp(role, "decode") ? ROUTER_NODE_DECODE : !strcmp(role, "prefill") ? ROUTER_NODE_PREFILL : 0;
    if (!r) { rt_errf(err, errlen, "node role must be \"decode\" or \"prefill\", not \"%s\"", role); return -1; }
    if (!model || !*model || strlen(model) >= sizeof c->nodes[0].model) {
        rt_errf(err, errlen, "node %s: missing or too long model name", addr ? addr : "?");
        return -1;
    }
    if (!addr || !*addr || strlen(addr) >= sizeof c->nodes[0].addr || !strchr(addr, ':')) {
        rt_errf(err, errlen, "node address must be HOST:PORT, got \"%s\"", addr ? addr : "");
        return -1;
    }
    if (r == ROUTER_NODE_PREFILL && chain_spec_is(addr)) {   /* HOST:PORT/A:B,... (net/chain_spec.h) */
        chain_spec sp;
        if (chain_spec_parse(addr, &sp, err, errlen)) return -1;
        char why[200];
        for (int i = 0; i < sp.n; i++)
            if (router_check_addr(sp.addr[i], 0, why, sizeof why)) {   /* each member's port too */
                rt_errf(err, errlen, "chain member %.128s: %s", sp.addr[i], why);
                return -1;
            }
    } else if (chain_spec_is(addr)) {
        rt_errf(err, errlen, "node address must be HOST:PORT, got \"%s\" (only a prefill entry may be a chain)", addr);
        return -1;
    } else {
        char why[200];
        if (router_check_addr(addr, 0, why, sizeof why)) {   /* a port past 65535 used to wrap */
            rt_errf(err, errlen, "node %.128s: %s", addr, why);
            return -1;
        }
    }
    /* one node serves one model: listed twice, the later name used to
     * replace the earlier one silently */
    for (int i = 0; i < c->n_nodes; i++)
        if (c->nodes[i].role == r && !strcmp(c->nodes[i].addr, addr)) {
            rt_errf(err, errlen, "%s node %s is listed twice (as model \"%s\" and \"%s\"); a node serves one model",
                    role, addr, c->nodes[i].model, model);
            return -1;
        }
    if (c->n_nodes >= ROUTER_MAX_NODES) { rt_errf(err, errlen, "too many nodes (at most %d)", ROUTER_MAX_NODES); return -1; }
    router_node_cfg *n = &c->nodes[c->n_nodes++];
    n->role = r;
    snprintf(n->model, sizeof n->model, "%s", model);
    snprintf(n->addr, sizeof n->addr, "%s", addr);
    return 0;
}

static int rt_cfg_int(json_t *o, const char *key, int lo, int hi, int *out, char *err, size_t errlen) {
    json_t *v = json_object_get(o, key);
    if (!v) return 0;
    if (!json_is_integer(v) || json_integer_value(v) < lo || json_integer_value(v) > hi) {
        rt_errf(err, errlen, "config: \"%s\" must be an integer in [%d, %d]", key, lo, hi);
        return -1;
    }
    *out = (int)json_integer_value(v);
    return 0;
}

static int rt_cfg_bool(json_t *o, const char *key, int *out, char *err, size_t errlen) {
    json_t *v = json_object_get(o, key);
    if (!v) return 0;
    if (!json_is_boolean(v)) { rt_errf(err, errlen, "config: \"%s\" must be true or false", key); return -1; }
    *out = json_is_true(v);
    return 0;
}

static int rt_cfg_str(json_t *o, const char *key, char *out, size_t outlen, char *err, size_t errlen) {
    json_t *v = json_object_get(o, key);
    if (!v) return 0;
    if (!json_is_string(v) || json_string_length(v) >= outlen) {
        rt_errf(err, errlen, "config: \"%s\" must be a string shorter than %zu bytes", key, outlen);
        return -1;
    }
    snprintf(out, outlen, "%s", json_string_value(v));
    return 0;
}

/* Every key of an object must be one the router reads: a misspelled key
 * (min_split_tokenz) is refused by name rather than silently ignored. */
static int rt_cfg_known(json_t *o, const char *const *keys, const char *where, char *err, size_t errlen) {
    const char *k;
    json_t *v;
    json_object_foreach(o, k, v) {
        int found = 0;
        for (const char *const *p = keys; *p && !found; p++) found = !strcmp(*p, k);
        if (!found) {
            rt_errf(err, errlen, "config: unknown key \"%.100s\"%s%s (docs/router.md lists the keys)", k,
                    where[0] ? " in " : "", where);
            return -1;
        }
    }
    return 0;
}

static const char *const rt_cfg_root_keys[] = {
    "listen", "api_key", "secret", "secret_file", "split", "min_split_tokens", "link_gbps", "health_interval_ms",
    "down_after", "heartbeat_ttl_ms", "max_attempts", "tokenize_timeout_ms", "limits", "nodes",
    "registration_addresses", "cache_aware", "lenient_params", "metrics_auth", "drain_timeout_ms", NULL};
static const char *const rt_cfg_limit_keys[] = {
    "max_body_bytes", "max_prompt_bytes", "max_prompt_tokens", "max_tokens", "default_max_tokens", "max_concurrent",
    "request_timeout_ms", "idle_timeout_ms", "max_connections", "max_connections_per_ip", "request_deadline_ms", NULL};
static const char *const rt_cfg_node_keys[] = {"role", "model", "addr", NULL};

static int rt_cfg_limits(router_config *c, json_t *l, char *err, size_t errlen) {
    if (!l) return 0;
    if (!json_is_object(l)) { rt_errf(err, errlen, "config: \"limits\" must be an object"); return -1; }
    if (rt_cfg_known(l, rt_cfg_limit_keys, "\"limits\"", err, errlen)) return -1;
    int body = (int)c->max_body_bytes, prompt = (int)c->lim.max_prompt_bytes;
    if (rt_cfg_int(l, "max_body_bytes", 1024, 1 << 28, &body, err, errlen) ||
        rt_cfg_int(l, "max_prompt_bytes", 1, 1 << 28, &prompt, err, errlen) ||
        rt_cfg_int(l, "max_prompt_tokens", 1, 1 << 24, &c->lim.max_prompt_tokens, err, errlen) ||
        rt_cfg_int(l, "max_tokens", 1, 1 << 24, &c->lim.max_tokens_limit, err, errlen) ||
        rt_cfg_int(l, "default_max_tokens", 1, 1 << 24, &c->lim.default_max_tokens, err, errlen) ||
        rt_cfg_int(l, "max_concurrent", 1, 100000, &c->max_concurrent, err, errlen) ||
        rt_cfg_int(l, "request_timeout_ms", 100, 86400000, &c->request_timeout_ms, err, errlen) ||
        rt_cfg_int(l, "idle_timeout_ms", 100, 86400000, &c->idle_timeout_ms, err, errlen) ||
        rt_cfg_int(l, "max_connections", 16, 100000, &c->max_conns, err, errlen) ||
        rt_cfg_int(l, "max_connections_per_ip", 1, 100000, &c->max_conns_per_ip, err, errlen) ||
        rt_cfg_int(l, "request_deadline_ms", 100, 3600000, &c->request_deadline_ms, err, errlen))
        return -1;
    c->max_body_bytes = (size_t)body;
    c->lim.max_prompt_bytes = (size_t)prompt;
    if (c->lim.default_max_tokens > c->lim.max_tokens_limit) c->lim.default_max_tokens = c->lim.max_tokens_limit;
    return 0;
}

static int rt_cfg_split(const char *s, int *out) {
    if (!strcmp(s, "auto")) *out = ROUTER_SPLIT_AUTO;
    else if (!strcmp(s, "always")) *out = ROUTER_SPLIT_ALWAYS;
    else if (!strcmp(s, "never")) *out = ROUTER_SPLIT_NEVER;
    else return -1;
    return 0;
}

static int rt_cfg_secret(router_config *c, json_t *root, char *err, size_t errlen) {
    json_t *s = json_object_get(root, "secret"), *f = json_object_get(root, "secret_file");
    char *val = NULL;
    size_t n = 0;
    if (json_is_string(s)) {
        char why[300];
        if (cliopt_check_secret(json_string_value(s), json_string_length(s), why, sizeof why)) {
            rt_errf(err, errlen, "config: \"secret\": %s", why);
            return -1;
        }
        if (!(val = strdup(json_string_value(s)))) { rt_errf(err, errlen, "out of memory"); return -1; }
        n = strlen(val);
    } else if (json_is_string(f)) {
        if (cliopt_load_secret(json_string_value(f), &val, &n, err, errlen)) return -1;
    } else if (s || f) {
        rt_errf(err, errlen, "config: \"secret\"/\"secret_file\" must be strings");
        return -1;
    } else {
        return 0;
    }
    router_config_free(c);
    c->secret = val;
    c->secret_len = n;
    return 0;
}

static int rt_cfg_nodes(router_config *c, json_t *nodes, char *err, size_t errlen) {
    if (!nodes) return 0;
    if (!json_is_array(nodes)) { rt_errf(err, errlen, "config: \"nodes\" must be an array"); return -1; }
    for (size_t i = 0; i < json_array_size(nodes); i++) {
        json_t *n = json_array_get(nodes, i);
        char where[32];
        snprintf(where, sizeof where, "nodes[%zu]", i);
        if (!json_is_object(n)) { rt_errf(err, errlen, "config: %s must be an object", where); return -1; }
        if (rt_cfg_known(n, rt_cfg_node_keys, where, err, errlen)) return -1;
        const char *role = json_string_value(json_object_get(n, "role"));
        const char *model = json_string_value(json_object_get(n, "model"));
        const char *addr = json_string_value(json_object_get(n, "addr"));
        if (!role || !model || !addr) {
            rt_errf(err, errlen, "config: nodes[%zu] needs string \"role\", \"model\" and \"addr\"", i);
            return -1;
        }
        if (router_config_add_node(c, role, model, addr, err, errlen)) return -1;
    }
    return 0;
}

static int rt_cfg_apply(router_config *c, json_t *root, char *err, size_t errlen) {
    char split[16] = "", regaddr[16] = "";
    double gbps = c->link_gbps;
    if (rt_cfg_known(root, rt_cfg_root_keys, "", err, errlen)) return -1;
    json_t *g = json_object_get(root, "link_gbps");
    if (g && (!json_is_number(g) || json_number_value(g) <= 0)) {
        rt_errf(err, errlen, "config: \"link_gbps\" must be a positive number");
        return -1;
    }
    if (g) gbps = json_number_value(g);
    c->link_gbps = gbps;
    if (rt_cfg_str(root, "listen", c->listen, sizeof c->listen, err, errlen) ||
        rt_cfg_str(root, "api_key", c->api_key, sizeof c->api_key, err, errlen) ||
        rt_cfg_str(root, "split", split, sizeof split, err, errlen) ||
        rt_cfg_str(root, "registration_addresses", regaddr, sizeof regaddr, err, errlen) ||
        rt_cfg_int(root, "min_split_tokens", 0, 1 << 24, &c->min_split_tokens, err, errlen) ||
        rt_cfg_int(root, "health_interval_ms", 50, 600000, &c->health_interval_ms, err, errlen) ||
        rt_cfg_int(root, "down_after", 1, 100, &c->down_after, err, errlen) ||
        rt_cfg_int(root, "heartbeat_ttl_ms", 100, 3600000, &c->heartbeat_ttl_ms, err, errlen) ||
        rt_cfg_int(root, "max_attempts", 1, 16, &c->max_attempts, err, errlen) ||
        rt_cfg_int(root, "tokenize_timeout_ms", 10, 60000, &c->tokenize_timeout_ms, err, errlen) ||
        rt_cfg_int(root, "drain_timeout_ms", 0, 3600000, &c->drain_timeout_ms, err, errlen) ||
        rt_cfg_bool(root, "metrics_auth", &c->metrics_auth, err, errlen) ||
        rt_cfg_secret(c, root, err, errlen) ||
        rt_cfg_limits(c, json_object_get(root, "limits"), err, errlen) ||
        rt_cfg_nodes(c, json_object_get(root, "nodes"), err, errlen))
        return -1;
    json_t *ca = json_object_get(root, "cache_aware");
    if (ca && !json_is_boolean(ca)) { rt_errf(err, errlen, "config: \"cache_aware\" must be true or false"); return -1; }
    if (ca) c->cache_aware = json_is_true(ca);
    if (regaddr[0] && strcmp(regaddr, "any") && strcmp(regaddr, "private")) {
        rt_errf(err, errlen, "config: \"registration_addresses\" must be \"any\" or \"private\"");
        return -1;
    }
    c->reg_private_only = !strcmp(regaddr, "private");
    json_t *lp = json_object_get(root, "lenient_params");
    if (lp && !json_is_boolean(lp)) {
        rt_errf(err, errlen, "config: \"lenient_params\" must be true or false");
        return -1;
    }
    if (lp) c->lim.lenient = json_is_true(lp);
    if (split[0] && rt_cfg_split(split, &c->split)) {
        rt_errf(err, errlen, "config: \"split\" must be \"auto\", \"always\" or \"never\"");
        return -1;
    }
    return 0;
}

int router_config_load(router_config *c, const char *path, char *err, size_t errlen) {
    json_error_t je;
    json_t *root = json_load_file(path, JSON_REJECT_DUPLICATES, &je);
    if (!root) { rt_errf(err, errlen, "%s:%d: %s", path, je.line, je.text); return -1; }
    int rc = -1;
    if (!json_is_object(root)) rt_errf(err, errlen, "%s: the config must be a JSON object", path);
    else rc = rt_cfg_apply(c, root, err, errlen);
    json_decref(root);
    return rc;
}

/* ==== CLI ==== */

void router_usage(FILE *f) {
    fprintf(f,
        "usage: tandem serve --role router (--config FILE | --decode MODEL=HOST:PORT ... |\n"
        "                                   --secret-file FILE) [options]\n"
        "  nodes come from --config, --decode/--prefill, or register themselves (needs the secret)\n"
        "  --config FILE          JSON config (docs/router.md): listen, nodes, secret, limits, split\n"
        "  --listen HOST:PORT     address (default 127.0.0.1:8000; port 0 = any free port)\n"
        "  --decode MODEL=HOST:PORT    a decode node serving MODEL (repeatable)\n"
        "  --prefill MODEL=HOST:PORT   a prefill node for MODEL (repeatable); or a layer-split chain,\n"
        "                              MODEL=HOST:PORT/0:A,HOST:PORT/A:B,... (docs/layer-split.md)\n"
        "  --split auto|always|never   prefill placement policy (default auto: cost model)\n"
        "  --cache-aware on|off   route a prompt where its prefix is held (default on); off:\n"
        "                         by capacity and the cost model alone\n"
        "  --secret-file FILE     shared secret (node registration); or env TANDEM_SECRET\n"
        "  --api-key-file FILE    require 'Authorization: Bearer <key>'; or env TANDEM_API_KEY\n"
        "  --port-file FILE       write the bound port there once listening\n"
        "  --max-concurrent N     generation requests in flight (default 64)\n"
        "  --health-interval-ms N (default 1000)\n"
        "  --request-timeout-ms N a request may take N ms in all (limits.request_timeout_ms; default\n"
        "                         300000), plus 50 ms per prompt token over 6,000 (what a decode\n"
        "                         node's handoff deadline grants such a prompt: docs/router.md)\n"
        "  --drain-timeout MS     on SIGTERM/SIGINT, let requests in flight finish this long (default 20000;\n"
        "                         then streams end with an error event and [DONE])\n"
        "  --metrics-auth         /metrics needs the API key too (/health's node list always does)\n"
        "  --quiet                no per-request log lines\n"
        "  --lenient-params       ignore request fields this server does not know (default: a 400 naming them)\n"
        "  --log-level LEVEL      error, warn, info (default) or debug; or env TANDEM_LOG_LEVEL\n");
}

static void rt_usage(void) { router_usage(stderr); }

#define RT_CMD "tandem serve"

/* --decode / --prefill MODEL=HOST:PORT. */
static int rt_cli_node(router_config *c, const char *opt, const char *role, const char *v) {
    char buf[300], err[256];
    if (cliopt_str(RT_CMD, opt, v, &v)) return -1;
    const char *eq = strchr(v, '=');
    if (!eq || eq == v || strlen(v) >= sizeof buf) {
        fprintf(stderr, RT_CMD ": %s: '%s' is not MODEL=HOST:PORT (at most %zu bytes)\n", opt, v, sizeof buf - 1);
        return -1;
    }
    snprintf(buf, sizeof buf, "%s", v);
    buf[eq - v] = 0;
    if (router_config_add_node(c, role, buf, buf + (eq - v) + 1, err, sizeof err)) {
        fprintf(stderr, RT_CMD ": %s: %s\n", opt, err);
        return -1;
    }
    return 0;
}

/* A key file is a line of text; a bigger file is the wrong one, refused unread. */
#define RT_MAX_KEY_FILE 4096

/* The text of the file at path, trailing whitespace stripped, into out: 1
 * to outlen - 1 bytes. 0, or -1 with a message. */
static int rt_cli_file_str(const char *path, char *out, size_t outlen, char *err, size_t errlen) {
    size_t n = 0;
    char *s = cliopt_read_text(path, RT_MAX_KEY_FILE, &n, err, errlen);
    if (!s) return -1;
    while (n && (s[n - 1] == '\n' || s[n - 1] == '\r' || s[n - 1] == ' ')) s[--n] = 0;
    int bad = n == 0 || n >= outlen;
    if (bad) snprintf(err, errlen, "the key in %s is not 1 to %zu bytes", path, outlen - 1);
    else snprintf(out, outlen, "%s", s);
    free(s);
    return bad ? -1 : 0;
}

/* --api-key-file FILE: the key is the file's text, 1 to 255 bytes. */
static int rt_cli_api_key(router_config *c, const char *opt, const char *v) {
    char err[600];
    if (cliopt_str(RT_CMD, opt, v, &v)) return -1;
    if (!rt_cli_file_str(v, c->api_key, sizeof c->api_key, err, sizeof err)) return 0;
    fprintf(stderr, RT_CMD ": %s: %s\n", opt, err);
    return -1;
}

static int rt_cli_config(router_config *c, const char *opt, const char *v) {
    char err[256];
    if (cliopt_str(RT_CMD, opt, v, &v)) return -1;
    if (!router_config_load(c, v, err, sizeof err)) return 0;
    fprintf(stderr, RT_CMD ": %s: %s\n", opt, err);
    return -1;
}

/* the order of enum router_split */
static const char *const rt_cli_splits[] = { "auto", "always", "never", NULL };
static const char *const rt_cli_roles[] = { "router", NULL };
static const char *const rt_cli_onoff[] = { "off", "on", NULL };

/* Parses the options; 0, or -1 after printing what is wrong (cliopt.h:
 * each bad value is named with its valid range). */
static int rt_cli_parse(int argc, char **argv, router_config *c, const char **port_file) {
    const char *listen = NULL, *secret_file = NULL;
    for (int i = 0; i < argc; i++) {
        const char *a = argv[i], *v = i + 1 < argc ? argv[i + 1] : NULL;
        int bad = 0, k;
        if (!strcmp(a, "--quiet")) { c->quiet = 1; continue; }
        if (!strcmp(a, "--lenient-params")) { c->lim.lenient = 1; continue; }
        if (!strcmp(a, "--metrics-auth")) { c->metrics_auth = 1; continue; }
        if (!strcmp(a, "--role")) bad = cliopt_choice(RT_CMD, a, v, rt_cli_roles, &k);
        else if (!strcmp(a, "--config")) bad = rt_cli_config(c, a, v);
        else if (!strcmp(a, "--listen")) bad = cliopt_str(RT_CMD, a, v, &listen);
        else if (!strcmp(a, "--decode")) bad = rt_cli_node(c, a, "decode", v);
        else if (!strcmp(a, "--prefill")) bad = rt_cli_node(c, a, "prefill", v);
        else if (!strcmp(a, "--split")) { bad = cliopt_choice(RT_CMD, a, v, rt_cli_splits, &k); if (!bad) c->split = k; }
        else if (!strcmp(a, "--cache-aware")) { bad = cliopt_choice(RT_CMD, a, v, rt_cli_onoff, &k); if (!bad) c->cache_aware = k; }
        else if (!strcmp(a, "--secret-file")) bad = cliopt_str(RT_CMD, a, v, &secret_file);
        else if (!strcmp(a, "--api-key-file")) bad = rt_cli_api_key(c, a, v);
        else if (!strcmp(a, "--port-file")) bad = cliopt_str(RT_CMD, a, v, port_file);
        /* the same ranges as the config file's keys */
        else if (!strcmp(a, "--max-concurrent")) bad = cliopt_int(RT_CMD, a, v, 1, 100000, &c->max_concurrent);
        else if (!strcmp(a, "--health-interval-ms")) bad = cliopt_int(RT_CMD, a, v, 50, 600000, &c->health_interval_ms);
        else if (!strcmp(a, "--drain-timeout")) bad = cliopt_int(RT_CMD, a, v, 0, 3600000, &c->drain_timeout_ms);
        else if (!strcmp(a, "--request-timeout-ms")) bad = cliopt_int(RT_CMD, a, v, 100, 86400000, &c->request_timeout_ms);
        else { fprintf(stderr, RT_CMD ": unknown router option %s\n", a); rt_usage(); return -1; }
        if (bad) return -1;   /* cliopt or the helper said what is wrong */
        i++;
    }
    if (listen) snprintf(c->listen, sizeof c->listen, "%s", listen);
    char err[600];
    if (cliopt_check_hostport("--listen", c->listen, 1, err, sizeof err)) {
        fprintf(stderr, RT_CMD ": %s\n", err);
        return -1;
    }
    if (secret_file || (!c->secret && getenv("TANDEM_SECRET"))) {
        router_config_free(c);
        if (cliopt_load_secret(secret_file, &c->secret, &c->secret_len, err, sizeof err)) {
            fprintf(stderr, RT_CMD ": %s\n", err);
            return -1;
        }
    }
    const char *k = getenv("TANDEM_API_KEY");
    if (!c->api_key[0] && k && *k) snprintf(c->api_key, sizeof c->api_key, "%s", k);
    return 0;
}

int router_cli(int argc, char **argv) {
    router_config c;
    router_config_default(&c);
    const char *port_file = NULL;
    if (rt_cli_parse(argc, argv, &c, &port_file)) { router_config_free(&c); return 2; }
    if (c.n_nodes == 0 && !c.secret) {   /* it would listen with nothing to route to, and no way to learn any */
        fprintf(stderr, "tandem serve: the router has no nodes: give --decode MODEL=HOST:PORT, --config FILE, "
                "or a shared secret (--secret-file / TANDEM_SECRET) for nodes to register\n");
        router_config_free(&c);
        return 2;
    }
    volatile int *stop = cliopt_stop_on_signals();
    router *r = NULL;
    char err[512];
    if (router_start(&r, &c, err, sizeof err)) {
        log_error(NULL, "%s", err);
        router_config_free(&c);
        return 1;
    }
    log_info(NULL, "listening on port %d (%s), %d node(s), split policy %s%s", router_port(r), c.listen, c.n_nodes,
           c.split == ROUTER_SPLIT_AUTO ? "auto" : c.split == ROUTER_SPLIT_ALWAYS ? "always" : "never",
           c.api_key[0] ? ", API key required" : "");
    if (port_file) {
        FILE *f = fopen(port_file, "w");
        if (f) { fprintf(f, "%d\n", router_port(r)); fclose(f); }
    }
    rt_ops_warn_open(&c);
    while (!*stop) usleep(100 * 1000);
    log_info(NULL, "shutting down: draining (up to %d ms)", c.drain_timeout_ms);
    router_drain(r);
    router_stop(r);
    router_config_free(&c);
    return 0;
}

/* test_kvstore.c - the KV prefix store (node/kvstore.h) with real processes.
 *
 * `tandem serve --role local|decode` with --kv-cache-ram / --kv-cache-dir on
 * the generated qwen3-mini-F16 model, over plain HTTP on loopback:
 *   - a 300-token prompt cold, then again after the slot was taken by
 *     another prompt (memory tier), after SIGTERM + restart and after kill -9
 *     + restart (disk tier): each computes only the positions past the
 *     stored 64-token blocks (the node's computed_local and cached counts)
 *     and its greedy output equals the cold run's, token for token; with
 *     n = 2; through a prefill node (positions_received counts only the
 *     rest);
 *   - faults: a corrupted block, a truncated one, one of another KV dtype
 *     (a real bf16 node's file) and one of another model are refused and
 *     deleted with a log line; a disk that fills up mid-write (a small
 *     tmpfs in a mount namespace: blocks 0 and 1 fit, block 2 does not)
 *     leaves no half block and no temporary file, counts and logs the
 *     failed writes, answers the same, and its two blocks load after a
 *     restart (where no namespace can be made: a named skip "tmpfs" and a
 *     file-size limit, RLIMIT_FSIZE, stands in); a directory removed under a
 *     running node; two nodes sharing a directory; a directory writable by
 *     others or a symbolic link is refused at start-up. Never a crash, never
 *     another answer.
 * The comparisons are self-consistency (F16 is exact here: a row's result
 * does not depend on the pass it was computed in).
 */
#include "proc.h"

#include "base/prefix_hash.h"
#include "base/strbuf.h"

#include <sys/resource.h>
#ifdef __linux__
#include <sched.h>
#include <sys/mount.h>
#endif

#include <xxhash.h>

#define PROMPT_N 300       /* 4 full blocks (256 positions) + 44 */
#define N_PRED 8
#define MODEL_LABEL "qwen3-mini-F16"

typedef struct {
    char model[1024], dir[256], store[300];
    int32_t prompt[PROMPT_N], other[PROMPT_N];
    int32_t ref[N_PRED], ref_other[N_PRED];
} ctx;

/* ==== Helpers ==== */

/* A node with the store; extra options appended (NULL-terminated). */
static int start_node(ctx *c, pid_t *pid, const char *name, const char *role, const char *const *extra) {
    char pf[512];
    snprintf(pf, sizeof pf, "%s/%s.port", c->dir, name);
    char *argv[40];
    int k = 0;
    argv[k++] = (char *)bin();
    argv[k++] = "serve";
    argv[k++] = "--role";
    argv[k++] = (char *)role;
    argv[k++] = "-m";
    argv[k++] = c->model;
    argv[k++] = "--listen";
    argv[k++] = "127.0.0.1:0";
    argv[k++] = "--port-file";
    argv[k++] = pf;
    argv[k++] = "--parallel";
    argv[k++] = "1";
    argv[k++] = "-c";
    argv[k++] = "512";
    for (int i = 0; extra && extra[i]; i++) argv[k++] = (char *)extra[i];
    argv[k] = NULL;
    return start_named(pid, argv, c->dir, name, 0, 60000);
}

typedef struct { int32_t out[N_PRED]; int n_out, cached, computed, received, remote, status; char tier[16]; } gen_res;

static gen_res gen(int port, const int32_t *ids, int n, const char *prefill) {
    gen_res r;
    memset(&r, 0, sizeof r);
    r.cached = r.computed = -1;
    json_t *o = post_json(port, gen_req(ids, n, N_PRED, 0, prefill), &r.status);
    json_t *toks = json_object_get(o, "tokens");
    for (size_t i = 0; i < json_array_size(toks) && i < N_PRED; i++)
        r.out[r.n_out++] = (int32_t)json_integer_value(json_array_get(toks, i));
    r.cached = (int)jint(json_object_get(o, "usage"), "prompt_tokens_details", "cached_tokens");
    r.computed = (int)jint(o, "prefill", "computed_local");
    r.received = (int)jint(o, "prefill", "positions_received");
    r.remote = (int)jint(o, "prefill", "computed_remote");
    snprintf(r.tier, sizeof r.tier, "%s", jstr(o, "prefill", "cache_tier"));
    json_decref(o);
    return r;
}

static int same_out(const gen_res *r, const int32_t *ref) {
    return r->status == 200 && r->n_out == N_PRED && !memcmp(r->out, ref, sizeof(int32_t) * N_PRED);
}

static double disk_blocks(int port) {
    return metric_value(port, "tandem_decode_kv_store_blocks{model=\"" MODEL_LABEL "\",tier=\"disk\"} ");
}

/* Waits until the node has at least `want` blocks on disk. */
static int wait_disk_blocks(int port, int want) {
    double t0 = now_ms();
    while (now_ms() - t0 < 20000) {
        if (disk_blocks(port) >= want) return 1;
        sleep_ms(50);
    }
    return 0;
}

/* The model subdirectory's block files (names into out, sorted). */
static int list_blocks(const char *sub, char out[][32], int cap) {
    DIR *d = opendir(sub);
    int n = 0;
    struct dirent *e;
    while (d && (e = readdir(d)))
        if (strlen(e->d_name) == 20 && !strcmp(e->d_name + 16, ".kvb") && n < cap) snprintf(out[n++], 32, "%s", e->d_name);
    if (d) closedir(d);
    for (int i = 1; i < n; i++)
        for (int j = i; j > 0 && strcmp(out[j - 1], out[j]) > 0; j--) {
            char t[32];
            memcpy(t, out[j], 32); memcpy(out[j], out[j - 1], 32); memcpy(out[j - 1], t, 32);
        }
    return n;
}

/* The store's subdirectory for a dtype (the only one starting with the
 * fingerprint and ending in -dtype). */
static int find_sub(const char *store, const char *dtype, char *out, size_t cap) {
    DIR *d = opendir(store);
    struct dirent *e;
    int found = 0;
    while (d && (e = readdir(d))) {
        size_t l = strlen(e->d_name), dl = strlen(dtype);
        if (l == 17 + dl && e->d_name[16] == '-' && !strcmp(e->d_name + 17, dtype)) {
            snprintf(out, cap, "%s/%s", store, e->d_name);
            found = 1;
        }
    }
    if (d) closedir(d);
    return found;
}

/* The block index a file holds (header offset 60) when its first token id
 * (offset 128) is first, else -1. */
static int block_index(const char *path, int32_t first) {
    FILE *f = fopen(path, "rb");
    uint8_t h[132];
    int ok = f && fread(h, 1, 132, f) == 132;
    if (f) fclose(f);
    uint32_t i;
    int32_t id0;
    memcpy(&i, h + 60, 4);
    memcpy(&id0, h + 128, 4);
    return ok && id0 == first ? (int)i : -1;
}

/* The path of the file holding block `index` of the test prompt (first id
 * 1000) in sub, or "". */
static void block_path(const char *sub, int index, char *out, size_t cap) {
    char names[64][32];
    int n = list_blocks(sub, names, 64);
    out[0] = 0;
    for (int i = 0; i < n; i++) {
        char p[700];
        if (strlen(sub) > 600) return;
        snprintf(p, sizeof p, "%.600s/%.31s", sub, names[i]);
        if (block_index(p, 1000) == index) { snprintf(out, cap, "%s", p); return; }
    }
}

static void rm_tree(const char *path) {
    char cmd[700];
    snprintf(cmd, sizeof cmd, "rm -rf '%s'", path);
    if (system(cmd)) {}
}

static int log_has(ctx *c, const char *name, const char *what) {
    char p[512];
    snprintf(p, sizeof p, "%s/%s.log", c->dir, name);
    return wait_file_has(p, what, 3000);
}

/* ==== Tests ==== */

static const char *const STORE_OPTS[] = { "--kv-cache-ram", "64000000", "--kv-cache-dir", NULL, NULL };

static void opts_with_dir(const char **o, const char *dir) {
    for (int i = 0; i < 4; i++) o[i] = STORE_OPTS[i];
    o[3] = dir;
    o[4] = NULL;
}

/* Cold, memory, restart (SIGTERM), kill -9: output and computed positions. */
/* The node's prefix report (GET /v1/stats "prefix", prefix_report.h): how
 * many of ids' block hashes its tier `tier` lists, -1 without a report. */
static int report_has(int port, const char *tier, const int32_t *ids, int n) {
    char *body = NULL;
    int st = http(port, "GET", "/v1/stats", NULL, &body);
    json_t *o = st == 200 && body ? json_loads(body, 0, NULL) : NULL;
    free(body);
    json_t *p = json_object_get(o, "prefix"), *list = json_object_get(json_object_get(p, "tiers"), tier);
    const char *seed_hex = json_string_value(json_object_get(p, "seed"));
    int found = -1;
    if (json_is_array(list) && seed_hex) {
        uint64_t seed = strtoull(seed_hex, NULL, 16), h[16];
        int nb = prefix_hash_blocks(ids, n, PREFIX_HASH_BLOCK, seed, h, 16);
        found = 0;
        for (int b = 0; b < nb; b++) {
            char hex[17];
            snprintf(hex, sizeof hex, "%016llx", (unsigned long long)h[b]);
            for (size_t i = 0; i < json_array_size(list); i++)
                if (!strcmp(json_string_value(json_array_get(list, i)) ? json_string_value(json_array_get(list, i)) : "", hex)) {
                    found++;
                    break;
                }
        }
    }
    json_decref(o);
    return found;
}

static void test_tiers(ctx *c) {
    const char *o[8];
    opts_with_dir(o, c->store);
    pid_t pid;
    int port = start_node(c, &pid, "tiers", "local", o);
    if (port <= 0) return;
    gen_res r = gen(port, c->prompt, PROMPT_N, NULL);
    CHECK(r.status == 200 && r.n_out == N_PRED && r.computed == PROMPT_N && r.cached == 0,
          "cold: status %d, %d tokens, computed %d cached %d", r.status, r.n_out, r.computed, r.cached);
    memcpy(c->ref, r.out, sizeof c->ref);
    /* another prompt takes the only slot; the first comes back from memory */
    gen_res x = gen(port, c->other, PROMPT_N, NULL);
    CHECK(x.status == 200 && x.cached == 0 && x.n_out == N_PRED, "other prompt: status %d cached %d", x.status, x.cached);
    memcpy(c->ref_other, x.out, sizeof c->ref_other);
    r = gen(port, c->prompt, PROMPT_N, NULL);
    CHECK(same_out(&r, c->ref), "from memory: the same tokens as cold");
    CHECK(r.cached == 256 && r.computed == PROMPT_N - 256 && !strcmp(r.tier, "ram"),
          "from memory: cached %d (want 256), computed %d (want %d), tier %s", r.cached, r.computed, PROMPT_N - 256, r.tier);
    CHECK(log_has(c, "tiers", "tier=ram store_ram=256 store_disk=0"), "the log line names the memory tier");
    CHECK(metric_value(port, "tandem_decode_kv_store_hits_total{model=\"" MODEL_LABEL "\",tier=\"ram\"} ") >= 4,
          "/metrics counts memory hits");
    CHECK(wait_disk_blocks(port, 8), "both prompts' 8 blocks reach the disk");
    CHECK(stop_proc(pid, 20000) == 0, "SIGTERM: clean exit");

    /* restart: the disk tier */
    port = start_node(c, &pid, "tiers", "local", o);
    if (port <= 0) return;
    CHECK(log_has(c, "tiers", "holds 8 block(s)"), "restart indexes the 8 blocks on disk");
    /* what the router is told (cache-aware routing): the stored blocks */
    int held = report_has(port, "store", c->prompt, PROMPT_N);
    CHECK(held == 4, "the prefix report's \"store\" tier lists the prompt's 4 stored blocks (%d)", held);
    r = gen(port, c->prompt, PROMPT_N, NULL);
    CHECK(same_out(&r, c->ref), "after a restart: the same tokens as cold");
    CHECK(r.cached == 256 && r.computed == PROMPT_N - 256 && !strcmp(r.tier, "disk"),
          "after a restart: cached %d computed %d tier %s", r.cached, r.computed, r.tier);
    CHECK(metric_value(port, "tandem_decode_kv_store_hits_total{model=\"" MODEL_LABEL "\",tier=\"disk\"} ") == 4,
          "/metrics: 4 disk hits");
    CHECK(metric_value(port, "tandem_decode_kv_store_read_bytes_total{model=\"" MODEL_LABEL "\",tier=\"disk\"} ") > 0,
          "/metrics: disk bytes read");
    /* a longer prompt sharing the first 200 tokens of the other one: 3 blocks */
    int32_t mix[PROMPT_N];
    memcpy(mix, c->other, sizeof mix);
    for (int i = 200; i < PROMPT_N; i++) mix[i] = c->prompt[i];
    gen_res m = gen(port, mix, PROMPT_N, NULL);
    CHECK(m.status == 200 && m.cached == 192 && m.computed == PROMPT_N - 192,
          "a prompt sharing 200 tokens with a stored one: cached %d (want 192), computed %d", m.cached, m.computed);
    kill(pid, SIGKILL);
    wait_exit(pid, 5000);

    /* kill -9, restart, n = 2 (two slots) */
    const char *o2[] = { o[0], o[1], o[2], o[3], "--parallel", "2", NULL };
    port = start_node(c, &pid, "tiers", "local", o2);
    if (port <= 0) return;
    json_t *req = gen_req(c->prompt, PROMPT_N, N_PRED, 1, NULL);
    json_object_set_new(req, "n", json_integer(2));
    char *s = json_dumps(req, JSON_COMPACT), *body = NULL;
    json_decref(req);
    int st = http(port, "POST", "/v1/generate", s, &body);
    free(s);
    int32_t got[2][N_PRED];
    int ng[2] = {0, 0}, cached[2] = {-1, -1};
    for (char *save = NULL, *l = body ? strtok_r(body, "\n", &save) : NULL; l; l = strtok_r(NULL, "\n", &save)) {
        json_t *lo = json_loads(l, 0, NULL);
        int i = (int)jint(lo, "index", NULL);
        if (i >= 0 && i < 2) {
            if (json_is_integer(json_object_get(lo, "token")) && ng[i] < N_PRED) got[i][ng[i]++] = (int32_t)jint(lo, "token", NULL);
            if (json_is_true(json_object_get(lo, "done")))
                cached[i] = (int)jint(json_object_get(lo, "usage"), "prompt_tokens_details", "cached_tokens");
        }
        json_decref(lo);
    }
    free(body);
    CHECK(st == 200 && ng[0] == N_PRED && ng[1] == N_PRED && !memcmp(got[0], c->ref, sizeof c->ref) &&
          !memcmp(got[1], c->ref, sizeof c->ref), "n = 2 after kill -9: both choices equal the cold run");
    CHECK(cached[0] == 256 && cached[1] >= 256, "n = 2: cached %d and %d (want 256, >= 256)", cached[0], cached[1]);
    CHECK(stop_proc(pid, 20000) == 0, "SIGTERM: clean exit");
}

/* The OpenAI usage through a router: prompt_tokens_details.cached_tokens,
 * not streamed and streamed (the decode node's slot now holds the prompt). */
static void test_router_usage(ctx *c, int dport, const char *secret) {
    const node_auth_key *keep = sign_key;
    sign_key = NULL;
    char pf[512], dn[64];
    snprintf(pf, sizeof pf, "%s/router.port", c->dir);
    snprintf(dn, sizeof dn, "qwen=127.0.0.1:%d", dport);
    char *argv[] = { (char *)bin(), "serve", "--role", "router", "--listen", "127.0.0.1:0", "--secret-file",
                     (char *)secret, "--decode", dn, "--split", "never", "--port-file", pf, NULL };
    pid_t rpid;
    int rport = start_named(&rpid, argv, c->dir, "router", 1, 30000);
    if (rport > 0) {
        json_t *req = json_object();
        json_object_set_new(req, "model", json_string("qwen"));
        json_object_set_new(req, "prompt", ids_json(c->prompt, PROMPT_N));
        json_object_set_new(req, "max_tokens", json_integer(N_PRED));
        json_object_set_new(req, "temperature", json_integer(0));
        char *s = json_dumps(req, JSON_COMPACT), *body = NULL;
        double t0 = now_ms();
        int st = 0;
        do {   /* until the router's first health check has seen the node */
            free(body);
            body = NULL;
            st = http(rport, "POST", "/v1/completions", s, &body);
        } while (st != 200 && now_ms() - t0 < 10000 && (sleep_ms(100), 1));
        json_t *o = body ? json_loads(body, 0, NULL) : NULL;
        json_t *u = json_object_get(o, "usage");
        CHECK(st == 200 && jint(u, "prompt_tokens", NULL) == PROMPT_N &&
              jint(u, "prompt_tokens_details", "cached_tokens") == 299,
              "router, not streamed: usage %s", body ? body : "(none)");
        json_decref(o);
        free(body);
        free(s);
        json_object_set_new(req, "stream", json_true());
        json_object_set_new(req, "stream_options", json_pack("{s:b}", "include_usage", 1));
        s = json_dumps(req, JSON_COMPACT);
        body = NULL;
        st = http(rport, "POST", "/v1/completions", s, &body);
        const char *us = body ? strstr(body, "\"usage\":{") : NULL;
        CHECK(st == 200 && us && strstr(us, "\"prompt_tokens_details\":{\"cached_tokens\":299}"),
              "router, streamed: the usage chunk says 299 cached tokens: %s", us ? us : "(no usage)");
        free(body);
        free(s);
        json_decref(req);
        CHECK(stop_proc(rpid, 20000) == 0, "router: clean exit");
    }
    sign_key = keep;
}

/* Through a prefill node: the restarted decode node asks it only for the rest. */
static void test_split(ctx *c) {
    char secret[512];
    snprintf(secret, sizeof secret, "%s/secret", c->dir);
    static const char sec[] = "07dd8847812bf517ed04695d2fb21a2bc3d60a681b62c605d5cb782eeb719423";   /* 32 random bytes in hex */
    write_text(secret, sec);
    chmod(secret, 0600);
    static node_auth_key key;
    node_auth_derive(&key, sec, strlen(sec), NODE_AUTH_LABEL_DECODE_API);
    sign_key = &key;
    char pf[512];
    snprintf(pf, sizeof pf, "%s/prefill.port", c->dir);
    char pstore[400];
    snprintf(pstore, sizeof pstore, "%s/pstore", c->dir);
    char *pargv[] = { (char *)bin(), "serve", "--role", "prefill", "-m", c->model, "--listen", "127.0.0.1:0",
                      "--port-file", pf, "--secret-file", secret, "--kv-cache-ram", "64000000", "--kv-cache-dir",
                      pstore, NULL };
    pid_t ppid;
    int pport = start_named(&ppid, pargv, c->dir, "prefill", 1, 60000);
    if (pport <= 0) return;
    char addr[64], sdir[400];
    snprintf(addr, sizeof addr, "127.0.0.1:%d", pport);
    snprintf(sdir, sizeof sdir, "%s/split", c->dir);
    const char *o[] = { "--kv-cache-ram", "64000000", "--kv-cache-dir", sdir, "--prefill-node", addr,
                        "--secret-file", secret, NULL };
    pid_t pid;
    int port = start_node(c, &pid, "split", "decode", o);
    if (port <= 0) { stop_proc(ppid, 10000); return; }
    gen_res r = gen(port, c->prompt, PROMPT_N, "remote");
    CHECK(same_out(&r, c->ref) && r.received == PROMPT_N - 1 && r.remote == PROMPT_N - 1,
          "split, cold: the same tokens, %d positions received, %d computed remotely (want %d)", r.received, r.remote,
          PROMPT_N - 1);
    CHECK(wait_disk_blocks(port, 4), "split: 4 blocks on disk");
    CHECK(stop_proc(pid, 20000) == 0, "SIGTERM: clean exit");
    port = start_node(c, &pid, "split", "decode", o);
    if (port > 0) {
        r = gen(port, c->prompt, PROMPT_N, "remote");
        CHECK(same_out(&r, c->ref), "split after a restart: the same tokens as cold");
        CHECK(r.cached == 256 && r.received == PROMPT_N - 1 - 256 && !strcmp(r.tier, "disk"),
              "split after a restart: cached %d, received %d (want %d), tier %s", r.cached, r.received,
              PROMPT_N - 1 - 256, r.tier);
        /* the prefill node's own store: a new connection (empty session)
         * loads the first 256 positions instead of computing them */
        CHECK(r.remote == PROMPT_N - 1 - 256, "the prefill node computed %d positions (want %d: its store held 256)",
              r.remote, PROMPT_N - 1 - 256);
        test_router_usage(c, port, secret);
        CHECK(stop_proc(pid, 20000) == 0, "SIGTERM: clean exit");
    }
    CHECK(stop_proc(ppid, 20000) == 0, "prefill node: clean exit");
    sign_key = NULL;
}

/* Rewrites a block's fingerprint byte and fixes its checksum (as a block
 * another model wrote would be: valid in itself). */
static int refingerprint(const char *path) {
    char *d = NULL;
    FILE *f = fopen(path, "rb");
    long n = 0;
    if (f && !fseek(f, 0, SEEK_END) && (n = ftell(f)) > 128 && !fseek(f, 0, SEEK_SET) && (d = malloc((size_t)n)) &&
        fread(d, 1, (size_t)n, f) == (size_t)n) {
        fclose(f);
        d[16] ^= 0x5a;
        uint64_t h = XXH3_64bits(d, 88), sum = XXH3_64bits_withSeed(d + 128, (size_t)n - 128, h);
        memcpy(d + 88, &sum, 8);
        f = fopen(path, "wb");
        int ok = f && fwrite(d, 1, (size_t)n, f) == (size_t)n;
        if (f) fclose(f);
        free(d);
        return ok;
    }
    if (f) fclose(f);
    free(d);
    return 0;
}

/* Corrupted, truncated, other-dtype and other-model blocks. */
static void test_bad_blocks(ctx *c) {
    char sub[600];
    if (!find_sub(c->store, "f16", sub, sizeof sub)) { CHECK(0, "f16 subdirectory in %s", c->store); return; }
    /* a real bf16 node's block of the same prompt */
    const char *ob[] = { "--kv-cache-dir", c->store, "--kv-type", "bf16", NULL };
    pid_t pid;
    int port = start_node(c, &pid, "bf16", "local", ob);
    if (port <= 0) return;
    gen_res r = gen(port, c->prompt, PROMPT_N, NULL);
    CHECK(r.status == 200, "bf16 node answers");
    CHECK(wait_disk_blocks(port, 4), "bf16 node: 4 blocks on disk");
    CHECK(stop_proc(pid, 20000) == 0, "bf16 node: clean exit");
    char bsub[600], b0[700], f0[700], f1[700], f2[700], f3[700];
    char cp[1500];
    CHECK(find_sub(c->store, "bf16", bsub, sizeof bsub), "bf16 subdirectory");
    block_path(bsub, 0, b0, sizeof b0);
    block_path(sub, 0, f0, sizeof f0);
    block_path(sub, 1, f1, sizeof f1);
    block_path(sub, 2, f2, sizeof f2);
    block_path(sub, 3, f3, sizeof f3);
    CHECK(b0[0] && f0[0] && f1[0] && f2[0] && f3[0], "blocks 0-3 of the prompt on disk");
    if (t_fail) return;

    /* block 3 corrupted in the middle of its rows: found at load */
    int fd = open(f3, O_RDWR);
    struct stat sb;
    fstat(fd, &sb);
    unsigned char x;
    if (pread(fd, &x, 1, sb.st_size / 2) == 1) { x ^= 0xff; if (pwrite(fd, &x, 1, sb.st_size / 2) != 1) {} }
    close(fd);
    const char *o[8];
    opts_with_dir(o, c->store);
    port = start_node(c, &pid, "bad", "local", o);
    if (port <= 0) return;
    r = gen(port, c->prompt, PROMPT_N, NULL);
    CHECK(same_out(&r, c->ref), "with block 3 corrupted: the same tokens as cold");
    CHECK(r.cached == 192 && r.computed == PROMPT_N - 192, "block 3 corrupted: cached %d (want 192) computed %d",
          r.cached, r.computed);
    CHECK(log_has(c, "bad", "refused and deleted: checksum mismatch"), "the corrupted block is logged");
    CHECK(wait_disk_blocks(port, 4), "block 3 rewritten from the fresh computation");
    CHECK(stop_proc(pid, 20000) == 0, "clean exit");

    /* block 2 truncated, block 1 replaced by the bf16 file, block 0 by another model's */
    block_path(sub, 2, f2, sizeof f2);
    block_path(sub, 1, f1, sizeof f1);
    block_path(sub, 0, f0, sizeof f0);
    CHECK(truncate(f2, 1000) == 0, "truncate block 2");
    snprintf(cp, sizeof cp, "cp '%s' '%s'", b0, f1);
    CHECK(system(cp) == 0, "bf16 block over block 1");
    CHECK(refingerprint(f0), "block 0 rewritten as another model's");
    port = start_node(c, &pid, "bad2", "local", o);
    if (port <= 0) return;
    CHECK(log_has(c, "bad2", "written for another model"), "another model's block refused with a log line");
    CHECK(log_has(c, "bad2", "KV dtype bf16"), "a bf16 block refused with a log line");
    CHECK(log_has(c, "bad2", "(truncated)"), "a truncated block refused with a log line");
    CHECK(access(f0, F_OK) && access(f2, F_OK), "refused blocks deleted");
    r = gen(port, c->prompt, PROMPT_N, NULL);
    CHECK(same_out(&r, c->ref), "with bad blocks 0-2: the same tokens as cold");
    CHECK(r.cached == 0 && r.computed == PROMPT_N, "bad blocks 0-2: cached %d computed %d", r.cached, r.computed);
    CHECK(stop_proc(pid, 20000) == 0, "clean exit");
}

/* Writes that fail half way under a file-size limit (RLIMIT_FSIZE): the
 * stand-in for a full disk where no tmpfs can be mounted (test_disk_full). */
static void test_fsize_limit(ctx *c) {
    char sdir[400], sub[600], pf[512], lg[512];
    snprintf(sdir, sizeof sdir, "%s/fsize", c->dir);
    /* block 1 fits, block 2 (256 more bytes of ids) does not: find the sizes from the main store */
    char msub[600], m1[700];
    if (!find_sub(c->store, "f16", msub, sizeof msub)) return;
    block_path(msub, 1, m1, sizeof m1);
    struct stat sb;
    if (!m1[0] || stat(m1, &sb)) { CHECK(0, "block 1 in the main store"); return; }
    snprintf(pf, sizeof pf, "%s/fsize.port", c->dir);
    snprintf(lg, sizeof lg, "%s/fsize.log", c->dir);
    unlink(pf);
    pid_t pid = fork();
    if (pid == 0) {
        struct rlimit rl = { (rlim_t)sb.st_size + 64, (rlim_t)sb.st_size + 64 };
        setrlimit(RLIMIT_FSIZE, &rl);
        int lfd = open(lg, O_WRONLY | O_CREAT | O_TRUNC, 0600);
        dup2(lfd, 1);
        dup2(lfd, 2);
        execl(bin(), bin(), "serve", "--role", "local", "-m", c->model, "--listen", "127.0.0.1:0", "--port-file", pf,
              "--parallel", "1", "-c", "512", "--kv-cache-dir", sdir, (char *)NULL);
        _exit(127);
    }
    int port = wait_port(pf, pid, 60000);
    CHECK(port > 0, "node under a file-size limit started (%s)", lg);
    if (port <= 0) return;
    gen_res r = gen(port, c->prompt, PROMPT_N, NULL);
    CHECK(same_out(&r, c->ref), "under a file-size limit: the same tokens as cold");
    CHECK(wait_disk_blocks(port, 2), "blocks 0 and 1 written");
    double t0 = now_ms();
    while (now_ms() - t0 < 10000 &&
           metric_value(port, "tandem_decode_kv_store_write_errors_total{model=\"" MODEL_LABEL "\"} ") < 2) sleep_ms(50);
    CHECK(metric_value(port, "tandem_decode_kv_store_write_errors_total{model=\"" MODEL_LABEL "\"} ") == 2,
          "blocks 2 and 3 failed to write (counted)");
    CHECK(wait_file_has(lg, "cannot write block", 3000), "the failed write is logged");
    CHECK(find_sub(sdir, "f16", sub, sizeof sub), "subdirectory");
    char names[16][32];
    int n = list_blocks(sub, names, 16);
    DIR *d = opendir(sub);
    int tmp = 0;
    struct dirent *e;
    while (d && (e = readdir(d))) tmp += !strncmp(e->d_name, ".tmp-", 5);
    if (d) closedir(d);
    CHECK(n == 2 && tmp == 0, "2 whole blocks and no temporary file left (got %d blocks, %d temporaries)", n, tmp);
    CHECK(stop_proc(pid, 20000) == 0, "clean exit");
}

/* A directory that disappears under a running node. */
static void test_dir_gone(ctx *c) {
    char sdir[400];
    snprintf(sdir, sizeof sdir, "%s/gone", c->dir);
    const char *o[8];
    opts_with_dir(o, sdir);
    pid_t pid;
    int port = start_node(c, &pid, "gone", "local", o);
    gen_res r;
    if (port <= 0) return;
    rm_tree(sdir);
    r = gen(port, c->other, PROMPT_N, NULL);
    CHECK(r.status == 200, "a request after the directory went away succeeds");
    r = gen(port, c->prompt, PROMPT_N, NULL);
    CHECK(same_out(&r, c->ref), "directory gone: the same tokens as cold");
    CHECK(log_has(c, "gone", "cannot write block"), "directory gone: failed writes logged");
    CHECK(stop_proc(pid, 20000) == 0, "directory gone: clean exit");
}

/* Two nodes on one directory; unsafe directories refused. */
static void test_shared_and_unsafe(ctx *c) {
    char sdir[400];
    snprintf(sdir, sizeof sdir, "%s/shared", c->dir);
    const char *o[8];
    opts_with_dir(o, sdir);
    pid_t pa, pb;
    int a = start_node(c, &pa, "share-a", "local", o);
    int b = start_node(c, &pb, "share-b", "local", o);
    if (a > 0 && b > 0) {
        gen_res r = gen(a, c->prompt, PROMPT_N, NULL);
        CHECK(same_out(&r, c->ref), "shared dir, node a: the same tokens as cold");
        CHECK(wait_disk_blocks(a, 4), "node a wrote 4 blocks");
        r = gen(b, c->prompt, PROMPT_N, NULL);
        CHECK(same_out(&r, c->ref) && r.cached == 256 && !strcmp(r.tier, "disk"),
              "shared dir, node b finds node a's blocks: cached %d tier %s", r.cached, r.tier);
        /* both write the other prompt's blocks at once */
        gen_res x = gen(a, c->other, PROMPT_N, NULL), y = gen(b, c->other, PROMPT_N, NULL);
        CHECK(x.status == 200 && y.status == 200 && x.n_out == N_PRED && !memcmp(x.out, y.out, sizeof x.out),
              "both nodes answer the same");
    }
    CHECK(stop_proc(pa, 20000) == 0 && stop_proc(pb, 20000) == 0, "shared dir: clean exits");

    /* unsafe directories */
    char bad[400], link[400], pf[512];
    snprintf(bad, sizeof bad, "%s/open", c->dir);
    mkdir(bad, 0700);
    chmod(bad, 0777);
    snprintf(link, sizeof link, "%s/link", c->dir);
    if (symlink(sdir, link)) {}
    const char *dirs[2] = { bad, link };
    const char *want[2] = { "writable by others", "symbolic link" };
    for (int i = 0; i < 2; i++) {
        snprintf(pf, sizeof pf, "%s/unsafe.port", c->dir);
        char lg[512];
        snprintf(lg, sizeof lg, "%s/unsafe%d.log", c->dir, i);
        char *argv[] = { (char *)bin(), "serve", "--role", "local", "-m", c->model, "--listen", "127.0.0.1:0",
                         "--port-file", pf, "--kv-cache-dir", (char *)dirs[i], NULL };
        pid_t p = spawn_log(argv, lg, 1);
        int st = wait_exit(p, 30000);
        CHECK(st == 1, "--kv-cache-dir %s refused (exit %d)", dirs[i], st);
        CHECK(wait_file_has(lg, want[i], 1000), "the refusal says '%s' (%s)", want[i], lg);
    }
}

/* tandem cache save on one node, load on another sharing the directory;
 * unsigned requests refused. */
static void test_save_load(ctx *c) {
    char secret[512], sdir[400], pfile[512];
    snprintf(secret, sizeof secret, "%s/secret", c->dir);
    snprintf(sdir, sizeof sdir, "%s/saved", c->dir);
    snprintf(pfile, sizeof pfile, "%s/rubric.txt", c->dir);
    strbuf rubric = { 0 };
    for (int i = 0; i < 12; i++)
        strbuf_printf(&rubric, "Criterion %d: the program reads its input, checks every value and explains each step. ", i);
    write_text(pfile, rubric.p);
    int32_t ref[N_PRED];
    CHECK(run_ids(c->model, rubric.p, 0, N_PRED, ref, N_PRED) == N_PRED, "tandem run on the rubric");
    const char *o[] = { "--kv-cache-ram", "64000000", "--kv-cache-dir", sdir, "--secret-file", secret, NULL };
    pid_t pa, pb;
    int a = start_node(c, &pa, "save", "local", o);
    if (a <= 0) { free(rubric.p); return; }
    char *bad = NULL;
    CHECK(http(a, "POST", "/v1/cache/save", "{\"prompt\":\"x\"}", &bad) == 401, "unsigned /v1/cache/save: 401");
    free(bad);
    char node[64];
    snprintf(node, sizeof node, "127.0.0.1:%d", a);
    char *argv[] = { (char *)bin(), "cache", "save", "--node", node, "-f", pfile, "--secret-file", secret, NULL };
    char *out = run_capture(argv);
    json_t *j = out ? json_loads(out, 0, NULL) : NULL;
    int np = (int)jint(j, "prompt_tokens", NULL), stored = (int)jint(j, "stored_tokens", NULL);
    CHECK(j && np > 128 && stored == np / 64 * 64, "tandem cache save: %s", out ? out : "(failed)");
    json_decref(j);
    free(out);
    CHECK(stop_proc(pa, 20000) == 0, "save node: clean exit");
    int b = start_node(c, &pb, "load", "local", o);
    if (b > 0) {
        snprintf(node, sizeof node, "127.0.0.1:%d", b);
        char *argl[] = { (char *)bin(), "cache", "load", "--node", node, "-f", pfile, "--secret-file", secret, NULL };
        out = run_capture(argl);
        j = out ? json_loads(out, 0, NULL) : NULL;
        CHECK(j && jint(j, "stored_tokens", NULL) == stored && !strcmp(jstr(j, "tier", NULL), "ram"),
              "tandem cache load: %s", out ? out : "(failed)");
        json_decref(j);
        free(out);
        static node_auth_key key;
        char sec[128] = "";
        FILE *f = fopen(secret, "r");
        if (f) { if (!fgets(sec, sizeof sec, f)) sec[0] = 0; fclose(f); }
        node_auth_derive(&key, sec, strlen(sec), NODE_AUTH_LABEL_DECODE_API);
        sign_key = &key;
        json_t *req = json_pack("{s:s, s:i, s:b}", "prompt", rubric.p, "max_tokens", N_PRED, "ignore_eos", 1);
        int st;
        json_t *r = post_json(b, req, &st);
        CHECK(st == 200 && same_ids(json_object_get(r, "tokens"), ref, N_PRED), "after a load: the same tokens as tandem run");
        CHECK(jint(json_object_get(r, "usage"), "prompt_tokens_details", "cached_tokens") == stored &&
              !strcmp(jstr(r, "prefill", "cache_tier"), "ram"), "after a load: %d cached from memory (want %d)",
              (int)jint(json_object_get(r, "usage"), "prompt_tokens_details", "cached_tokens"), stored);
        json_decref(r);
        sign_key = NULL;
        CHECK(stop_proc(pb, 20000) == 0, "load node: clean exit");
    }
    free(rubric.p);
}

/* ==== A full disk ==== */

/* Moves this process into a new mount namespace (and, when not root, a
 * user namespace that maps this user to root) and mounts a tmpfs of
 * `bytes` at path, so that the nodes it starts share that small disk. 0,
 * or -1 with the reason (no namespaces here: a container, a kernel that
 * forbids them, not Linux). */
static int tmpfs_mount(const char *path, size_t bytes, char *why, size_t whylen) {
#ifdef __linux__
    if (geteuid() != 0) {
        char map[64];
        snprintf(map, sizeof map, "0 %u 1", (unsigned)geteuid());
        char gmap[64];
        snprintf(gmap, sizeof gmap, "0 %u 1", (unsigned)getegid());
        if (unshare(CLONE_NEWUSER | CLONE_NEWNS)) { snprintf(why, whylen, "unshare(user, mount): %s", strerror(errno)); return -1; }
        write_text("/proc/self/setgroups", "deny");
        write_text("/proc/self/uid_map", map);
        write_text("/proc/self/gid_map", gmap);
        if (geteuid() != 0) { snprintf(why, whylen, "cannot map this user to root in a user namespace"); return -1; }
    } else if (unshare(CLONE_NEWNS)) {
        snprintf(why, whylen, "unshare(mount): %s", strerror(errno));
        return -1;
    }
    /* nothing mounted here may reach the machine's own mount table */
    if (mount(NULL, "/", NULL, MS_REC | MS_PRIVATE, NULL)) { snprintf(why, whylen, "private mounts: %s", strerror(errno)); return -1; }
    char opt[64];
    snprintf(opt, sizeof opt, "size=%zu,mode=0700", bytes);
    if (mkdir(path, 0700) && errno != EEXIST) { snprintf(why, whylen, "mkdir %s: %s", path, strerror(errno)); return -1; }
    if (mount("tandem-test-full", path, "tmpfs", MS_NOSUID | MS_NODEV, opt)) {
        snprintf(why, whylen, "mount -t tmpfs -o %s %s: %s", opt, path, strerror(errno));
        return -1;
    }
    return 0;
#else
    (void)path; (void)bytes;
    snprintf(why, whylen, "mount namespaces are Linux's");
    return -1;
#endif
}

/* The temporaries (".tmp-*") in a directory. */
static int count_tmp(const char *sub) {
    DIR *d = opendir(sub);
    int n = 0;
    struct dirent *e;
    while (d && (e = readdir(d))) n += !strncmp(e->d_name, ".tmp-", 5);
    if (d) closedir(d);
    return n;
}

/* A node whose --kv-cache-dir is a tmpfs with room for blocks 0 and 1 of
 * the prompt and half of block 2: the disk fills while block 2 is written.
 * No half block is left under a block's name nor as a temporary, the failed
 * writes are counted in /metrics and logged, the node goes on answering the
 * same tokens, and after a restart the two whole blocks load. Where no
 * namespace can be made, a named skip ("tmpfs") and the file-size-limit
 * stand-in (test_fsize_limit). */
static void test_disk_full(ctx *c) {
    char msub[600], m[3][700], mnt[400], sub[600];
    struct stat sb[3];
    if (!find_sub(c->store, "f16", msub, sizeof msub)) { CHECK(0, "f16 subdirectory of the main store"); return; }
    for (int i = 0; i < 3; i++) {
        block_path(msub, i, m[i], sizeof m[i]);
        if (!m[i][0] || stat(m[i], &sb[i])) { CHECK(0, "block %d in the main store", i); return; }
    }
    /* tmpfs counts whole pages per file */
    size_t page = (size_t)sysconf(_SC_PAGESIZE), two = 0;
    for (int i = 0; i < 2; i++) two += ((size_t)sb[i].st_size + page - 1) / page * page;
    size_t size = two + (size_t)sb[2].st_size / 2 / page * page;
    snprintf(mnt, sizeof mnt, "%s/full", c->dir);
    char why[512];
    if (tmpfs_mount(mnt, size, why, sizeof why)) {
        t_skip_what("tmpfs", "no small tmpfs for a full disk (%s); a file-size limit stands in", why);
        test_fsize_limit(c);
        return;
    }
    const char *o[] = { "--kv-cache-dir", mnt, NULL };
    pid_t pid;
    int port = start_node(c, &pid, "full", "local", o);
    if (port > 0) {
        gen_res r = gen(port, c->prompt, PROMPT_N, NULL);
        CHECK(same_out(&r, c->ref), "disk filling: the same tokens as cold");
        const char *we = "tandem_decode_kv_store_write_errors_total{model=\"" MODEL_LABEL "\"} ";
        double t0 = now_ms();
        while (now_ms() - t0 < 10000 && metric_value(port, we) < 2) sleep_ms(50);
        CHECK(metric_value(port, we) == 2, "blocks 2 and 3 failed to write, counted in /metrics (%g)", metric_value(port, we));
        CHECK(disk_blocks(port) == 2, "the store indexes the 2 blocks written (%g)", disk_blocks(port));
        CHECK(log_has(c, "full", "No space left on device"), "the failed write is logged with its cause");
        CHECK(find_sub(mnt, "f16", sub, sizeof sub), "subdirectory on the tmpfs");
        char names[16][32];
        int n = list_blocks(sub, names, 16), whole = 0;
        for (int i = 0; i < n; i++) {
            char p[700];
            struct stat bs;
            snprintf(p, sizeof p, "%.600s/%.31s", sub, names[i]);
            int idx = block_index(p, 1000);
            whole += idx >= 0 && idx < 2 && !stat(p, &bs) && bs.st_size == sb[idx].st_size;
        }
        CHECK(n == 2 && whole == 2 && count_tmp(sub) == 0,
              "a full disk leaves blocks 0 and 1 whole (%d files, %d whole) and no temporary file (%d)", n, whole,
              count_tmp(sub));
        /* the node goes on: another prompt (its writes fail too), then the first again from the disk tier */
        gen_res x = gen(port, c->other, PROMPT_N, NULL);
        CHECK(same_out(&x, c->ref_other), "disk full: another prompt answers as it did before");
        r = gen(port, c->prompt, PROMPT_N, NULL);
        CHECK(same_out(&r, c->ref) && r.cached == 128 && !strcmp(r.tier, "disk"),
              "disk full: the prompt again, 128 positions from disk (cached %d, tier %s)", r.cached, r.tier);
        CHECK(stop_proc(pid, 20000) == 0, "disk full: clean exit");
    }
    /* a restart on the full disk: the two whole blocks load */
    port = start_node(c, &pid, "full2", "local", o);
    if (port > 0) {
        CHECK(log_has(c, "full2", "holds 2 block(s)"), "restart on the full disk indexes its 2 blocks");
        gen_res r = gen(port, c->prompt, PROMPT_N, NULL);
        CHECK(same_out(&r, c->ref) && r.cached == 128 && r.computed == PROMPT_N - 128 && !strcmp(r.tier, "disk"),
              "after a restart on the full disk: the same tokens, cached %d (want 128) computed %d, tier %s", r.cached,
              r.computed, r.tier);
        char lg[512];
        snprintf(lg, sizeof lg, "%s/full2.log", c->dir);
        char *text = read_text(lg);
        CHECK(text && !strstr(text, "refused"), "no block refused after the restart");
        free(text);
        CHECK(stop_proc(pid, 20000) == 0, "restart on the full disk: clean exit");
    }
#ifdef __linux__
    umount2(mnt, MNT_DETACH);
#endif
}

int main(void) {
    signal(SIGPIPE, SIG_IGN);
    unsetenv("TANDEM_LOG_LEVEL");
    unsetenv("TANDEM_SECRET");
    static ctx c;
    snprintf(c.model, sizeof c.model, "%s/qwen3-mini-F16.gguf", t_models());
    const char *need[] = { c.model, NULL };
    if (!t_need_all(need)) return t_done("test_kvstore");
    CHECK(access(bin(), X_OK) == 0, "tandem binary %s", bin());
    if (t_fail) return t_done("test_kvstore");
    /* two prompts of ordinary ids (no special tokens), different from the first id */
    for (int i = 0; i < PROMPT_N; i++) {
        c.prompt[i] = 1000 + (i * 37) % 5000;
        c.other[i] = 7000 + (i * 53) % 5000;
    }
    snprintf(c.dir, sizeof c.dir, "/tmp/tandem-test-kvstore-XXXXXX");
    CHECK(mkdtemp(c.dir) != NULL, "temp dir");
    snprintf(c.store, sizeof c.store, "%s/store", c.dir);
    double t0 = now_ms();
    test_tiers(&c);
    if (!t_fail) test_split(&c);
    if (!t_fail) test_bad_blocks(&c);
    if (!t_fail) test_dir_gone(&c);
    if (!t_fail) test_shared_and_unsafe(&c);
    if (!t_fail) test_save_load(&c);
    /* last: it may move this process into a mount (and user) namespace */
    if (!t_fail) test_disk_full(&c);
    fprintf(stderr, "test_kvstore: %.1f s (logs in %s)\n", (now_ms() - t0) / 1e3, c.dir);
    if (!t_fail) rm_tree(c.dir);
    return t_done("test_kvstore");
}

/* test_cli.c - the `tandem` command line, run as a real process: --help on
 * every subcommand and serve role, --version, values refused with their
 * range, model paths that are not files, bench -o json|csv, -f - (stdin),
 * run ending cleanly on a full context; plus the shared helpers of cliopt.c
 * in-process (bounded reads, value parsing, comma-separated lists). */
#include <errno.h>
#include <fcntl.h>
#include <signal.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

#include <jansson.h>

#include "base/cliopt.h"
#include "engine/gguf.h"
#include "engine/kvcache.h"
#include "node/node_decode.h"
#include "proc.h"

#define TC_DIR "build/test_cli.d"   /* under the checkout: two checkouts testing at once never share it */

/* ==== Running the binary ==== */

typedef struct {
    int status;          /* exit status (128 + a signal that ended it); -1 if killed or not run */
    char *out, *err;     /* whole stdout and stderr, NUL-terminated */
} tc_res;

/* Runs `tandem ARGS...` with stdin from the text `in` (NULL: /dev/null);
 * killed after timeout_s. */
static tc_res tc_run(const char *in, int timeout_s, char *const args[]) {
    tc_res r = { -1, NULL, NULL };
    char *argv[64];
    int n = 0;
    argv[n++] = (char *)bin();
    for (int i = 0; args[i] && n < 63; i++) argv[n++] = args[i];
    argv[n] = NULL;
    const char *inf = TC_DIR "/stdin", *outf = TC_DIR "/stdout", *errf = TC_DIR "/stderr";
    FILE *f = fopen(inf, "wb");
    if (f) { if (in) fputs(in, f); fclose(f); }
    pid_t pid = spawn_io(argv, in ? inf : NULL, outf, errf);
    if (pid > 0) r.status = wait_exit(pid, timeout_s * 1000);
    r.out = slurp(outf);
    r.err = slurp(errf);
    return r;
}

static void tc_free(tc_res *r) { free(r->out); free(r->err); }

#define RUN(in, t, ...) tc_run(in, t, (char *const[]){ __VA_ARGS__, NULL })

/* ==== --help and --version ==== */

static void test_help(void) {
    static const char *cmds[] = { "run", "tokenize", "bench", "gen-model", "serve", "bench-handoff", "bench-serve", "grade", "cache",
                                  "chain-plan" };
    for (size_t i = 0; i < sizeof cmds / sizeof cmds[0]; i++) {
        char want[64];
        snprintf(want, sizeof want, "usage: tandem %s", cmds[i]);
        for (int h = 0; h < 2; h++) {
            tc_res r = RUN(NULL, 30, (char *)cmds[i], h ? "-h" : "--help");
            CHECK(r.status == 0 && strstr(r.out, want) && !r.err[0], "tandem %s %s: exit %d, stdout '%.60s', stderr '%.200s'",
                  cmds[i], h ? "-h" : "--help", r.status, r.out, r.err);
            tc_free(&r);
        }
    }
    /* --help wins wherever it stands, even after other options */
    tc_res r = RUN(NULL, 30, "run", "-m", "x.gguf", "-n", "5", "--help");
    CHECK(r.status == 0 && strstr(r.out, "usage: tandem run"), "run ... --help: exit %d", r.status);
    tc_free(&r);

    r = RUN(NULL, 30, "serve", "--help");
    CHECK(r.status == 0 && strstr(r.out, "prefill") && strstr(r.out, "decode") && strstr(r.out, "local") &&
          strstr(r.out, "router"), "serve --help lists every role: %.300s", r.out);
    tc_free(&r);
    static const struct { const char *role, *want; } roles[] = {
        { "prefill", "--max-preauth" }, { "decode", "--prefill-node" }, { "local", "--parallel" }, { "router", "--split" },
    };
    for (size_t i = 0; i < sizeof roles / sizeof roles[0]; i++) {
        r = RUN(NULL, 30, "serve", "--role", (char *)roles[i].role, "--help");
        CHECK(r.status == 0 && strstr(r.out, roles[i].want) && !r.err[0], "serve --role %s --help: exit %d, '%.100s'",
              roles[i].role, r.status, r.out);
        tc_free(&r);
    }

    r = RUN(NULL, 30, "--help");
    CHECK(r.status == 0 && strstr(r.out, "usage: tandem COMMAND") && strstr(r.out, "--version"), "tandem --help: %d", r.status);
    tc_free(&r);
    r = tc_run(NULL, 30, (char *const[]){ NULL });
    CHECK(r.status == 2 && strstr(r.err, "usage: tandem COMMAND") && !r.out[0], "no command: exit %d", r.status);
    tc_free(&r);
    r = RUN(NULL, 30, "frobnicate");
    CHECK(r.status == 2 && strstr(r.err, "unknown command 'frobnicate'"), "unknown command: exit %d", r.status);
    tc_free(&r);

    r = RUN(NULL, 30, "--version");
    CHECK(r.status == 0 && !strncmp(r.out, "tandem " TANDEM_VERSION " (git ", strlen("tandem " TANDEM_VERSION " (git ")) &&
          strstr(r.out, "cpu kernels: ") && strstr(r.out, "cuda: "), "--version: exit %d, '%s'", r.status, r.out);
    tc_free(&r);
}

/* ==== Bad values and paths ==== */

static void test_bad_values(const char *model) {
    static const struct { const char *opt, *val, *want; } bad[] = {
        { "-n", "-5", "tandem run: -n: -5 is out of range [-1, " },
        { "--temp", "-1", "tandem run: --temp: -1 is out of range [0, 2]" },
        { "--temp", "abc", "tandem run: --temp needs a number, got 'abc'" },
        { "--top-p", "1.5", "tandem run: --top-p: 1.5 is out of range [0, 1]" },
        { "-t", "0", "tandem run: -t: 0 is out of range [1, 256]" },
        { "-c", "0", "tandem run: -c: 0 is out of range [1, " },
        { "--seed", "-1", "tandem run: --seed: -1 is out of range [0, " },
        { "--kv-type", "q4_0", "tandem run: --kv-type: 'q4_0' is not one of f16|bf16|q8_0" },
        { "--backend", "tpu", "tandem run: --backend: 'tpu' is not one of cpu|cuda|mlx" },
    };
    for (size_t i = 0; i < sizeof bad / sizeof bad[0]; i++) {
        tc_res r = RUN(NULL, 30, "run", "-m", (char *)model, "-p", "hi", (char *)bad[i].opt, (char *)bad[i].val);
        CHECK(r.status == 2 && strstr(r.err, bad[i].want), "run %s %s: exit %d, stderr '%s'", bad[i].opt, bad[i].val,
              r.status, r.err);
        tc_free(&r);
    }
    tc_res r = RUN(NULL, 30, "run", "-m", (char *)model, "-p", "hi", "-n");
    CHECK(r.status == 2 && strstr(r.err, "-n needs a value"), "-n without a value: %d '%s'", r.status, r.err);
    tc_free(&r);
    r = RUN(NULL, 30, "run", "-m", (char *)model, "-p", "hi", "--frob");
    CHECK(r.status == 2 && strstr(r.err, "unknown option --frob"), "unknown option: %d '%s'", r.status, r.err);
    tc_free(&r);
    r = RUN(NULL, 30, "gen-model", "--arch", "qwen3", "-o", TC_DIR "/x.gguf", "--n-layer", "-3");
    CHECK(r.status == 2 && strstr(r.err, "--n-layer: -3 is out of range [0, "), "gen-model --n-layer -3: %d '%s'", r.status, r.err);
    tc_free(&r);
    r = RUN(NULL, 30, "serve", "--role", "prefill", "-m", (char *)model, "--max-conns", "0");
    CHECK(r.status == 2 && strstr(r.err, "--max-conns: 0 is out of range [1, 256]"), "serve --max-conns 0: %d '%s'", r.status, r.err);
    tc_free(&r);
    r = RUN(NULL, 30, "serve", "--role", "primary", "-m", (char *)model);
    CHECK(r.status == 2 && strstr(r.err, "'primary' is not one of prefill|decode|local|router"), "serve --role primary: %d '%s'",
          r.status, r.err);
    tc_free(&r);
    r = RUN(NULL, 30, "bench-serve", "--url", "http://127.0.0.1:1", "--model", "m", "--temp", "3");
    CHECK(r.status == 2 && strstr(r.err, "--temp: 3 is out of range [0, 2]"), "bench-serve --temp 3: %d '%s'", r.status, r.err);
    tc_free(&r);
    r = RUN(NULL, 30, "grade", "--parallel", "0");
    CHECK(r.status == 2 && strstr(r.err, "--parallel: 0 is out of range [1, 256]"), "grade --parallel 0: %d '%s'", r.status, r.err);
    tc_free(&r);
    /* a router that could learn of no node must not sit on a port */
    r = RUN(NULL, 20, "serve", "--role", "router", "--listen", "127.0.0.1:0");
    CHECK(r.status == 2 && strstr(r.err, "the router has no nodes"), "router without nodes: %d '%s'", r.status, r.err);
    tc_free(&r);
}

/* decode, local and router parse their own options (node_decode.c,
 * router.c): each bad value is refused with its range, exit 2, before any
 * model is loaded or port bound. */
/* tandem chain-plan (net/chain_plan.h): a plan of the 4-block model, and
 * its refusals: counts and rates out of range, more nodes than blocks;
 * --attn-rate's refusals, and its measurement run on the model. */
static void test_chain_plan(const char *model) {
    tc_res r = RUN(NULL, 30, "chain-plan", "-m", (char *)model, "--nodes", "2");
    CHECK(r.status == 0 && strstr(r.out, "spec: HOST1:PORT/0:1.5,HOST2:PORT/1.5:4") && strstr(r.out, "--layers 1.5:4"),
          "chain-plan of 4 blocks for 2 nodes: exit %d '%.600s' '%s'", r.status, r.out, r.err);
    tc_free(&r);
    r = RUN(NULL, 30, "chain-plan", "-m", (char *)model, "--nodes", "2", "--rates", "1,3", "--format", "bounds");
    CHECK(r.status == 0 && !strcmp(r.out, "0:0.5\n0.5:4\n"), "chain-plan, the second node 3x as fast: exit %d '%s' '%s'", r.status,
          r.out, r.err);
    tc_free(&r);
    r = RUN(NULL, 30, "chain-plan", "-m", (char *)model, "--nodes", "0");
    CHECK(r.status == 2 && strstr(r.err, "--nodes: 0 is out of range [1, 16]"), "chain-plan --nodes 0: %d '%s'", r.status, r.err);
    tc_free(&r);
    r = RUN(NULL, 30, "chain-plan", "-m", (char *)model, "--nodes", "5");
    CHECK(r.status == 2 && strstr(r.err, "for 4 blocks"), "chain-plan --nodes 5 of 4 blocks: %d '%s'", r.status, r.err);
    tc_free(&r);
    r = RUN(NULL, 30, "chain-plan", "-m", (char *)model, "--nodes", "2", "--rates", "1,0");
    CHECK(r.status == 2 && strstr(r.err, "--rates: 0 is out of range"), "chain-plan --rates 1,0: %d '%s'", r.status, r.err);
    tc_free(&r);
    r = RUN(NULL, 30, "chain-plan", "-m", (char *)model, "--nodes", "2", "--rates", "1");
    CHECK(r.status == 2 && strstr(r.err, "1 rates for 2 nodes"), "chain-plan, a rate short: %d '%s'", r.status, r.err);
    tc_free(&r);
    r = RUN(NULL, 30, "chain-plan", "-m", (char *)model, "--nodes", "2", "--attn-rate", "nan");
    CHECK(r.status == 2 && strstr(r.err, "--attn-rate: nan is out of range"), "chain-plan --attn-rate nan: %d '%s'", r.status,
          r.err);
    tc_free(&r);
    r = RUN(NULL, 30, "chain-plan", "-m", (char *)model, "--nodes", "2", "--attn-rate", "measur");
    CHECK(r.status == 2 && strstr(r.err, "--attn-rate needs a number"), "chain-plan --attn-rate measur: %d '%s'", r.status,
          r.err);
    tc_free(&r);
    r = RUN(NULL, 60, "chain-plan", "-m", (char *)model, "--nodes", "2", "--attn-rate", "measure", "--prompt-tokens", "2048",
            "--measure-rows", "64");
    CHECK(r.status == 0 && strstr(r.out, "measured (one thread") && strstr(r.out, "GFLOP/s, --attn-rate ") &&
          strstr(r.out, "by FLOP count (attn-rate 1)") && strstr(r.out, "spec: HOST1:PORT/0:"),
          "chain-plan --attn-rate measure: exit %d '%.900s' '%s'", r.status, r.out, r.err);
    tc_free(&r);
    r = RUN(NULL, 30, "chain-plan", "-m", (char *)model, "--nodes", "2", "--attn-rate", "measure", "--prompt-tokens", "20");
    CHECK(r.status == 1 && strstr(r.err, "half the tokens"), "chain-plan --attn-rate measure of 20 tokens: %d '%s'", r.status,
          r.err);
    tc_free(&r);
    r = RUN(NULL, 30, "chain-plan", "-m", TC_DIR "/absent.gguf", "--nodes", "2");
    CHECK(r.status == 1 && strstr(r.err, "absent.gguf"), "chain-plan of a missing file: %d '%s'", r.status, r.err);
    tc_free(&r);
}

static void test_serve_bad_values(const char *model) {
    static const struct { const char *role, *opt, *val, *want; } bad[] = {
        { "decode", "--parallel", "0", "tandem serve: --parallel: 0 is out of range [1, 256]" },
        { "decode", "--queue", "5000", "tandem serve: --queue: 5000 is out of range [1, 4096]" },
        { "decode", "--request-deadline-ms", "50", "tandem serve: --request-deadline-ms: 50 is out of range [100, 3600000]" },
        { "decode", "-t", "abc", "tandem serve: -t needs a whole number, got 'abc'" },
        { "decode", "--kv-type", "q4_0", "tandem serve: --kv-type: 'q4_0' is not one of f16|bf16|q8_0" },
        { "decode", "--wire-dtype", "f32", "tandem serve: --wire-dtype: 'f32' is not one of f16|bf16|q8_0" },
        { "local", "--max-conns", "0", "tandem serve: --max-conns: 0 is out of range [1, 100000]" },
        { "local", "-c", "99999999", "tandem serve: -c: 99999999 is out of range [1, 1048576]" },
        { "local", "--timeout-ms", NULL, "tandem serve: --timeout-ms needs a value" },
        { "router", "--max-concurrent", "0", "tandem serve: --max-concurrent: 0 is out of range [1, 100000]" },
        { "router", "--max-concurrent", "12abc", "tandem serve: --max-concurrent needs a whole number, got '12abc'" },
        { "router", "--health-interval-ms", "10", "tandem serve: --health-interval-ms: 10 is out of range [50, 600000]" },
        { "router", "--split", "sometimes", "tandem serve: --split: 'sometimes' is not one of auto|always|never" },
        { "router", "--decode", "127.0.0.1:1", "tandem serve: --decode: '127.0.0.1:1' is not MODEL=HOST:PORT" },
        { "router", "--listen", NULL, "tandem serve: --listen needs a value" },
    };
    for (size_t i = 0; i < sizeof bad / sizeof bad[0]; i++) {
        int router = !strcmp(bad[i].role, "router");
        /* the router takes no -m; the value (or its absence) comes last */
        tc_res r = router ? RUN(NULL, 30, "serve", "--role", "router", (char *)bad[i].opt, (char *)bad[i].val)
                          : RUN(NULL, 30, "serve", "--role", (char *)bad[i].role, "-m", (char *)model, (char *)bad[i].opt,
                                (char *)bad[i].val);
        CHECK(r.status == 2 && strstr(r.err, bad[i].want) && !strstr(r.err, "needs a valid value"),
              "serve --role %s %s %s: exit %d, stderr '%s'", bad[i].role, bad[i].opt, bad[i].val ? bad[i].val : "(none)",
              r.status, r.err);
        tc_free(&r);
    }
    /* more prefill nodes than a decode node keeps */
    char *args[64] = { "serve", "--role", "decode", "-m", (char *)model };
    int n = 5;
    for (int k = 0; k <= DECODE_MAX_PREFILL_NODES && n + 2 < 63; k++) { args[n++] = "--prefill-node"; args[n++] = "127.0.0.1:1"; }
    args[n] = NULL;
    tc_res r = tc_run(NULL, 30, args);
    CHECK(r.status == 2 && strstr(r.err, "--prefill-node: at most "), "too many --prefill-node: %d '%s'", r.status, r.err);
    tc_free(&r);
}

static void test_bad_paths(void) {
    const char *dir = TC_DIR;
    tc_res r = RUN(NULL, 30, "run", "-m", (char *)dir, "-p", "hi");
    CHECK(r.status == 1 && strstr(r.err, "is a directory") && count_str(r.err, dir) == 1 && !strstr(r.err, "mmap"),
          "a directory as -m: exit %d, '%s'", r.status, r.err);
    tc_free(&r);
    const char *none = TC_DIR "/no-such.gguf";
    r = RUN(NULL, 30, "run", "-m", (char *)none, "-p", "hi");
    CHECK(r.status == 1 && strstr(r.err, "No such file") && count_str(r.err, none) == 1, "missing -m: exit %d, '%s'", r.status, r.err);
    tc_free(&r);
    r = RUN(NULL, 30, "tokenize", "-m", (char *)dir, "-p", "hi");
    CHECK(r.status == 1 && strstr(r.err, "is a directory") && count_str(r.err, dir) == 1, "tokenize a directory: %d '%s'",
          r.status, r.err);
    tc_free(&r);
    /* a file that is not GGUF: its name once, and what is wrong with it */
    const char *junk = TC_DIR "/junk.gguf";
    FILE *f = fopen(junk, "wb");
    if (f) { fputs("this is not a gguf file at all", f); fclose(f); }
    r = RUN(NULL, 30, "run", "-m", (char *)junk, "-p", "hi");
    CHECK(r.status == 1 && count_str(r.err, junk) == 1, "junk -m: exit %d, '%s'", r.status, r.err);
    tc_free(&r);
    r = RUN(NULL, 30, "run", "-m", (char *)junk, "-f", TC_DIR "/no-prompt.txt");
    CHECK(r.status == 1 && strstr(r.err, "cannot read " TC_DIR "/no-prompt.txt"), "missing -f: exit %d, '%s'", r.status, r.err);
    tc_free(&r);
}

/* ==== bench -o ==== */

static void test_bench_formats(const char *model) {
    tc_res r = RUN(NULL, 300, "bench", "-m", (char *)model, "-p", "8", "-n", "2", "-r", "1", "-t", "1", "-o", "json");
    json_error_t je;
    json_t *j = json_loads(r.out, 0, &je);
    CHECK(r.status == 0 && json_is_array(j) && json_array_size(j) == 2, "bench -o json: exit %d, parse '%s', '%.200s'",
          r.status, j ? "ok" : je.text, r.out);
    for (size_t i = 0; json_is_array(j) && i < json_array_size(j); i++) {
        json_t *o = json_array_get(j, i);
        const char *test = json_string_value(json_object_get(o, "test"));
        double ts = json_number_value(json_object_get(o, "avg_ts"));
        CHECK(test && !strcmp(test, i ? "tg2" : "pp8") && ts > 0 && json_integer_value(json_object_get(o, "n_threads")) == 1 &&
              json_integer_value(json_object_get(o, "n_params")) > 0 && json_is_string(json_object_get(o, "model")),
              "bench json row %zu: test %s, avg_ts %g", i, test ? test : "(none)", ts);
    }
    json_decref(j);
    tc_free(&r);

    r = RUN(NULL, 300, "bench", "-m", (char *)model, "-p", "8", "-n", "2", "-r", "1", "-t", "1", "-o", "csv");
    const char *hdr = "model,size_bytes,n_params,backend,kernels,n_threads,n_batch,kv_type,test,n_prompt,n_gen,n_depth,reps,"
                      "avg_ts,stddev_ts\n";
    CHECK(r.status == 0 && !strncmp(r.out, hdr, strlen(hdr)), "bench -o csv header: exit %d, '%.200s'", r.status, r.out);
    int lines = count_str(r.out, "\n"), fields_ok = 1;
    for (char *p = r.out, *nl; (nl = strchr(p, '\n')); p = nl + 1) {
        int commas = 0;
        for (char *q = p; q < nl; q++) commas += *q == ',';
        fields_ok &= commas == 14;
    }
    CHECK(lines == 3 && fields_ok && strstr(r.out, ",pp8,8,0,0,1,") && strstr(r.out, ",tg2,0,2,0,1,"),
          "bench -o csv: 1 header + 2 rows of 15 fields: '%s'", r.out);
    tc_free(&r);

    /* -np: each tgN again with P sequences decoding together */
    r = RUN(NULL, 300, "bench", "-m", (char *)model, "-p", "0", "-n", "3", "-np", "2", "-r", "1", "-t", "1", "-o", "json");
    j = json_loads(r.out, 0, NULL);
    json_t *r0 = json_array_get(j, 0), *r1 = json_array_get(j, 1);
    const char *t0 = json_string_value(json_object_get(r0, "test")), *t1 = json_string_value(json_object_get(r1, "test"));
    CHECK(r.status == 0 && json_array_size(j) == 2 && t0 && t1 && !strcmp(t0, "tg3") && !strcmp(t1, "tg3 x2") &&
          json_integer_value(json_object_get(r0, "n_parallel")) == 1 &&
          json_integer_value(json_object_get(r1, "n_parallel")) == 2 &&
          json_real_value(json_object_get(r1, "avg_ts")) > 0,
          "bench -np 2 -o json: exit %d, '%.400s'", r.status, r.out);
    json_decref(j);
    tc_free(&r);
    r = RUN(NULL, 30, "bench", "-m", (char *)model, "-np", "1");
    CHECK(r.status == 2 && strstr(r.err, "-np: 1 is out of range [2, 64]"), "bench -np 1: %d '%s'", r.status, r.err);
    tc_free(&r);
    r = RUN(NULL, 30, "bench", "-m", (char *)model, "-o", "xml");
    CHECK(r.status == 2 && strstr(r.err, "-o: 'xml' is not one of md|json|csv"), "bench -o xml: %d '%s'", r.status, r.err);
    tc_free(&r);
    /* the speculative mode: plain and lookup rows side by side, drafts counted
     * (stories260K on a story that repeats, 1 and 2 streams, every step drafting) */
    char story[1024];
    t_fixture_path(story, sizeof story, "models/stories260K.gguf");
    if (!t_need(story)) return;
    r = RUN(NULL, 300, "bench", "-m", story, "--lookup", "4", "--fixed", "-np", "1,2", "-n", "16", "-r", "1", "-t", "1",
            "-p", "Once upon a time, there was a little girl named Lily. She liked to play. Once upon a time, there was a");
    int rows = count_str(r.out, "\n| plain | "), spec_rows = count_str(r.out, "\n| lookup | ");
    char *l1 = strstr(r.out, "\n| lookup | 1 | ");
    long drafted = -1;
    if (l1) {   /* | lookup | 1 | TPOT | t/s | gap | drafted | */
        char *c = l1 + 1;
        for (int f = 0; c && f < 5; f++) c = strchr(c + 1, '|');
        if (c) drafted = strtol(c + 1, NULL, 10);
    }
    CHECK(r.status == 0 && rows == 2 && spec_rows == 2 && drafted > 0, "bench --lookup: exit %d, %d/%d rows, %ld drafted: '%.600s' '%.200s'",
          r.status, rows, spec_rows, drafted, r.out, r.err);
    tc_free(&r);
    r = RUN(NULL, 30, "bench", "-m", (char *)model, "--lookup", "4", "-np", "0");
    CHECK(r.status == 2 && strstr(r.err, "tandem bench: -np: 0 is out of range [1, 64]"), "bench --lookup -np 0: %d '%s'", r.status,
          r.err);
    tc_free(&r);
}

/* ==== run: stdin, context full ==== */

static void test_run_stdin(const char *model) {
    const char *prompt = "Once upon a time, there was a little";
    tc_res a = RUN(NULL, 120, "run", "-m", (char *)model, "-p", (char *)prompt, "-n", "6", "--ids", "-t", "1");
    tc_res b = RUN(prompt, 120, "run", "-m", (char *)model, "-f", "-", "-n", "6", "--ids", "-t", "1");
    CHECK(a.status == 0 && b.status == 0 && a.out[0] && !strcmp(a.out, b.out), "-f - equals -p: '%s' vs '%s' (exit %d, %d: %s)",
          a.out, b.out, a.status, b.status, b.err);
    tc_free(&a);
    tc_free(&b);
    tc_res r = RUN(prompt, 30, "run", "-m", (char *)model, "-f", "-", "-p", (char *)prompt);
    CHECK(r.status == 2 && strstr(r.err, "one of -p PROMPT or -f FILE"), "-f and -p together: %d '%s'", r.status, r.err);
    tc_free(&r);
}

/* Generated ids on stdout, space-separated. */
static int tc_count_ids(const char *s) {
    int n = 0;
    for (const char *p = s; *p;) {
        while (*p == ' ' || *p == '\n') p++;
        if (!*p) break;
        n++;
        while (*p && *p != ' ' && *p != '\n') p++;
    }
    return n;
}

static void test_run_context_full(const char *model) {
    const char *prompt = "Once upon a time";
    for (int k = 0; k < 2; k++) {   /* -n -1 (until full) and a -n beyond the context */
        tc_res r = RUN(NULL, 120, "run", "-m", (char *)model, "-p", (char *)prompt, "-c", "10", "-n", k ? "50" : "-1",
                       "--ignore-eos", "--ids", "-t", "1");
        int n_prompt = -1;
        const char *p = strstr(r.err, "prompt: ");
        if (p) n_prompt = atoi(p + 8);
        int n_ids = tc_count_ids(r.out);
        /* positions 0..9 hold the prompt and all generated tokens but the last */
        CHECK(r.status == 0 && strstr(r.err, "context full (10 tokens); stopping") && n_prompt > 0 && n_ids == 10 - n_prompt + 1,
              "context full with -n %s: exit %d, %d prompt + %d generated, stderr '%s'", k ? "50" : "-1", r.status, n_prompt,
              n_ids, r.err);
        tc_free(&r);
    }
    /* room to spare: no note */
    tc_res r = RUN(NULL, 120, "run", "-m", (char *)model, "-p", (char *)prompt, "-c", "64", "-n", "3", "--ignore-eos", "--ids", "-t", "1");
    CHECK(r.status == 0 && !strstr(r.err, "context full") && tc_count_ids(r.out) == 3, "-n 3 in -c 64: %d '%s'", r.status, r.err);
    tc_free(&r);
    r = RUN(NULL, 120, "run", "-m", (char *)model, "-p", "Once upon a time, in a land far away", "-c", "3", "-t", "1");
    CHECK(r.status == 1 && strstr(r.err, "give a larger -c"), "prompt beyond -c: %d '%s'", r.status, r.err);
    tc_free(&r);
    r = RUN(NULL, 120, "run", "-m", (char *)model, "-p", (char *)prompt, "-c", "5000", "-n", "1", "-t", "1");
    CHECK(r.status == 0 && strstr(r.err, "warning: -c 5000 is beyond the model's trained context"), "-c past training: %d '%s'",
          r.status, r.err);
    tc_free(&r);
}

/* ==== cliopt in-process ==== */

static void test_cliopt(void) {
    char err[256];
    const char *path = TC_DIR "/hundred.txt";
    FILE *f = fopen(path, "wb");
    for (int i = 0; f && i < 100; i++) fputc('a' + i % 26, f);
    if (f) fclose(f);
    size_t len = 0;
    char *s = cliopt_read_text(path, 100, &len, err, sizeof err);
    CHECK(s && len == 100 && s[100] == 0 && s[99] == 'a' + 99 % 26, "100 bytes within a 100-byte bound: len %zu", len);
    free(s);
    s = cliopt_read_text(path, 99, &len, err, sizeof err);
    CHECK(!s && strstr(err, "longer than 99 bytes"), "100 bytes past a 99-byte bound refused: '%s'", err);
    free(s);
    s = cliopt_read_text(path, 5000, &len, err, sizeof err);
    CHECK(s && len == 100, "a bound larger than the first buffer: len %zu", len);
    free(s);
    /* at the edges of the buffer's growth: exactly max bytes, and one more */
    for (int extra = 0; extra < 2; extra++) {
        f = fopen(path, "wb");
        for (int i = 0; f && i < 4095 + extra; i++) fputc('x', f);
        if (f) fclose(f);
        s = cliopt_read_text(path, 4095, &len, err, sizeof err);
        CHECK(extra ? !s : s && len == 4095, "%d bytes with a 4095-byte bound: %s", 4095 + extra, s ? "read" : err);
        free(s);
        s = cliopt_read_text(path, 8191, &len, err, sizeof err);
        CHECK(s && len == (size_t)(4095 + extra), "%d bytes with an 8191-byte bound: len %zu", 4095 + extra, len);
        free(s);
    }
    s = cliopt_read_text(TC_DIR, 100, &len, err, sizeof err);
    CHECK(!s && errno != EFBIG, "a directory is not a prompt file");
    free(s);
    f = fopen(path, "wb");
    for (int i = 0; f && i < 4097; i++) fputc('k', f);
    if (f) fclose(f);
    s = cliopt_read_text(path, 4096, &len, err, sizeof err);
    CHECK(!s && errno == EFBIG, "past the bound: errno EFBIG");
    free(s);
    /* the node secret: at most 4 KiB, trailing whitespace not part of it */
    char *sec = NULL;
    CHECK(cliopt_load_secret(path, &sec, &len, err, sizeof err) == -1 && !sec && strstr(err, "longer than 4096 bytes"),
          "a 4097-byte secret file refused: '%s'", err);
    f = fopen(path, "wb");
    if (f) { fputs("0f1e2d3c4b5a69788796a5b4c3d2e1f00f1e2d3c4b5a69788796a5b4c3d2e1f0 \t\r\n\n", f); fclose(f); }
    CHECK(cliopt_load_secret(path, &sec, &len, err, sizeof err) == 0 && len == 64 && !strcmp(sec, "0f1e2d3c4b5a69788796a5b4c3d2e1f00f1e2d3c4b5a69788796a5b4c3d2e1f0"),
          "a secret file's line: len %zu", len);
    free(sec);
    sec = NULL;
    f = fopen(path, "wb");
    if (f) { fputs(" \n", f); fclose(f); }
    CHECK(cliopt_load_secret(path, &sec, &len, err, sizeof err) == -1 && !sec && strstr(err, "is empty"),
          "a blank secret file refused: '%s'", err);
    CHECK(kv_dtype_parse("q8_0") == GGML_TYPE_Q8_0 && kv_dtype_parse("F16") == UINT32_MAX &&
          !strcmp(kv_dtype_name(kv_dtype_parse("bf16")), "bf16") && !strcmp(kv_dtype_name(GGML_TYPE_F32), "?"),
          "KV types by name and back");
    int v = 7;
    CHECK(cliopt_int("t", "-x", "12", 0, 12, &v) == 0 && v == 12, "12 in [0, 12]");
    CHECK(cliopt_int("t", "-x", "13", 0, 12, &v) == -1 && v == 12, "13 refused, value untouched");
    CHECK(cliopt_int("t", "-x", "99999999999999999999", 0, 12, &v) == -1, "overflow refused");
    CHECK(cliopt_int("t", "-x", "1x", 0, 12, &v) == -1 && cliopt_int("t", "-x", "", 0, 12, &v) == -1, "junk refused");
    float fl;
    CHECK(cliopt_float("t", "--f", "nan", 0, 2, &fl) == -1 && cliopt_float("t", "--f", "inf", 0, 2, &fl) == -1, "nan/inf refused");
    uint64_t u;
    CHECK(cliopt_u64("t", "--u", "-1", 0, 10, &u) == -1 && cliopt_u64("t", "--u", "10", 0, 10, &u) == 0 && u == 10,
          "u64: a sign refused, the bound included");
}

/* ==== stderr in-process ==== */

static int tc_saved_err = -1;

/* stderr into a file until tc_stderr_back, which returns what was written. */
static void tc_stderr_to(const char *path) {
    fflush(stderr);
    int fd = open(path, O_WRONLY | O_CREAT | O_TRUNC, 0644);
    tc_saved_err = fd < 0 ? -1 : dup(2);
    if (fd >= 0) { dup2(fd, 2); close(fd); }
}

static char *tc_stderr_back(const char *path) {
    fflush(stderr);
    if (tc_saved_err < 0) return calloc(1, 1);
    dup2(tc_saved_err, 2);
    close(tc_saved_err);
    tc_saved_err = -1;
    return slurp(path);
}

/* Progress lines go to stderr, which here is not a terminal: nothing for a
 * quick stage, at most a line per tenth plus the end for a slow one. */
static char *tc_capture_progress(double stall_s) {
    const char *path = TC_DIR "/progress";
    tc_stderr_to(path);
    cliopt_progress p;
    cliopt_progress_begin(&p, "stage", 1000, 0);
    nanosleep(&(struct timespec){ (time_t)stall_s, (long)((stall_s - (time_t)stall_s) * 1e9) }, NULL);
    for (int i = 0; i <= 1000; i++) cliopt_progress_update(&p, (uint64_t)i);
    cliopt_progress_end(&p);
    return tc_stderr_back(path);
}

static void test_progress(void) {
    char *quick = tc_capture_progress(0);
    CHECK(quick[0] == 0, "a quick stage prints nothing off a terminal: '%s'", quick);
    free(quick);
    char *slow = tc_capture_progress(2.1);
    int lines = count_str(slow, "\n");
    CHECK(lines >= 2 && lines <= 11 && strstr(slow, "stage: 100% (") && strstr(slow, "stage: done in "),
          "a slow stage: %d lines, '%s'", lines, slow);
    free(slow);
}

/* ==== Lists ==== */

/* Each subcommand's list options (cliopt_int_list and friends) refuse a
 * malformed list with the option and its range. */
static void test_list_values(const char *model) {
    static const struct { const char *args[8], *want; } bad[] = {
        { { "bench", "-m", "MODEL", "-p", "1,,2" }, "tandem bench: -p: '1,,2' is not a list of at most 16 whole numbers in [0, 1000000]\n" },
        { { "bench", "-m", "MODEL", "-t", "1,300" }, "tandem bench: -t: 300 is out of range [1, 256]\n" },
        { { "bench", "-m", "MODEL", "--lookup", "4", "-np", "1,2,3,4,5,6,7,8,9" },
          "tandem bench: -np: '1,2,3,4,5,6,7,8,9' is not a list of at most 8 whole numbers in [1, 64]\n" },
        { { "bench-serve", "--url", "http://127.0.0.1:1", "--model", "x", "-c", "1," },
          "tandem bench-serve: -c: '1,' is not a list of at most 16 whole numbers in [1, 256]\n" },
        { { "bench-handoff", "-m", "MODEL", "--lengths", "2,x" },
          "tandem bench-handoff: --lengths: '2,x' is not a list of at most 16 whole numbers in [2, 1048576]\n" },
        { { "bench-handoff", "-m", "MODEL", "--wire-dtype", "f16,,q8_0" },
          "tandem bench-handoff: --wire-dtype: 'f16,,q8_0' is not a list of at most 16 of f16|bf16|q8_0\n" },
        { { "chain-plan", "-m", "MODEL", "--nodes", "2", "--rates", "1," },
          "tandem chain-plan: --rates: '1,' is not a list of at most 16 numbers in [1e-06, 1e+06]\n" },
    };
    for (size_t i = 0; i < sizeof bad / sizeof bad[0]; i++) {
        char *args[9] = { 0 };
        for (int a = 0; a < 8 && bad[i].args[a]; a++) args[a] = (char *)(strcmp(bad[i].args[a], "MODEL") ? bad[i].args[a] : model);
        tc_res r = tc_run(NULL, 30, args);
        CHECK(r.status == 2 && !strcmp(r.err, bad[i].want), "%s %s %s: %d '%s'", args[0], args[3], args[4], r.status, r.err);
        tc_free(&r);
    }
}

/* ==== Lists in-process ==== */

/* cliopt_int_list on v with [0, 5] and at most 4 items: its status, the
 * message on stderr in *msg (caller frees). */
static int tc_int_list(const char *v, int *out, int *n, char **msg) {
    const char *path = TC_DIR "/list";
    tc_stderr_to(path);
    int rc = cliopt_int_list("t", "-l", v, 0, 5, out, 4, n);
    *msg = tc_stderr_back(path);
    return rc;
}

/* Every item bounded; an empty list or item, a trailing comma, one item too
 * many, overflow and junk refused with one line naming the option and the
 * range, the output untouched. */
static void test_lists(void) {
    int l[4] = { 7, 7, 7, 7 }, n = -1;
    char *msg;
    CHECK(tc_int_list("1,2,0,5", l, &n, &msg) == 0 && n == 4 && l[0] == 1 && l[2] == 0 && l[3] == 5 && !*msg,
          "1,2,0,5: 4 items, both bounds in: n %d, '%s'", n, msg);
    free(msg);
    CHECK(tc_int_list("3", l, &n, &msg) == 0 && n == 1 && l[0] == 3, "one item: n %d", n);
    free(msg);
    static const char *const shape[] = { "", ",", "1,,2", "1,", ",1", "1,2,3,4,5", "1,x", "1 ,2", "1,2x", "0x1", NULL };
    for (int i = 0; shape[i]; i++) {
        l[0] = 7, n = -1;
        char want[128];
        snprintf(want, sizeof want, "t: -l: '%s' is not a list of at most 4 whole numbers in [0, 5]\n", shape[i]);
        CHECK(tc_int_list(shape[i], l, &n, &msg) == -1 && n == -1 && l[0] == 7 && !strcmp(msg, want), "'%s' refused: '%s'",
              shape[i], msg);
        free(msg);
    }
    static const char *const range[] = { "1,6", "-1", "2,99999999999999999999", "9223372036854775808", NULL };
    static const char *const item[] = { "6", "-1", "99999999999999999999", "9223372036854775808" };
    for (int i = 0; range[i]; i++) {
        char want[128];
        snprintf(want, sizeof want, "t: -l: %s is out of range [0, 5]\n", item[i]);
        CHECK(tc_int_list(range[i], l, &n, &msg) == -1 && n == -1 && l[0] == 7 && !strcmp(msg, want), "'%s' refused: '%s'",
              range[i], msg);
        free(msg);
    }
    CHECK(tc_int_list(NULL, l, &n, &msg) == -1 && !strcmp(msg, "t: -l needs a value\n"), "no value: '%s'", msg);
    free(msg);
    double r[3] = { 0 };
    int nr = -1, k[3] = { 0 }, nk = -1;
    CHECK(cliopt_double_list("t", "--r", "0.5,2,1e3", 1e-3, 1e3, r, 3, &nr) == 0 && nr == 3 && r[0] == 0.5 && r[2] == 1e3,
          "rates 0.5,2,1e3: n %d", nr);
    const char *path = TC_DIR "/list";
    tc_stderr_to(path);
    int bad = 0;
    for (const char *const *v = (const char *const[]){ "nan", "inf", "1,", "1,0", "1,2,3,4", "1,2e", NULL }; *v; v++)
        bad += cliopt_double_list("t", "--r", *v, 1e-3, 1e3, r, 3, &nr) == -1 && nr == 3;
    msg = tc_stderr_back(path);
    CHECK(bad == 6 && strstr(msg, "t: --r: nan is out of range [0.001, 1000]\n") &&
          strstr(msg, "t: --r: '1,' is not a list of at most 3 numbers in [0.001, 1000]\n") &&
          strstr(msg, "t: --r: 0 is out of range [0.001, 1000]\n"),
          "rates refused: %d of 6, '%s'", bad, msg);
    free(msg);
    CHECK(cliopt_choice_list("t", "--d", "q8_0,f16,q8_0", kv_dtype_names, k, 3, &nk) == 0 && nk == 3 && k[0] == 2 && k[1] == 0,
          "names by index: n %d", nk);
    tc_stderr_to(path);
    bad = 0;
    for (const char *const *v = (const char *const[]){ "f32", "f16,", "f16,,bf16", "F16", "f16,f16,f16,f16", NULL }; *v; v++)
        bad += cliopt_choice_list("t", "--d", *v, kv_dtype_names, k, 3, &nk) == -1 && nk == 3;
    msg = tc_stderr_back(path);
    CHECK(bad == 5 && strstr(msg, "t: --d: 'f32' is not a list of at most 3 of f16|bf16|q8_0\n"), "names refused: %d of 5, '%s'",
          bad, msg);
    free(msg);
}

int main(void) {
    mkdir(TC_DIR, 0755);
    if (access(bin(), X_OK)) { CHECK(0, "tandem binary %s (set TANDEM_BIN)", bin()); return t_done("test_cli"); }
    char model[512];
    snprintf(model, sizeof model, "%s/qwen3-mini-F16.gguf", t_models());
    test_cliopt();
    test_progress();
    test_lists();
    test_help();
    test_bad_paths();
    if (!t_need(model)) return t_done("test_cli");
    test_bad_values(model);
    test_serve_bad_values(model);
    test_chain_plan(model);
    test_list_values(model);
    test_bench_formats(model);
    test_run_stdin(model);
    test_run_context_full(model);
    return t_done("test_cli");
}

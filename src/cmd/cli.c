/* cli.c - `tandem run` and `tandem tokenize`. */
#include "cmd/cli.h"

#include <errno.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "base/cliopt.h"
#include "engine/generate.h"
#include "api/tools.h"
#include "node/chain.h"
#include "node/handoff.h"
#include "engine/kvcache.h"
#include "engine/model.h"
#include "engine/quant.h"
#include "engine/sampler.h"
#include "engine/tokenizer.h"
#include "base/version.h"

/* ==== Options ==== */

typedef struct {
    const char *model, *prompt, *prompt_file, *kv_type;
    const char *prefill_node, *secret_file, *wire_dtype;   /* remote prefill */
    const char *act_dtype;   /* a chain's hidden states: f32, f16, bf16 */
    const char *backend;
    int n_predict, n_threads, n_ctx, n_batch, chat, ids, ignore_eos, verbose, zstd, timeout_ms, deadline_ms, device;
    int seed_given;              /* else a fresh seed per run */
    sampler_params sp;
} run_opts;

static void cli_usage_run(FILE *f) {
    fprintf(f,
        "usage: tandem run -m MODEL.gguf (-p PROMPT | -f FILE) [options]\n"
        "  -f FILE         read the prompt from FILE; - reads stdin (at most 64 MiB)\n"
        "  -n N            tokens to generate, -1 = until end of generation or a full context\n"
        "                  (default 128)\n"
        "  -t N            threads, 1..256 (default 2)\n"
        "  -c N            context size (default: the model's, at most 4096); generation\n"
        "                  stops with a note when it is full\n"
        "  -b N            prefill chunk size, 1..65536 (default: the backend's, 512 on the CPU,\n"
        "                  4096 with cuda)\n"
        "  --chat          wrap the prompt in the model's chat template\n"
        "  --ids           print generated token ids instead of text\n"
        "  --ignore-eos    keep generating past end-of-generation tokens\n"
        "  --temp T        temperature, 0..2 (default 0 = greedy)\n"
        "  --top-k K --top-p P --min-p P   sampling filters: K 0..1000000 (0 = off),\n"
        "                  P 0..1 (defaults 40, 0.95, 0.05)\n"
        "  --seed S        sampling seed, 0 to 2^63-1 (default: a fresh one per run, printed with -v)\n"
        "  --kv-type T     KV cache type: f16 (default), bf16, q8_0\n"
        "  -v              print the sampling seed\n");
    cliopt_usage_backend(f, 15);
    fprintf(f,
        "Remote prefill (this process decodes; the prompt's KV comes from a prefill node):\n"
        "  --prefill-node HOST:PORT   prefill node to use, or a layer-split chain\n"
        "                             HOST:PORT/0:A,HOST:PORT/A:B,... (docs/layer-split.md)\n"
        "  --secret-file FILE         shared node secret (or env TANDEM_SECRET)\n"
        "  --wire-dtype T             KV type on the wire: the cache type (default) or q8_0 (lossy with\n"
        "                             an f16/bf16 cache: greedy output can differ from local prefill)\n"
        "  --act-dtype T              hidden states between chain slices (--prefill-node\n"
        "                             HOST:PORT/A:B,...): f32 (default), f16, bf16\n"
        "  --zstd                     compress KV frames\n"
        "  --timeout-ms N             give up when no frame arrives for N ms (default 10000)\n"
        "  --deadline-ms N            give up when the prefill takes N ms in all (default: 300000,\n"
        "                             or 50 ms per prompt position when that is more, as the\n"
        "                             prefill node's --request-ms)\n");
}

#define RUN "tandem run"
/* -f - and -f FILE: a prompt larger than this is surely a mistake. */
#define RUN_MAX_PROMPT_BYTES ((size_t)64 << 20)
/* -n upper bound: far beyond any context; -1 means "until the context is full". */
#define RUN_MAX_PREDICT 100000000L

/* One option that takes a value; 0, or -1 after printing what is wrong. */
static int cli_parse_run_value(run_opts *o, const char *a, const char *v) {
    int k;
    if (!strcmp(a, "-m")) return cliopt_str(RUN, a, v, &o->model);
    if (!strcmp(a, "-p")) return cliopt_str(RUN, a, v, &o->prompt);
    if (!strcmp(a, "-f")) return cliopt_str(RUN, a, v, &o->prompt_file);
    if (!strcmp(a, "-n")) return cliopt_int(RUN, a, v, -1, RUN_MAX_PREDICT, &o->n_predict);
    if (!strcmp(a, "-t")) return cliopt_int(RUN, a, v, 1, 256, &o->n_threads);
    if (!strcmp(a, "-c")) return cliopt_int(RUN, a, v, 1, 1 << 24, &o->n_ctx);
    if (!strcmp(a, "-b")) return cliopt_int(RUN, a, v, 1, 1 << 16, &o->n_batch);
    if (!strcmp(a, "--temp")) return cliopt_float(RUN, a, v, 0, 2, &o->sp.temp);
    if (!strcmp(a, "--top-k")) return cliopt_int(RUN, a, v, 0, 1000000, &o->sp.top_k);
    if (!strcmp(a, "--top-p")) return cliopt_float(RUN, a, v, 0, 1, &o->sp.top_p);
    if (!strcmp(a, "--min-p")) return cliopt_float(RUN, a, v, 0, 1, &o->sp.min_p);
    if (!strcmp(a, "--seed")) { o->seed_given = 1; return cliopt_u64(RUN, a, v, 0, INT64_MAX, &o->sp.seed); }
    if (!strcmp(a, "--kv-type")) return cliopt_choice(RUN, a, v, kv_dtype_names, &k) ? -1 : cliopt_str(RUN, a, v, &o->kv_type);
    if (!strcmp(a, "--act-dtype")) {
        static const char *const acts[] = { "f32", "f16", "bf16", NULL };
        return cliopt_choice(RUN, a, v, acts, &k) ? -1 : cliopt_str(RUN, a, v, &o->act_dtype);
    }
    if (!strcmp(a, "--wire-dtype")) return cliopt_choice(RUN, a, v, kv_dtype_names, &k) ? -1 : cliopt_str(RUN, a, v, &o->wire_dtype);
    if (!strcmp(a, "--backend")) return cliopt_backend(RUN, v, &o->backend);
    if (!strcmp(a, "--device")) return cliopt_int(RUN, a, v, 0, 63, &o->device);
    if (!strcmp(a, "--prefill-node")) return cliopt_str(RUN, a, v, &o->prefill_node);
    if (!strcmp(a, "--secret-file")) return cliopt_str(RUN, a, v, &o->secret_file);
    if (!strcmp(a, "--timeout-ms")) return cliopt_int(RUN, a, v, 1, 3600000, &o->timeout_ms);
    if (!strcmp(a, "--deadline-ms")) return cliopt_int(RUN, a, v, 1, 86400000, &o->deadline_ms);
    return 1;   /* not an option with a value */
}

/* Parses run options; 0, 1 after --help (usage on stdout), or -1 after
 * printing what is wrong. */
static int cli_parse_run(int argc, char **argv, run_opts *o) {
    memset(o, 0, sizeof *o);
    o->n_predict = 128; o->n_threads = 2; o->n_batch = 0; o->kv_type = "f16";
    o->sp = sampler_defaults();
    for (int i = 0; i < argc; i++) {
        const char *a = argv[i];
        int r = cli_parse_run_value(o, a, i + 1 < argc ? argv[i + 1] : NULL);
        if (r < 0) return -1;
        if (r == 0) { i++; continue; }
        if (!strcmp(a, "--chat")) o->chat = 1;
        else if (!strcmp(a, "--ids")) o->ids = 1;
        else if (!strcmp(a, "--ignore-eos")) o->ignore_eos = 1;
        else if (!strcmp(a, "-v")) o->verbose = 1;
        else if (!strcmp(a, "--zstd")) o->zstd = 1;
        else if (cliopt_is_help(a)) { cli_usage_run(stdout); return 1; }
        else { fprintf(stderr, RUN ": unknown option %s (see tandem run --help)\n", a); return -1; }
    }
    if (!o->model || (!o->prompt && !o->prompt_file) || (o->prompt && o->prompt_file)) {
        if (argc) fprintf(stderr, RUN ": give -m MODEL and one of -p PROMPT or -f FILE\n");
        cli_usage_run(stderr);
        return -1;
    }
    if (!o->seed_given) o->sp.seed = sampler_fresh_seed();
    return 0;
}

/* ==== run ==== */

typedef struct {
    handoff_stats hs;
    double last_ms;          /* the last prompt token, evaluated here */
    double connect_ms;
} run_remote;

/* Fetches the KV of prompt positions [0, n - 1) from a prefill node, then
 * evaluates the last prompt token here so that logits hold what a local
 * prefill would give. */
static int run_remote_prefill(model *m, session *s, const run_opts *o, uint32_t kvt, const int32_t *ids, int n,
                              float *logits, run_remote *rr, char *err, size_t errlen) {
    memset(rr, 0, sizeof *rr);
    uint32_t wdt = o->wire_dtype ? kv_dtype_parse(o->wire_dtype) : kvt;
    if (wdt == UINT32_MAX) { snprintf(err, errlen, "unknown wire dtype %s", o->wire_dtype); return -1; }
    char *secret = NULL;
    size_t slen = 0;
    if (cliopt_load_secret(o->secret_file, &secret, &slen, err, errlen)) return -1;
    handoff_opts ho = { .wire_dtype = wdt, .zstd = o->zstd, .timeout_ms = o->timeout_ms, .deadline_ms = o->deadline_ms,
                        .secret = secret, .secret_len = slen, .node_id = "tandem-run" };
    handoff_client *c = NULL;
    double t0 = gen_now_ms();
    int rc;
    if (chain_spec_is(o->prefill_node)) {   /* a layer-split chain (node/chain.h) */
        chain_pool *cp = chain_pool_new();
        chain_opts co = { .act_dtype = !o->act_dtype || !strcmp(o->act_dtype, "f32") ? GGML_TYPE_F32
                                     : !strcmp(o->act_dtype, "f16") ? GGML_TYPE_F16 : GGML_TYPE_BF16 };
        rc = cp ? chain_pool_prefill(cp, o->prefill_node, m, kvt, &ho, &co, 0, s, ids, n, 0, &rr->hs, err, errlen) : -1;
        if (!cp) snprintf(err, errlen, "out of memory");
        /* the connections (handshakes) count as a single node's do */
        if (!rc) rr->connect_ms = gen_now_ms() - t0 - rr->hs.total_ms;
        chain_pool_free(cp);
        free(secret);
    } else {
        rc = handoff_connect(&c, o->prefill_node, m, kvt, &ho, err, errlen);
        free(secret);
        if (rc) return -1;
        rr->connect_ms = gen_now_ms() - t0;
        rc = handoff_prefill(c, s, ids, n, 0, &rr->hs, err, errlen);
        handoff_close(c);
    }
    if (rc) return -1;
    double t1 = gen_now_ms();
    if (model_eval(m, s, ids + n - 1, 1, logits, NULL, NULL, err, errlen)) return -1;
    rr->last_ms = gen_now_ms() - t1;
    rr->hs.n_computed_local = 1;
    return 0;
}

typedef struct {
    tok_stream ts;
    int ids;
    int first;
} run_print;

static int run_on_token(void *ud, int32_t id) {
    run_print *rp = ud;
    if (rp->ids) {
        printf(rp->first ? "%d" : " %d", id);
    } else {
        char buf[512];
        int n = tok_stream_push(&rp->ts, id, buf, sizeof buf);
        if (n > 0) fwrite(buf, 1, (size_t)n, stdout);
    }
    rp->first = 0;
    fflush(stdout);
    return 0;
}

/* The context size: -c, else the model's trained one capped at 4096; a -c
 * past the trained context is allowed (llama.cpp does too) with a warning. */
static int run_pick_ctx(const run_opts *o, const model_hparams *hp) {
    int train = hp->n_ctx_train;
    if (!o->n_ctx) return train > 0 && train < 4096 ? train : 4096;
    if (train > 0 && o->n_ctx > train)
        fprintf(stderr, RUN ": warning: -c %d is beyond the model's trained context of %d tokens; "
                "output past %d tokens may degrade\n", o->n_ctx, train, train);
    return o->n_ctx;
}

static void run_print_stats(const run_opts *o, const run_remote *rr, gen_stats *st, int n_prompt) {
    if (o->prefill_node) {
        const handoff_stats *h = &rr->hs;
        st->n_prompt = n_prompt;
        st->prompt_ms = rr->connect_ms + h->total_ms + rr->last_ms;
        fprintf(stderr, "handoff: %d positions received from %s (computed remotely %d, locally %d), "
                "KV %llu bytes, wire %llu bytes, %.1f ms (connect %.1f ms, remote compute %.1f ms, "
                "transfer tail %.1f ms, last token %.1f ms)\n",
                h->n_sent, o->prefill_node, h->n_computed_remote, h->n_computed_local,
                (unsigned long long)h->kv_bytes, (unsigned long long)h->wire_bytes, h->total_ms,
                rr->connect_ms, h->prefill_ms_remote, h->transfer_tail_ms, rr->last_ms);
    }
    fprintf(stderr, "prompt: %d tokens in %.1f ms (%.2f t/s)\n", st->n_prompt, st->prompt_ms,
            st->prompt_ms > 0 ? st->n_prompt * 1e3 / st->prompt_ms : 0.0);
    fprintf(stderr, "generation: %d tokens in %.1f ms (%.2f t/s)\n", st->n_gen, st->gen_ms,
            st->n_gen > 1 && st->gen_ms > 0 ? (st->n_gen - 1) * 1e3 / st->gen_ms : 0.0);
    if (o->sp.temp > 0 || o->verbose)   /* --seed with this value replays the run */
        fprintf(stderr, "sampling: seed %llu, temp %g, top_k %d, top_p %g, min_p %g\n", (unsigned long long)o->sp.seed,
                o->sp.temp, o->sp.top_k, o->sp.top_p, o->sp.min_p);
}

int cli_run(int argc, char **argv) {
    run_opts o;
    int pr = cli_parse_run(argc, argv, &o);
    if (pr) return pr > 0 ? CLI_EXIT_OK : CLI_EXIT_USAGE;
    char err[512];
    uint32_t kvt = kv_dtype_parse(o.kv_type);
    char *text = NULL;
    if (o.prompt_file && !(text = cliopt_read_text(o.prompt_file, RUN_MAX_PROMPT_BYTES, NULL, err, sizeof err))) {
        fprintf(stderr, RUN ": %s\n", err);
        return CLI_EXIT_FAIL;
    }
    model_opts mo = { .n_threads = o.n_threads, .n_batch = o.n_batch, .backend = o.backend, .device = o.device,
                      .fingerprint_later = 1 };   /* run never joins a node link */
    model *m = NULL;
    session *s = NULL;
    sampler *smp = NULL;
    int32_t *ids = NULL;
    float *logits = NULL;
    int rc = CLI_EXIT_FAIL, n_prompt = 0;
    cliopt_progress lp;   /* copying weights to a GPU can take a while */
    cliopt_progress_begin(&lp, RUN ": loading weights", 1, 0);
    mo.on_load = cliopt_progress_steps;
    mo.on_load_ud = &lp;
    if (model_load(&m, o.model, &mo, err, sizeof err)) {
        fprintf(stderr, "%s" RUN ": %s\n", lp.drawn && lp.tty ? "\n" : "", err);
        goto out;
    }
    cliopt_progress_end(&lp);
    const model_hparams *hp = model_get_hparams(m);
    int n_ctx = run_pick_ctx(&o, hp);
    if (!(ids = tools_tokenize_prompt(m, text ? text : o.prompt, o.chat, &n_prompt, err, sizeof err))) {
        fprintf(stderr, RUN ": %s\n", err); goto out;
    }
    if (n_prompt > n_ctx) {
        fprintf(stderr, RUN ": the prompt is %d tokens but the context holds %d; give a larger -c\n", n_prompt, n_ctx);
        goto out;
    }
    if (session_new(&s, m, n_ctx, kvt, err, sizeof err)) { fprintf(stderr, RUN ": %s\n", err); goto out; }
    smp = sampler_new(&o.sp, hp->n_vocab);
    logits = malloc(sizeof(float) * (size_t)hp->n_vocab);
    if (!smp || !logits) { fprintf(stderr, RUN ": out of memory\n"); goto out; }
    run_print rp = { .ids = o.ids, .first = 1 };
    tok_stream_init_prompt(&rp.ts, model_get_tokenizer(m), ids, n_prompt);
    gen_opts go = { .max_tokens = o.n_predict < 0 ? INT32_MAX : o.n_predict, .ignore_eos = o.ignore_eos,
                    .on_token = run_on_token, .ud = &rp };
    gen_stats st;
    run_remote rr;
    memset(&rr, 0, sizeof rr);
    if (o.prefill_node && run_remote_prefill(m, s, &o, kvt, ids, n_prompt, logits, &rr, err, sizeof err)) {
        fprintf(stderr, RUN ": %s\n", err); goto out;
    }
    if (generate_run(m, s, smp, ids, n_prompt, logits, o.prefill_node != NULL, &go, &st, err, sizeof err)) {
        fprintf(stderr, "\n" RUN ": %s\n", err); goto out;
    }
    if (!o.ids) {
        char buf[16];
        int n = tok_stream_flush(&rp.ts, buf, sizeof buf);
        if (n > 0) fwrite(buf, 1, (size_t)n, stdout);
    }
    printf("\n");
    fflush(stdout);
    if (st.stopped_ctx) fprintf(stderr, RUN ": context full (%d tokens); stopping\n", n_ctx);
    run_print_stats(&o, &rr, &st, n_prompt);
    rc = CLI_EXIT_OK;
out:
    free(logits);
    sampler_free(smp);
    session_free(s);
    free(ids);
    model_free(m);
    free(text);
    return rc;
}

/* ==== tokenize ==== */

static void cli_usage_tokenize(FILE *f) {
    fprintf(f, "usage: tandem tokenize -m MODEL.gguf -p TEXT [--no-parse-special] [--pieces]\n"
               "  --no-parse-special   encode special-token text as plain text\n"
               "  --pieces             one token a line: id and its text\n");
}

int cli_tokenize(int argc, char **argv) {
    const char *path = NULL, *prompt = NULL;
    int no_special = 0, pieces = 0;
    for (int i = 0; i < argc; i++) {
        const char *a = argv[i], *v = i + 1 < argc ? argv[i + 1] : NULL;
        int bad = 0;
        if (!strcmp(a, "-m")) { bad = cliopt_str("tandem tokenize", a, v, &path); i++; }
        else if (!strcmp(a, "-p")) { bad = cliopt_str("tandem tokenize", a, v, &prompt); i++; }
        else if (!strcmp(a, "--no-parse-special")) no_special = 1;
        else if (!strcmp(a, "--pieces")) pieces = 1;
        else if (cliopt_is_help(a)) { cli_usage_tokenize(stdout); return CLI_EXIT_OK; }
        else { fprintf(stderr, "tandem tokenize: unknown option %s\n", a); bad = 1; }
        if (bad) { cli_usage_tokenize(stderr); return CLI_EXIT_USAGE; }
    }
    if (!path || !prompt) { cli_usage_tokenize(stderr); return CLI_EXIT_USAGE; }
    char err[512];
    gguf_file *f = NULL;
    tokenizer *t = NULL;
    if (gguf_open_file(&f, path, err, sizeof err)) {   /* the message names the file */
        fprintf(stderr, "tandem tokenize: %s\n", err);
        return CLI_EXIT_FAIL;
    }
    if (tokenizer_load(&t, f, err, sizeof err)) {
        fprintf(stderr, "tandem tokenize: %s: %s\n", path, err);
        gguf_close(f);
        return CLI_EXIT_FAIL;
    }
    size_t len = strlen(prompt);
    int64_t n = tokenizer_encode(t, prompt, len, 1, !no_special, NULL, 0);
    int32_t *ids = n > 0 ? malloc(sizeof(int32_t) * (size_t)n) : NULL;
    if (n > 0 && ids) tokenizer_encode(t, prompt, len, 1, !no_special, ids, n);
    for (int64_t i = 0; ids && i < n; i++) {
        if (pieces) {
            size_t pl;
            const char *p = tokenizer_token_str(t, ids[i], &pl);
            printf("%d '%.*s'\n", ids[i], (int)pl, p ? p : "");
        } else {
            printf(i ? " %d" : "%d", ids[i]);
        }
    }
    if (!pieces) printf("\n");
    free(ids);
    tokenizer_free(t);
    gguf_close(f);
    return 0;
}

/* ==== Version ==== */

void cli_print_kernel_sets(FILE *f) {
    const char *sets[8];
    int n = quant_kernel_sets(sets, 8);
    fprintf(f, "%s (this CPU runs:", quant_kernel_name());
    for (int i = 0; i < n && i < 8; i++) fprintf(f, " %s", sets[i]);
    fprintf(f, ")");
}

void cli_print_version(FILE *f) {
    fprintf(f, "tandem %s (git %s)\n", TANDEM_VERSION, TANDEM_GIT);
#ifdef TANDEM_CUDA
    const char *cuda = "yes";
#else
    const char *cuda = "no";
#endif
    fprintf(f, "backends: cpu, cuda: %s\n", cuda);
    fprintf(f, "cpu kernels: ");
    cli_print_kernel_sets(f);
    fprintf(f, "\n");
    fprintf(f, "compiler: %s\n", __VERSION__);
}

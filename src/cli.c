/* cli.c - `tandem run` and `tandem tokenize`. */
#include "cli.h"

#include <errno.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "generate.h"
#include "handoff.h"
#include "model.h"
#include "quant.h"
#include "sampler.h"
#include "tokenizer.h"

/* ==== Options ==== */

typedef struct {
    const char *model, *prompt, *prompt_file, *kv_type;
    const char *prefill_node, *secret_file, *wire_dtype;   /* remote prefill */
    const char *backend;
    int n_predict, n_threads, n_ctx, n_batch, chat, ids, ignore_eos, verbose, zstd, timeout_ms, device;
    int seed_given;              /* else a fresh seed per run */
    sampler_params sp;
} run_opts;

static void cli_usage_run(void) {
    fprintf(stderr,
        "usage: tandem run -m MODEL.gguf (-p PROMPT | -f FILE) [options]\n"
        "  -n N            tokens to generate (default 128)\n"
        "  -t N            threads (default 2)\n"
        "  -c N            context size (default: the model's, at most 4096)\n"
        "  -b N            prefill chunk size (default 512)\n"
        "  --chat          wrap the prompt in the model's chat template\n"
        "  --ids           print generated token ids instead of text\n"
        "  --ignore-eos    keep generating past end-of-generation tokens\n"
        "  --temp T        temperature (default 0 = greedy)\n"
        "  --top-k K --top-p P --min-p P   sampling filters (defaults 40, 0.95, 0.05)\n"
        "  --seed S        sampling seed, 0 to 2^63-1 (default: a fresh one per run, printed with -v)\n"
        "  --kv-type T     KV cache type: f16 (default), bf16, q8_0\n");
    cli_usage_backend(15);
    fprintf(stderr,
        "Remote prefill (this process decodes; the prompt's KV comes from a prefill node):\n"
        "  --prefill-node HOST:PORT   prefill node to use\n"
        "  --secret-file FILE         shared node secret (or env TANDEM_SECRET)\n"
        "  --wire-dtype T             KV type on the wire: the cache type (default) or q8_0\n"
        "  --zstd                     compress KV frames\n"
        "  --timeout-ms N             give up when no frame arrives for N ms (default 10000)\n");
}

static int cli_int(const char *s, int *out) {
    char *end;
    errno = 0;
    long v = strtol(s, &end, 10);
    if (errno || *end || end == s || v < -1000000000L || v > 1000000000L) return -1;
    *out = (int)v;
    return 0;
}

static int cli_float(const char *s, float *out) {
    char *end;
    errno = 0;
    float v = strtof(s, &end);
    if (errno || *end || end == s) return -1;
    *out = v;
    return 0;
}

static int cli_seed(const char *s, uint64_t *out) {
    char *end;
    errno = 0;
    long long v = strtoll(s, &end, 10);
    if (errno || *end || end == s || v < 0) return -1;
    *out = (uint64_t)v;
    return 0;
}

/* Parses run options; returns 0, or -1 after printing what is wrong. */
static int cli_parse_run(int argc, char **argv, run_opts *o) {
    memset(o, 0, sizeof *o);
    o->n_predict = 128; o->n_threads = 2; o->n_batch = 512; o->kv_type = "f16";
    o->sp = sampler_defaults();
    for (int i = 0; i < argc; i++) {
        const char *a = argv[i];
        const char *v = i + 1 < argc ? argv[i + 1] : NULL;
        int bad = 0, takes = 1;
        if (!strcmp(a, "-m")) o->model = v;
        else if (!strcmp(a, "-p")) o->prompt = v;
        else if (!strcmp(a, "-f")) o->prompt_file = v;
        else if (!strcmp(a, "-n")) bad = !v || cli_int(v, &o->n_predict);
        else if (!strcmp(a, "-t")) bad = !v || cli_int(v, &o->n_threads) || o->n_threads < 1 || o->n_threads > 256;
        else if (!strcmp(a, "-c")) bad = !v || cli_int(v, &o->n_ctx) || o->n_ctx < 1;
        else if (!strcmp(a, "-b")) bad = !v || cli_int(v, &o->n_batch) || o->n_batch < 1;
        else if (!strcmp(a, "--temp")) bad = !v || cli_float(v, &o->sp.temp);
        else if (!strcmp(a, "--top-k")) bad = !v || cli_int(v, &o->sp.top_k);
        else if (!strcmp(a, "--top-p")) bad = !v || cli_float(v, &o->sp.top_p);
        else if (!strcmp(a, "--min-p")) bad = !v || cli_float(v, &o->sp.min_p);
        else if (!strcmp(a, "--seed")) { bad = !v || cli_seed(v, &o->sp.seed); o->seed_given = 1; }
        else if (!strcmp(a, "--kv-type")) o->kv_type = v;
        else if (!strcmp(a, "--backend")) bad = !v || cli_backend_ok(o->backend = v);
        else if (!strcmp(a, "--device")) bad = !v || cli_device_ok(v, &o->device);
        else if (!strcmp(a, "--prefill-node")) o->prefill_node = v;
        else if (!strcmp(a, "--secret-file")) o->secret_file = v;
        else if (!strcmp(a, "--wire-dtype")) o->wire_dtype = v;
        else if (!strcmp(a, "--timeout-ms")) bad = !v || cli_int(v, &o->timeout_ms) || o->timeout_ms < 1;
        else {
            takes = 0;
            if (!strcmp(a, "--chat")) o->chat = 1;
            else if (!strcmp(a, "--ids")) o->ids = 1;
            else if (!strcmp(a, "--ignore-eos")) o->ignore_eos = 1;
            else if (!strcmp(a, "-v")) o->verbose = 1;
            else if (!strcmp(a, "--zstd")) o->zstd = 1;
            else { fprintf(stderr, "tandem run: unknown option %s\n", a); cli_usage_run(); return -1; }
        }
        if (takes && (!v || bad)) { fprintf(stderr, "tandem run: option %s needs a valid value\n", a); return -1; }
        i += takes;
    }
    if (!o->model || (!o->prompt && !o->prompt_file)) { cli_usage_run(); return -1; }
    if (!o->seed_given) o->sp.seed = sampler_fresh_seed();
    return 0;
}

int cli_backend_ok(const char *name) { return name && (!strcmp(name, "cpu") || !strcmp(name, "cuda")) ? 0 : -1; }

int cli_device_ok(const char *s, int *out) {
    char *end;
    errno = 0;
    long v = s ? strtol(s, &end, 10) : -1;
    if (!s || errno || *end || end == s || v < 0 || v > 63) return -1;
    *out = (int)v;
    return 0;
}

void cli_usage_backend(int width) {
    fprintf(stderr, "  %-*s compute on cpu (default) or cuda (a build with make CUDA=1)\n", width, "--backend B");
    fprintf(stderr, "  %-*s CUDA device (default 0)\n", width, "--device N");
}

uint32_t cli_kv_type(const char *s) {
    if (!strcmp(s, "f16")) return GGML_TYPE_F16;
    if (!strcmp(s, "bf16")) return GGML_TYPE_BF16;
    if (!strcmp(s, "q8_0")) return GGML_TYPE_Q8_0;
    return UINT32_MAX;
}

/* Reads a whole file into a NUL-terminated buffer (caller frees). */
char *cli_read_file(const char *path, size_t *len) {
    FILE *f = fopen(path, "rb");
    if (!f) return NULL;
    size_t cap = 4096, n = 0;
    char *buf = malloc(cap);
    while (buf) {
        size_t r = fread(buf + n, 1, cap - n - 1, f);
        n += r;
        if (r == 0) break;
        if (cap - n - 1 == 0) { char *nb = realloc(buf, cap * 2); if (!nb) { free(buf); buf = NULL; break; } buf = nb; cap *= 2; }
    }
    fclose(f);
    if (buf) { buf[n] = 0; if (len) *len = n; }
    return buf;
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
    uint32_t wdt = o->wire_dtype ? cli_kv_type(o->wire_dtype) : kvt;
    if (wdt == UINT32_MAX) { snprintf(err, errlen, "unknown wire dtype %s", o->wire_dtype); return -1; }
    char *secret = NULL;
    size_t slen = 0;
    if (cli_load_secret(o->secret_file, &secret, &slen, err, errlen)) return -1;
    handoff_opts ho = { .wire_dtype = wdt, .zstd = o->zstd, .timeout_ms = o->timeout_ms,
                        .secret = secret, .secret_len = slen, .node_id = "tandem-run" };
    handoff_client *c = NULL;
    double t0 = gen_now_ms();
    int rc = handoff_connect(&c, o->prefill_node, m, kvt, &ho, err, errlen);
    free(secret);
    if (rc) return -1;
    rr->connect_ms = gen_now_ms() - t0;
    rc = handoff_prefill(c, s, ids, n, 0, &rr->hs, err, errlen);
    handoff_close(c);
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

/* Builds the prompt text (chat-wrapped if asked) and tokenizes it. */
int32_t *cli_tokenize_prompt(model *m, const char *text, int chat, int *n_out, char *err, size_t errlen) {
    const tokenizer *tok = model_get_tokenizer(m);
    char *owned = NULL;
    if (chat) {
        enum chat_format fmt = chat_detect(model_get_gguf(m), err, errlen);
        if (fmt == CHAT_NONE) return NULL;
        chat_msg msg = { "user", text };
        owned = chat_render(fmt, &msg, 1, 1);
        if (!owned) { snprintf(err, errlen, "chat template rendering failed"); return NULL; }
        text = owned;
    }
    size_t len = strlen(text);
    int64_t need = tokenizer_encode(tok, text, len, 1, 1, NULL, 0);
    int32_t *ids = need > 0 ? malloc(sizeof(int32_t) * (size_t)need) : NULL;
    if (!ids || tokenizer_encode(tok, text, len, 1, 1, ids, need) != need) {
        snprintf(err, errlen, need == 0 ? "the prompt is empty" : "tokenization failed");
        free(ids); free(owned);
        return NULL;
    }
    free(owned);
    *n_out = (int)need;
    return ids;
}

int cli_run(int argc, char **argv) {
    run_opts o;
    if (cli_parse_run(argc, argv, &o)) return 2;
    char err[512];
    uint32_t kvt = cli_kv_type(o.kv_type);
    if (kvt == UINT32_MAX) { fprintf(stderr, "tandem run: unknown KV type %s\n", o.kv_type); return 2; }
    char *text = NULL;
    if (o.prompt_file && !(text = cli_read_file(o.prompt_file, NULL))) {
        fprintf(stderr, "tandem run: cannot read %s\n", o.prompt_file);
        return 1;
    }
    model_opts mo = { .n_threads = o.n_threads, .n_batch = o.n_batch, .backend = o.backend, .device = o.device };
    model *m = NULL;
    session *s = NULL;
    sampler *smp = NULL;
    int32_t *ids = NULL;
    float *logits = NULL;
    int rc = 1, n_prompt = 0;
    if (model_load(&m, o.model, &mo, err, sizeof err)) { fprintf(stderr, "tandem: %s: %s\n", o.model, err); goto out; }
    const model_hparams *hp = model_get_hparams(m);
    int n_ctx = o.n_ctx ? o.n_ctx : (hp->n_ctx_train < 4096 ? hp->n_ctx_train : 4096);
    if (!(ids = cli_tokenize_prompt(m, text ? text : o.prompt, o.chat, &n_prompt, err, sizeof err))) {
        fprintf(stderr, "tandem: %s\n", err); goto out;
    }
    if (session_new(&s, m, n_ctx, kvt, err, sizeof err)) { fprintf(stderr, "tandem: %s\n", err); goto out; }
    smp = sampler_new(&o.sp, hp->n_vocab);
    logits = malloc(sizeof(float) * (size_t)hp->n_vocab);
    if (!smp || !logits) { fprintf(stderr, "tandem: out of memory\n"); goto out; }
    run_print rp = { .ids = o.ids, .first = 1 };
    tok_stream_init_prompt(&rp.ts, model_get_tokenizer(m), ids, n_prompt);
    gen_opts go = { .max_tokens = o.n_predict, .ignore_eos = o.ignore_eos, .on_token = run_on_token, .ud = &rp };
    gen_stats st;
    run_remote rr;
    if (o.prefill_node && run_remote_prefill(m, s, &o, kvt, ids, n_prompt, logits, &rr, err, sizeof err)) {
        fprintf(stderr, "tandem: %s\n", err); goto out;
    }
    if (generate_run(m, s, smp, ids, n_prompt, logits, o.prefill_node != NULL, &go, &st, err, sizeof err)) {
        fprintf(stderr, "\ntandem: %s\n", err); goto out;
    }
    if (!o.ids) {
        char buf[16];
        int n = tok_stream_flush(&rp.ts, buf, sizeof buf);
        if (n > 0) fwrite(buf, 1, (size_t)n, stdout);
    }
    printf("\n");
    fflush(stdout);
    if (o.prefill_node) {
        const handoff_stats *h = &rr.hs;
        st.n_prompt = n_prompt;
        st.prompt_ms = rr.connect_ms + h->total_ms + rr.last_ms;
        fprintf(stderr, "handoff: %d positions received from %s (computed remotely %d, locally %d), "
                "KV %llu bytes, wire %llu bytes, %.1f ms (connect %.1f ms, remote compute %.1f ms, "
                "transfer tail %.1f ms, last token %.1f ms)\n",
                h->n_sent, o.prefill_node, h->n_computed_remote, h->n_computed_local,
                (unsigned long long)h->kv_bytes, (unsigned long long)h->wire_bytes, h->total_ms,
                rr.connect_ms, h->prefill_ms_remote, h->transfer_tail_ms, rr.last_ms);
    }
    fprintf(stderr, "prompt: %d tokens in %.1f ms (%.2f t/s)\n", st.n_prompt, st.prompt_ms,
            st.prompt_ms > 0 ? st.n_prompt * 1e3 / st.prompt_ms : 0.0);
    fprintf(stderr, "generation: %d tokens in %.1f ms (%.2f t/s)\n", st.n_gen, st.gen_ms,
            st.n_gen > 1 && st.gen_ms > 0 ? (st.n_gen - 1) * 1e3 / st.gen_ms : 0.0);
    if (o.sp.temp > 0)   /* --seed with this value replays the run */
        fprintf(stderr, "sampling: seed %llu, temp %g, top_k %d, top_p %g, min_p %g\n", (unsigned long long)o.sp.seed,
                o.sp.temp, o.sp.top_k, o.sp.top_p, o.sp.min_p);
    rc = 0;
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

int cli_tokenize(int argc, char **argv) {
    const char *path = NULL, *prompt = NULL;
    int no_special = 0, pieces = 0;
    for (int i = 0; i < argc; i++) {
        if (!strcmp(argv[i], "-m") && i + 1 < argc) path = argv[++i];
        else if (!strcmp(argv[i], "-p") && i + 1 < argc) prompt = argv[++i];
        else if (!strcmp(argv[i], "--no-parse-special")) no_special = 1;
        else if (!strcmp(argv[i], "--pieces")) pieces = 1;
        else { fprintf(stderr, "usage: tandem tokenize -m MODEL.gguf -p TEXT [--no-parse-special] [--pieces]\n"); return 2; }
    }
    if (!path || !prompt) { fprintf(stderr, "usage: tandem tokenize -m MODEL.gguf -p TEXT [--no-parse-special] [--pieces]\n"); return 2; }
    char err[512];
    gguf_file *f = NULL;
    tokenizer *t = NULL;
    if (gguf_open_file(&f, path, err, sizeof err) || tokenizer_load(&t, f, err, sizeof err)) {
        fprintf(stderr, "tandem: %s: %s\n", path, err);
        gguf_close(f);
        return 1;
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

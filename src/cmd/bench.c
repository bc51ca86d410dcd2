/* bench.c - `tandem bench`: prompt-processing and generation speed in
 * llama-bench's format, followed by the machine's bounds for this model.
 *
 * Speed table: for every thread count and test, one warm-up run, then -r
 * timed repetitions, "mean ± sd" tokens per second.
 *   ppN: N random tokens evaluated in one call on an empty cache (prefill in
 *        chunks of -b, default 512), logits of the last token only;
 *   tgN: N single-token evaluations of random tokens starting from an empty
 *        cache, each producing logits (what llama-bench's tg measures).
 *   "@ dD": the same after D random tokens in the cache (-d D for every test,
 *        or -gp D,N for one tgN at depth D); the D tokens are evaluated once,
 *        untimed, and each repetition starts again from position D.
 * The kernel set in use (quant.h: cpuid or TANDEM_KERNELS) is printed first.
 * Bounds table: measured streaming-read bandwidth against the bytes of weight
 * read per decoded token (the decode roofline), and the model's FLOPs per
 * prompt token against a measured compute ceiling of the matmul kernel.
 */
#include "cmd/cli.h"

#include <errno.h>
#include <jansson.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#if defined(__x86_64__)
#include <immintrin.h>
/* The AVX2 loops below are compiled for AVX2 alone and run only where cpuid
 * says the CPU has it: the rest of the build targets baseline x86-64. */
#define BENCH_AVX2 1
#define BENCH_TARGET_AVX2 __attribute__((target("avx2")))
#define BENCH_TARGET_AVX512 __attribute__((target("avx512f,avx512bw,avx512vnni")))
#endif

#include "base/cliopt.h"
#include "cmd/bench_spec.h"
#include "engine/gguf.h"
#include "base/hugemap.h"
#include "engine/kvcache.h"
#include "engine/model.h"
#include "engine/quant.h"
#include "base/threadpool.h"
#ifdef TANDEM_CUDA
#include "backend/cuda/backend_cuda.h"
#endif

/* ==== Options ==== */

#define BENCH_MAX_LIST 16
#define BENCH_MAX_PAR 64      /* -np: sessions decoding together */

typedef struct {
    int v[BENCH_MAX_LIST];
    int n;
} bench_list;

typedef struct {
    const char *model, *kv_name, *backend;
    int device;
    uint32_t kv_type;
    bench_list threads, pp, tg;
    int reps, n_batch, bounds, cuda_bounds;
    int depth;                /* -d: cache depth of every test */
    int gp_depth, gp_n;       /* -gp D,N: one tgN at depth D (0 = none) */
    int n_par;                /* -np P: each tgN again with P sequences decoding together (0 = none) */
    int bw_mib;
    int fmt;                  /* -o: BENCH_MD, BENCH_JSON, BENCH_CSV */
} bench_opts;

enum { BENCH_MD, BENCH_JSON, BENCH_CSV };
static const char *const bench_fmt_names[] = { "md", "json", "csv", NULL };

#define BENCH "tandem bench"

static void bench_usage(FILE *f) {
    fprintf(f,
        "usage: tandem bench -m MODEL.gguf [options]\n"
        "  -t N[,N..]     threads (default 2)\n"
        "  -r N           repetitions after one warm-up (default 5)\n"
        "  -p N[,N..]     prompt lengths for ppN tests (default 512; 0 = none)\n"
        "  -n N[,N..]     generation lengths for tgN tests (default 128; 0 = none)\n"
        "  -d N           run every test at a cache depth of N tokens (default 0)\n"
        "  -gp D,N        also a tgN test at depth D\n"
        "  -np P          also each tgN with P sequences decoding together, 2..64 (a row\n"
        "                 \"tgN xP\": one token of each sequence per pass, aggregate t/s)\n"
        "  -b N           prefill chunk size (default: the backend's, 512 on the CPU, 4096 with cuda)\n"
        "  --kv-type T    f16 (default), bf16, q8_0\n"
        "  --bw-mib N     size of the bandwidth test buffer in MiB (default 1024)\n"
        "  --no-bounds    skip the bandwidth / compute bounds table (with cuda: the cuBLAS ceiling)\n"
        "  -o FMT         md (default: markdown tables, bounds included), json (an array of\n"
        "                 one object per test) or csv (a header line, then one line per test);\n"
        "                 json and csv carry the speed tests only and are printed at the end\n"
        "  --draft-model FILE | --lookup N   speculative mode: plain and speculative\n"
        "                 decoding side by side (tandem bench --lookup 1 --help)\n");
    cliopt_usage_backend(f, 14);
}

/* "512" or "128,256,512" */
static int bench_parse_list(const char *s, bench_list *l);

/* A list option; says what is wrong when it is. */
static int bench_list_opt(const char *opt, const char *v, bench_list *l) {
    if (!v) { fprintf(stderr, BENCH ": %s needs a value\n", opt); return -1; }
    if (bench_parse_list(v, l) == 0) return 0;
    fprintf(stderr, BENCH ": %s: '%s' is not a list of at most %d numbers in [0, 1000000], like 128,256\n",
            opt, v, BENCH_MAX_LIST);
    return -1;
}

static int bench_parse_list(const char *s, bench_list *l) {
    l->n = 0;
    while (s && *s) {
        if (l->n == BENCH_MAX_LIST) return -1;
        char *end;
        errno = 0;
        long v = strtol(s, &end, 10);
        if (errno || end == s || v < 0 || v > 1000000L || (*end && *end != ',')) return -1;
        l->v[l->n++] = (int)v;
        s = *end ? end + 1 : end;
    }
    return l->n ? 0 : -1;
}

static int bench_parse(int argc, char **argv, bench_opts *o) {
    memset(o, 0, sizeof *o);
    o->reps = 5; o->n_batch = 0; o->bounds = 1; o->bw_mib = 1024;
    o->kv_name = "f16";
    bench_parse_list("2", &o->threads);
    bench_parse_list("512", &o->pp);
    bench_parse_list("128", &o->tg);
    int k;
    for (int i = 0; i < argc; i++) {
        const char *a = argv[i], *v = i + 1 < argc ? argv[i + 1] : NULL;
        int bad = 0, takes = 1;
        if (!strcmp(a, "-m")) bad = cliopt_str(BENCH, a, v, &o->model);
        else if (!strcmp(a, "-t")) bad = bench_list_opt(a, v, &o->threads);
        else if (!strcmp(a, "-p")) bad = bench_list_opt(a, v, &o->pp);
        else if (!strcmp(a, "-n")) bad = bench_list_opt(a, v, &o->tg);
        else if (!strcmp(a, "-r")) bad = cliopt_int(BENCH, a, v, 1, 100000, &o->reps);
        else if (!strcmp(a, "-b")) bad = cliopt_int(BENCH, a, v, 1, 1 << 16, &o->n_batch);
        else if (!strcmp(a, "-d")) bad = cliopt_int(BENCH, a, v, 0, 1000000, &o->depth);
        else if (!strcmp(a, "-np")) bad = cliopt_int(BENCH, a, v, 2, BENCH_MAX_PAR, &o->n_par);
        else if (!strcmp(a, "-gp")) {
            bench_list l;
            bad = !v || bench_parse_list(v, &l) || l.n != 2 || l.v[1] < 1;
            if (!bad) { o->gp_depth = l.v[0]; o->gp_n = l.v[1]; }
            else fprintf(stderr, BENCH ": -gp needs DEPTH,N (N >= 1), got '%s'\n", v ? v : "");
        }
        else if (!strcmp(a, "--kv-type")) bad = cliopt_choice(BENCH, a, v, kv_dtype_names, &k) || cliopt_str(BENCH, a, v, &o->kv_name);
        else if (!strcmp(a, "--bw-mib")) bad = cliopt_int(BENCH, a, v, 16, 1 << 20, &o->bw_mib);
        else if (!strcmp(a, "--backend")) bad = cliopt_backend(BENCH, v, &o->backend);
        else if (!strcmp(a, "--device")) bad = cliopt_int(BENCH, a, v, 0, 63, &o->device);
        else if (!strcmp(a, "-o")) bad = cliopt_choice(BENCH, a, v, bench_fmt_names, &o->fmt);
        else {
            takes = 0;
            if (!strcmp(a, "--no-bounds")) o->bounds = 0;
            else if (cliopt_is_help(a)) { bench_usage(stdout); return 1; }
            else { fprintf(stderr, BENCH ": unknown option %s (see tandem bench --help)\n", a); return -1; }
        }
        if (bad) return -1;   /* the message is out */
        i += takes;
    }
    for (int i = 0; i < o->threads.n; i++)
        if (o->threads.v[i] < 1 || o->threads.v[i] > 256) {
            fprintf(stderr, BENCH ": -t: %d is out of range [1, 256]\n", o->threads.v[i]);
            return -1;
        }
    if (!o->model) { if (argc) fprintf(stderr, BENCH ": give -m MODEL.gguf\n"); bench_usage(stderr); return -1; }
    if (o->fmt != BENCH_MD) o->bounds = 0;   /* the bounds are a markdown table of their own */
    o->kv_type = kv_dtype_parse(o->kv_name);
    /* the bounds are the CPU's (memory bandwidth, SIMD peak) */
    o->cuda_bounds = o->bounds;   /* with cuda: the cuBLAS ceiling instead */
    if (o->backend && strcmp(o->backend, "cpu")) o->bounds = 0;
    return 0;
}

/* ==== Small utilities ==== */

static double bench_now(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double)ts.tv_sec + ts.tv_nsec * 1e-9;
}

static void bench_mean_sd(const double *x, int n, double *mean, double *sd) {
    double s = 0, q = 0;
    for (int i = 0; i < n; i++) s += x[i];
    *mean = s / n;
    for (int i = 0; i < n; i++) q += (x[i] - *mean) * (x[i] - *mean);
    *sd = n > 1 ? sqrt(q / (n - 1)) : 0.0;
}

/* A fixed xorshift stream for the random prompt tokens (llama-bench uses
 * random tokens too; the values do not affect dense-model speed). */
static uint32_t bench_rand(uint64_t *s) {
    *s ^= *s << 13; *s ^= *s >> 7; *s ^= *s << 17;
    return (uint32_t)(*s >> 16);
}

/* ==== Model description ==== */

typedef struct {
    uint64_t params, active_params, tensor_bytes;
    char desc[96];
    uint32_t main_type;       /* type of the first FFN weight */
    const char *backend;      /* "CPU", "CUDA" or "MLX" */
    int n_batch;              /* rows per pass: -b, else the backend's */
} bench_info;

static const char *bench_ftype_name(uint32_t ft) {
    switch (ft) {
    case 0: return "all F32";
    case 1: return "F16";
    case 2: return "Q4_0";
    case 3: return "Q4_1";
    case 7: return "Q8_0";
    case 8: return "Q5_0";
    case 9: return "Q5_1";
    case 14: return "Q4_K - Small";
    case 15: return "Q4_K - Medium";
    case 17: return "Q5_K - Medium";
    case 18: return "Q6_K";
    case 32: return "BF16";
    default: return NULL;
    }
}

/* "0.6B", "1.5B", "30B", "40M" */
static void bench_size_label(uint64_t n, char *buf, size_t len) {
    if (n >= 10000000000ull) snprintf(buf, len, "%.0fB", n / 1e9);
    else if (n >= 100000000ull) snprintf(buf, len, "%.1fB", n / 1e9);
    else snprintf(buf, len, "%.0fM", n / 1e6);
}

static void bench_describe(model *m, bench_info *bi) {
    const gguf_file *f = model_get_gguf(m);
    const model_hparams *hp = model_get_hparams(m);
    memset(bi, 0, sizeof *bi);
    const char *bn = model_get_backend(m)->ops->name;
    bi->backend = !strcmp(bn, "cuda") ? "CUDA" : !strcmp(bn, "mlx") ? "MLX" : "CPU";
    bi->n_batch = model_get_n_batch(m);
    uint64_t expert_params = 0;
    for (int64_t i = 0; i < gguf_count_tensors(f); i++) {
        const gguf_tensor *t = gguf_get_tensor(f, i);
        uint64_t n = t->ne[0] * t->ne[1] * t->ne[2] * t->ne[3];
        bi->params += n;
        bi->tensor_bytes += t->nbytes;
        if (t->ne[2] > 1 && hp->n_expert > 1) expert_params += n;
    }
    bi->active_params = bi->params;
    if (hp->n_expert > 1)
        bi->active_params -= expert_params / (uint64_t)hp->n_expert * (uint64_t)(hp->n_expert - hp->n_expert_used);
    const gguf_tensor *t = gguf_find_tensor(f, "blk.0.ffn_up.weight");
    if (!t) t = gguf_find_tensor(f, "blk.0.ffn_up_exps.weight");
    bi->main_type = t ? t->type : GGML_TYPE_F32;
    uint32_t ft = UINT32_MAX;
    const char *tn = gguf_get_u32(f, "general.file_type", &ft) == 0 ? bench_ftype_name(ft) : NULL;
    char total[24], active[24];
    bench_size_label(bi->params, total, sizeof total);
    bench_size_label(bi->active_params, active, sizeof active);
    if (hp->n_expert > 1)
        snprintf(bi->desc, sizeof bi->desc, "%s %s.A%s %s", hp->arch_name, total, active, tn ? tn : model_type_summary(m));
    else
        snprintf(bi->desc, sizeof bi->desc, "%s %s %s", hp->arch_name, total, tn ? tn : model_type_summary(m));
}

static void bench_fmt_bytes(uint64_t b, char *buf, size_t len) {
    if (b >= (1ull << 30)) snprintf(buf, len, "%.2f GiB", b / 1073741824.0);
    else snprintf(buf, len, "%.2f MiB", b / 1048576.0);
}

static void bench_fmt_params(uint64_t n, char *buf, size_t len) {
    if (n >= 1000000000ull) snprintf(buf, len, "%.2f B", n / 1e9);
    else snprintf(buf, len, "%.2f M", n / 1e6);
}

/* ==== Speed tests ==== */

/* One timed ppN run: seconds, or < 0 on error. */
static double bench_pp_once(model *m, session *s, int depth, int n, int32_t *ids, float *logits, uint64_t *rng,
                            char *err, size_t errlen) {
    int n_vocab = model_get_hparams(m)->n_vocab;
    for (int i = 0; i < n; i++) ids[i] = (int32_t)(bench_rand(rng) % (uint32_t)n_vocab);
    session_reset(s, depth);
    double t0 = bench_now();
    if (model_eval(m, s, ids, n, logits, NULL, NULL, err, errlen)) return -1;
    return bench_now() - t0;
}

/* One timed tgN run of P sessions decoding together (P >= 1): one token of
 * each per pass (model_eval_batch), as a server's decode step for P
 * requests. */
static double bench_tg_once(model *m, session *const *s, int P, int depth, int n, float *logits, uint64_t *rng,
                            char *err, size_t errlen) {
    int n_vocab = model_get_hparams(m)->n_vocab;
    int32_t ids[BENCH_MAX_PAR];
    model_batch_item it[BENCH_MAX_PAR];
    for (int j = 0; j < P; j++) session_reset(s[j], depth);
    double t0 = bench_now();
    for (int i = 0; i < n; i++) {
        for (int j = 0; j < P; j++) {
            ids[j] = (int32_t)(bench_rand(rng) % (uint32_t)n_vocab);
            it[j] = (model_batch_item){ .s = s[j], .ids = &ids[j], .n = 1, .logits = logits + (size_t)j * n_vocab };
        }
        if (model_eval_batch(m, it, P, err, errlen)) return -1;
    }
    return bench_now() - t0;
}

typedef struct {
    int is_pp, n, threads, depth;
    int n_par;                /* sequences decoding together (1 but for -np rows) */
    double mean, sd;          /* tokens per second (all sequences together) */
    /* generation with bounds, per repetition: its t/s over the mean of the
     * readings just before and after it; the median over the reps whose two
     * readings agree within BENCH_BW_AGREE (over all reps when none do) */
    double per_bw;                /* t/s per byte/s */
    int n_agree;
    double bw_lo, bw_hi;          /* the lowest and highest reading */
} bench_result;

/* Two bandwidth readings agree when they differ by at most this fraction
 * of their mean. */
#define BENCH_BW_AGREE 0.15

/* Fill the cache with `depth` random tokens (untimed; prefill in chunks of
 * n_batch inside model_eval), unless it holds them already. */
static int bench_fill(model *m, session *s, int depth, float *logits, char *err, size_t errlen) {
    if (session_pos(s) >= depth) return 0;
    int n_vocab = model_get_hparams(m)->n_vocab;
    int32_t *ids = malloc(sizeof(int32_t) * (size_t)(depth > 0 ? depth : 1));
    if (!ids) { snprintf(err, errlen, "out of memory"); return -1; }
    uint64_t rng = 0xD1B54A32D192ED03ull;
    for (int i = 0; i < depth; i++) ids[i] = (int32_t)(bench_rand(&rng) % (uint32_t)n_vocab);
    session_reset(s, 0);
    int rc = model_eval(m, s, ids, depth, logits, NULL, NULL, err, errlen);
    free(ids);
    return rc;
}

/* a bandwidth reader (below) */
typedef struct bench_bw_reader bench_bw_reader;
static double bench_bw_read(bench_bw_reader *rd);

static int bench_cmp_double(const void *a, const void *b) {
    double x = *(const double *)a, y = *(const double *)b;
    return x < y ? -1 : x > y;
}

/* r->per_bw, r->n_agree, r->bw_lo/hi from reps t/s figures and the reps + 1
 * readings around them (bw[i] before rep i, bw[i + 1] after it); q is
 * scratch for reps values. */
static void bench_per_bw(bench_result *r, const double *tps, const double *bw, int reps, double *q) {
    r->bw_lo = r->bw_hi = bw[0];
    for (int i = 0; i <= reps; i++) {
        if (bw[i] < r->bw_lo) r->bw_lo = bw[i];
        if (bw[i] > r->bw_hi) r->bw_hi = bw[i];
    }
    r->n_agree = 0;
    for (int i = 0; i < reps; i++) {   /* the agreeing reps first */
        double mean = (bw[i] + bw[i + 1]) / 2;
        if (mean > 0 && fabs(bw[i] - bw[i + 1]) <= BENCH_BW_AGREE * mean) q[r->n_agree++] = tps[i] / mean;
    }
    int nq = r->n_agree;
    for (int i = 0; i < reps && r->n_agree == 0; i++) {   /* failing those, all */
        double mean = (bw[i] + bw[i + 1]) / 2;
        if (mean > 0) q[nq++] = tps[i] / mean;
    }
    qsort(q, (size_t)nq, sizeof *q, bench_cmp_double);
    r->per_bw = nq == 0 ? 0 : nq % 2 ? q[nq / 2] : (q[nq / 2 - 1] + q[nq / 2]) / 2;
}

/* Warm-up then o->reps timed runs, as llama-bench: the warm-up is the whole
 * prompt for pp and a single token for tg. pp runs in ps[0]; tg decodes in
 * the P sessions ps together (P = 1 but for the -np rows). */
static int bench_run_test(model *m, session *const *ps, int P, const bench_opts *o, int is_pp, int depth, int n,
                          bench_bw_reader *rd, bench_result *r, char *err, size_t errlen) {
    const model_hparams *hp = model_get_hparams(m);
    if (is_pp) P = 1;
    float *logits = malloc(sizeof(float) * (size_t)hp->n_vocab * (size_t)P);
    int32_t *ids = malloc(sizeof(int32_t) * (size_t)(n > 0 ? n : 1));
    double *tps = malloc(sizeof(double) * (size_t)o->reps);
    /* rd (generation with bounds): a bandwidth reading before each rep and after the last */
    double *bw = rd ? calloc((size_t)o->reps + 1, sizeof(double)) : NULL;
    double *q = rd ? calloc((size_t)o->reps, sizeof(double)) : NULL;
    uint64_t rng = 0x9E3779B97F4A7C15ull ^ (uint64_t)n;
    int rc = -1;
    if (!logits || !ids || !tps || (rd && (!bw || !q))) { snprintf(err, errlen, "out of memory"); goto out; }
    for (int j = 0; j < P; j++) {
        if (depth > 0 && bench_fill(m, ps[j], depth, logits, err, errlen)) goto out;
        if (depth == 0) session_reset(ps[j], 0);
    }
    double t = is_pp ? bench_pp_once(m, ps[0], depth, n, ids, logits, &rng, err, errlen)
                     : bench_tg_once(m, ps, P, depth, 1, logits, &rng, err, errlen);
    for (int i = 0; i < o->reps && t >= 0; i++) {
        if (bw) {   /* the reading evicts the caches: the warm-up token again after it */
            bw[i] = bench_bw_read(rd);
            if (bench_tg_once(m, ps, P, depth, 1, logits, &rng, err, errlen) < 0) { t = -1; break; }
        }
        t = is_pp ? bench_pp_once(m, ps[0], depth, n, ids, logits, &rng, err, errlen)
                  : bench_tg_once(m, ps, P, depth, n, logits, &rng, err, errlen);
        tps[i] = t > 0 ? (double)n * P / t : 0.0;
    }
    if (t < 0) goto out;
    if (bw) {
        bw[o->reps] = bench_bw_read(rd);
        bench_per_bw(r, tps, bw, o->reps, q);
    }
    r->is_pp = is_pp;
    r->n = n;
    r->depth = depth;
    r->n_par = P;
    bench_mean_sd(tps, o->reps, &r->mean, &r->sd);
    rc = 0;
out:
    free(logits); free(ids); free(tps); free(bw); free(q);
    return rc;
}

static void bench_print_header(void) {
    printf("kernels: ");
    cli_print_kernel_sets(stdout);
    printf(", TANDEM_KERNELS=NAME forces one\n\n");
    printf("| %-30s | %10s | %10s | %-10s | %7s | %15s | %20s |\n", "model", "size", "params", "backend",
           "threads", "test", "t/s");
    printf("| ------------------------------ | ---------: | ---------: | ---------- | ------: | --------------: | -------------------: |\n");
}

/* "pp512", "tg128 @ d4096", "tg64 x8": the test's name in every format */
static void bench_test_name(const bench_result *r, char *buf, size_t len) {
    char par[16] = "";
    if (r->n_par > 1) snprintf(par, sizeof par, " x%d", r->n_par);
    if (r->depth) snprintf(buf, len, "%s%d%s @ d%d", r->is_pp ? "pp" : "tg", r->n, par, r->depth);
    else snprintf(buf, len, "%s%d%s", r->is_pp ? "pp" : "tg", r->n, par);
}

static void bench_print_row(const bench_info *bi, const bench_result *r) {
    char size[32], params[32], test[48], tps[48];
    bench_fmt_bytes(bi->tensor_bytes, size, sizeof size);
    bench_fmt_params(bi->params, params, sizeof params);
    bench_test_name(r, test, sizeof test);
    snprintf(tps, sizeof tps, "%.2f ± %.2f", r->mean, r->sd);
    printf("| %-30s | %10s | %10s | %-10s | %7d | %15s | %20s |\n", bi->desc, size, params, bi->backend,
           r->threads, test, tps);
    fflush(stdout);
}

/* ==== Machine-readable output (-o json|csv) ==== */


static json_t *bench_json_row(const bench_opts *o, const bench_info *bi, const bench_result *r) {
    char test[48];
    bench_test_name(r, test, sizeof test);
    return json_pack("{s:s, s:I, s:I, s:s, s:s, s:i, s:i, s:s, s:s, s:i, s:i, s:i, s:i, s:i, s:f, s:f}",
                     "model", bi->desc, "size_bytes", (json_int_t)bi->tensor_bytes, "n_params", (json_int_t)bi->params,
                     "backend", bi->backend, "kernels", quant_kernel_name(), "n_threads", r->threads,
                     "n_batch", bi->n_batch, "kv_type", o->kv_name, "test", test,
                     "n_prompt", r->is_pp ? r->n : 0, "n_gen", r->is_pp ? 0 : r->n, "n_depth", r->depth,
                     "n_parallel", r->n_par,
                     "reps", o->reps, "avg_ts", r->mean, "stddev_ts", r->sd);
}

static int bench_print_json(const bench_opts *o, const bench_info *bi, const bench_result *res, int n_res) {
    json_t *arr = json_array();
    for (int i = 0; arr && i < n_res; i++) {
        json_t *row = bench_json_row(o, bi, &res[i]);
        if (!row || json_array_append_new(arr, row)) { json_decref(arr); arr = NULL; }
    }
    char *txt = arr ? json_dumps(arr, JSON_INDENT(2) | JSON_PRESERVE_ORDER) : NULL;
    json_decref(arr);
    if (!txt) return -1;
    printf("%s\n", txt);
    free(txt);
    return 0;
}

/* The model description is the only free text: quoted, quotes doubled (RFC 4180). */
static void bench_csv_str(const char *s) {
    putchar('"');
    for (; *s; s++) { if (*s == '"') putchar('"'); putchar(*s); }
    putchar('"');
}

static void bench_print_csv(const bench_opts *o, const bench_info *bi, const bench_result *res, int n_res) {
    printf("model,size_bytes,n_params,backend,kernels,n_threads,n_batch,kv_type,test,n_prompt,n_gen,n_depth,reps,"
           "avg_ts,stddev_ts\n");
    for (int i = 0; i < n_res; i++) {
        const bench_result *r = &res[i];
        char test[48];
        bench_test_name(r, test, sizeof test);
        bench_csv_str(bi->desc);
        printf(",%llu,%llu,%s,%s,%d,%d,%s,%s,%d,%d,%d,%d,%.4f,%.4f\n", (unsigned long long)bi->tensor_bytes,
               (unsigned long long)bi->params, bi->backend, quant_kernel_name(), r->threads, bi->n_batch, o->kv_name,
               test, r->is_pp ? r->n : 0, r->is_pp ? 0 : r->n, r->depth, o->reps, r->mean, r->sd);
    }
}

/* ==== Memory bandwidth ==== */

typedef struct {
    const uint8_t *buf;
    size_t size;
    uint64_t sink[64];
} bw_job;

#if defined(BENCH_AVX2)
BENCH_TARGET_AVX2 static uint64_t bw_read_avx2(const uint8_t *p, const uint8_t *e) {
    __m256i a0 = _mm256_setzero_si256(), a1 = a0, a2 = a0, a3 = a0;
    for (; p < e; p += 128) {
        a0 = _mm256_xor_si256(a0, _mm256_load_si256((const __m256i *)p));
        a1 = _mm256_xor_si256(a1, _mm256_load_si256((const __m256i *)(p + 32)));
        a2 = _mm256_xor_si256(a2, _mm256_load_si256((const __m256i *)(p + 64)));
        a3 = _mm256_xor_si256(a3, _mm256_load_si256((const __m256i *)(p + 96)));
    }
    __m256i a = _mm256_xor_si256(_mm256_xor_si256(a0, a1), _mm256_xor_si256(a2, a3));
    uint64_t v[4];
    _mm256_storeu_si256((__m256i *)v, a);
    return v[0] ^ v[1] ^ v[2] ^ v[3];
}
#endif

/* Streams this thread's slice of the buffer through wide loads. Four
 * independent accumulators keep enough loads in flight to saturate memory. */
static void bw_read(void *ctx, int ith, int nth) {
    bw_job *j = ctx;
    long lo, hi;
    long nblk = (long)(j->size / 128);
    tpool_split(nblk, ith, nth, &lo, &hi);
    const uint8_t *p = j->buf + (size_t)lo * 128, *e = j->buf + (size_t)hi * 128;
#if defined(BENCH_AVX2)
    if (__builtin_cpu_supports("avx2")) { j->sink[ith % 64] = bw_read_avx2(p, e); return; }
#endif
    uint64_t a0 = 0, a1 = 0, a2 = 0, a3 = 0;
    for (; p < e; p += 32) {
        uint64_t w[4];
        memcpy(w, p, 32);
        a0 ^= w[0]; a1 ^= w[1]; a2 ^= w[2]; a3 ^= w[3];
    }
    j->sink[ith % 64] = a0 ^ a1 ^ a2 ^ a3;
}

/* The quick measurement before each repetition of a generation test and
 * after the last (at most this, at most --bw-mib): 256 MiB is still 8 times
 * a 32 MiB L3, and it takes a fraction of a second. */
#define BENCH_BW_AROUND_MIB 256

/* The buffer is on transparent huge pages (hugemap.h), as the CPU backend
 * keeps its packed weights: the bound is then the best the machine streams.
 * On 4 KiB pages the same read was 10-13% slower (AMD EPYC Zen 4, 2 threads,
 * 1 GiB, pages alternated in one process: 29.4-30.6 vs 33.2-33.8 GB/s), and
 * decode steps over huge-page weights came out above 100% of it. */
struct bench_bw_reader {
    tpool *pool;
    uint8_t *buf;
    size_t size, mapped;
};

static void bench_bw_close(bench_bw_reader *rd) {
    if (rd->pool) tpool_destroy(rd->pool);
    hugemap_free(rd->buf, rd->mapped);
    *rd = (bench_bw_reader){ 0 };
}

/* A buffer of mib MiB, every page touched (the lines given distinct
 * values), and n_threads threads to read it; 0, or -1 (rd closed). */
static int bench_bw_open(bench_bw_reader *rd, int n_threads, int mib) {
    *rd = (bench_bw_reader){ .size = (size_t)mib << 20 };
    rd->buf = hugemap_alloc(rd->size, &rd->mapped);
    rd->pool = tpool_create(n_threads);
    if (!rd->buf || !rd->pool) { bench_bw_close(rd); return -1; }
    for (size_t i = 0; i < rd->size; i += 4096) memset(rd->buf + i, (int)(i >> 12), 4096);
    return 0;
}

/* Best of 5 full passes over the buffer, bytes per second (0 if rd is not open). */
static double bench_bw_read(bench_bw_reader *rd) {
    double best = 0;
    if (!rd->buf) return 0;
    bw_job j = { rd->buf, rd->size, { 0 } };
    for (int rep = 0; rep < 5; rep++) {
        double t0 = bench_now();
        tpool_run(rd->pool, bw_read, &j);
        double dt = bench_now() - t0;
        if (dt > 0 && rd->size / dt > best) best = rd->size / dt;
    }
    return best;
}

/* One reading of a buffer of mib MiB, bytes per second (0 if it could not be set up). */
static double bench_bandwidth(int n_threads, int mib) {
    bench_bw_reader rd;
    if (bench_bw_open(&rd, n_threads, mib)) return 0;
    double bw = bench_bw_read(&rd);
    bench_bw_close(&rd);
    return bw;
}

/* ==== Compute ceilings ==== */

/* The matmul kernel itself on cache-resident data, at the backend's tile
 * shape: 16 weight rows x 64 activation rows x K = 512 (weights 8.5 KiB in
 * Q8_0, activations 34 KiB: both fit a 48 KiB L1d; K-quant activations are
 * a little larger and sit in L2), packed as the CPU backend packs them at
 * load where the kernel set does (quant_pack_pays). No memory traffic, so
 * this is the most the kernel can do. */
#define CK_ROWS 16
#define CK_TOK 64
#define CK_K 512

typedef struct {
    uint32_t wtype;
    double seconds;           /* per thread run time */
    long iters;
    int failed;
    float sink[64];
} ck_job;

static void ck_kernel(void *ctx, int ith, int nth) {
    ck_job *j = ctx;
    uint32_t vt = quant_vec_dot_type(j->wtype);
    size_t wrow = gguf_row_bytes(j->wtype, CK_K), arow = gguf_row_bytes(vt, CK_K);
    float *x = malloc(sizeof(float) * CK_K * CK_TOK);
    uint8_t *w = aligned_alloc(64, (wrow * CK_ROWS + 63) / 64 * 64);
    uint8_t *a = aligned_alloc(64, (arow * CK_TOK + 63) / 64 * 64);
    float *out = malloc(sizeof(float) * CK_ROWS * CK_TOK);
    if (!x || !w || !a || !out || !wrow || !arow) { j->failed = 1; goto out; }
    uint64_t rng = 88172645463325252ull + (uint64_t)ith;
    for (int i = 0; i < CK_K * CK_TOK; i++) x[i] = (float)(bench_rand(&rng) % 2001) / 1000.0f - 1.0f;
    if (quant_quantize_weight_rows(j->wtype, x, w, CK_ROWS, CK_K)) { j->failed = 1; goto out; }
    for (int t = 0; t < CK_TOK; t++) quant_quantize_act_row(vt, x + t * CK_K, a + t * arow, CK_K);
    if (quant_pack_pays(j->wtype)) {
        uint8_t *pk = aligned_alloc(64, (wrow * CK_ROWS + 63) / 64 * 64);
        if (!pk || quant_pack_rows(j->wtype, w, wrow, CK_ROWS, pk)) { free(pk); j->failed = 1; goto out; }
        for (long it = 0; it < j->iters; it++)
            quant_mul_mat_tile_packed(j->wtype, CK_K, pk, wrow, CK_ROWS, a, arow, CK_TOK, out, CK_ROWS);
        free(pk);
    } else {
        for (long it = 0; it < j->iters; it++)
            quant_mul_mat_tile(j->wtype, CK_K, w, wrow, CK_ROWS, a, arow, CK_TOK, out, CK_ROWS);
    }
    j->sink[ith % 64] = out[0];
out:
    (void)nth;
    free(x); free(w); free(a); free(out);
}

/* FLOP/s of quant_mul_mat_tile on all threads (2 FLOPs per multiply-add). */
/* FLOP/s of fn on the pool, *iters loop turns per thread a run: the loop
 * grows until one run takes over 0.15 s, then the best of 4 such runs
 * (24 doublings: the zmm kernels run a tile in about a microsecond). */
static double bench_best_rate(tpool *pool, tpool_fn fn, void *ctx, long *iters, const int *failed,
                              double flop_per_iter) {
    double best = 0;
    for (int rep = 0, timed = 0; rep < 24 + 4 && timed < 4 && !(failed && *failed); rep++) {
        double t0 = bench_now();
        tpool_run(pool, fn, ctx);
        double dt = bench_now() - t0;
        if (dt > 0.15) {
            if (*iters * flop_per_iter / dt > best) best = *iters * flop_per_iter / dt;
            timed++;
        } else {
            *iters *= 2;
        }
    }
    return best;
}

static double bench_kernel_peak(uint32_t wtype, int n_threads) {
    if (!quant_is_supported(wtype) || !gguf_row_bytes(wtype, CK_K)) return 0;
    tpool *pool = tpool_create(n_threads);
    if (!pool) return 0;
    ck_job j = { .wtype = wtype, .iters = 20 };
    double best = bench_best_rate(pool, ck_kernel, &j, &j.iters, &j.failed, 2.0 * CK_ROWS * CK_TOK * CK_K * n_threads);
    tpool_destroy(pool);
    return j.failed ? 0 : best;
}

#if defined(BENCH_AVX2)
typedef struct { long iters; int32_t sink[64]; } mad_job;

/* vpmaddubsw (32 u8 x s8 products, pairwise summed to i16) + vpmaddwd by ones
 * (to i32) + vpaddd: the int8 multiply-add sequence of the AVX2 Q8 kernels,
 * on registers only, 8 independent chains to hide latency. */
BENCH_TARGET_AVX2 static void mad_loop(void *ctx, int ith, int nth) {
    mad_job *j = ctx;
    (void)nth;
    __m256i ones = _mm256_set1_epi16(1);
    /* 4 x 2 distinct operand pairs so no product can be shared; 15 ymm
     * registers in all, within AVX2's 16 */
    __m256i x0 = _mm256_set1_epi8((char)(3 + ith)), x1 = _mm256_set1_epi8(5), x2 = _mm256_set1_epi8(7);
    __m256i x3 = _mm256_set1_epi8(9), y0 = _mm256_set1_epi8(-2), y1 = _mm256_set1_epi8(3);
    __m256i c0 = _mm256_setzero_si256(), c1 = c0, c2 = c0, c3 = c0, c4 = c0, c5 = c0, c6 = c0, c7 = c0;
#define MAD(c, a, b) c = _mm256_add_epi32(c, _mm256_madd_epi16(_mm256_maddubs_epi16(a, b), ones))
    for (long i = 0; i < j->iters; i++) {
        MAD(c0, x0, y0); MAD(c1, x1, y0); MAD(c2, x2, y0); MAD(c3, x3, y0);
        MAD(c4, x0, y1); MAD(c5, x1, y1); MAD(c6, x2, y1); MAD(c7, x3, y1);
        /* the operands "change" every iteration, so nothing is hoisted */
        __asm__ volatile("" : "+x"(x0), "+x"(x1), "+x"(x2), "+x"(x3), "+x"(y0), "+x"(y1));
    }
#undef MAD
    __m256i s = _mm256_add_epi32(_mm256_add_epi32(_mm256_add_epi32(c0, c1), _mm256_add_epi32(c2, c3)),
                                 _mm256_add_epi32(_mm256_add_epi32(c4, c5), _mm256_add_epi32(c6, c7)));
    j->sink[ith % 64] = _mm256_extract_epi32(s, 0);
}

/* vpdpbusd on zmm (64 u8 x s8 products summed into 16 i32 lanes): the
 * multiply-add of the avx512 set's kernels, 8 independent chains. */
BENCH_TARGET_AVX512 static void mad_loop_vnni(void *ctx, int ith, int nth) {
    mad_job *j = ctx;
    (void)nth;
    __m512i x0 = _mm512_set1_epi8((char)(3 + ith)), x1 = _mm512_set1_epi8(5), x2 = _mm512_set1_epi8(7);
    __m512i x3 = _mm512_set1_epi8(9), y0 = _mm512_set1_epi8(-2), y1 = _mm512_set1_epi8(3);
    __m512i c0 = _mm512_setzero_si512(), c1 = c0, c2 = c0, c3 = c0, c4 = c0, c5 = c0, c6 = c0, c7 = c0;
    for (long i = 0; i < j->iters; i++) {
        c0 = _mm512_dpbusd_epi32(c0, x0, y0); c1 = _mm512_dpbusd_epi32(c1, x1, y0);
        c2 = _mm512_dpbusd_epi32(c2, x2, y0); c3 = _mm512_dpbusd_epi32(c3, x3, y0);
        c4 = _mm512_dpbusd_epi32(c4, x0, y1); c5 = _mm512_dpbusd_epi32(c5, x1, y1);
        c6 = _mm512_dpbusd_epi32(c6, x2, y1); c7 = _mm512_dpbusd_epi32(c7, x3, y1);
        __asm__ volatile("" : "+v"(x0), "+v"(x1), "+v"(x2), "+v"(x3), "+v"(y0), "+v"(y1));
    }
    __m512i s = _mm512_add_epi32(_mm512_add_epi32(_mm512_add_epi32(c0, c1), _mm512_add_epi32(c2, c3)),
                                 _mm512_add_epi32(_mm512_add_epi32(c4, c5), _mm512_add_epi32(c6, c7)));
    j->sink[ith % 64] = _mm_cvtsi128_si32(_mm512_castsi512_si128(s));
}

/* int8 "FLOP/s" (2 per multiply-add) of the raw instruction sequence: the
 * zmm vpdpbusd loop where the active set is avx512, else the AVX2 one. */
static double bench_int8_peak(int n_threads, int vnni) {
    tpool *pool = tpool_create(n_threads);
    if (!pool) return 0;
    mad_job j = { .iters = 1 << 16 };
    double best = bench_best_rate(pool, vnni ? mad_loop_vnni : mad_loop, &j, &j.iters, NULL,
                                  2.0 * 8 * (vnni ? 64 : 32) * n_threads);
    tpool_destroy(pool);
    return best;
}
#endif

/* ==== FLOPs of the model ==== */

/* Multiply-adds of the weight matmuls for one token in all layers (MoE: the
 * router and the used experts only), excluding the output layer. */
static double bench_layer_macs(const model_hparams *h) {
    double E = h->n_embd, qd = (double)h->n_head * h->head_dim_k, kd = (double)h->n_head_kv * h->head_dim_k;
    double vd = (double)h->n_head_kv * h->head_dim_v, od = (double)h->n_head * h->head_dim_v;
    double attn = E * qd + E * kd + E * vd + od * E;
    double ffn = h->n_expert > 0 ? E * h->n_expert + (double)h->n_expert_used * 3.0 * E * h->n_ff_exp
                                 : 3.0 * E * h->n_ff;
    return h->n_layer * (attn + ffn);
}

/* Attention multiply-adds (QK^T and AV) of token i attending to i+1 keys,
 * averaged over a prompt of n tokens: (n+1)/2 keys on average. */
static double bench_attn_macs(const model_hparams *h, int n, int depth) {
    return h->n_layer * (double)h->n_head * (h->head_dim_k + h->head_dim_v) * (depth + (n + 1) / 2.0);
}

/* Bytes of K and V cache one decoded token reads at cache position pos. */
static double bench_kv_bytes(const model_hparams *h, uint32_t kv_type, double pos) {
    double per_val = kv_type == GGML_TYPE_Q8_0 ? 34.0 / 32.0 : 2.0;
    return h->n_layer * (double)h->n_head_kv * (h->head_dim_k + h->head_dim_v) * per_val * pos;
}

/* ==== Bounds table ==== */

static void bench_print_bounds(model *m, const bench_opts *o, const bench_info *bi, const bench_result *res, int n_res,
                               int n_threads) {
    const model_hparams *h = model_get_hparams(m);
    const bench_result *pp = NULL;
    for (int i = 0; i < n_res; i++)
        if (res[i].threads == n_threads && res[i].is_pp && !pp) pp = &res[i];
    fprintf(stderr, "measuring bounds (%d threads)...\n", n_threads);
    double bw = bench_bandwidth(n_threads, o->bw_mib);
    double kpeak = bench_kernel_peak(bi->main_type, n_threads);
    double ipeak = 0;
    int vnni = !strcmp(quant_kernel_name(), "avx512");   /* the set runs only where the CPU has it */
#if defined(BENCH_AVX2)
    if (__builtin_cpu_supports("avx2")) ipeak = bench_int8_peak(n_threads, vnni);
#endif
    uint64_t wb = model_weight_bytes_per_token(m);
    char v[64];
    printf("\nbounds (%d threads, kernels: %s)\n\n", n_threads, quant_kernel_name());
    printf("| quantity | value | how it was obtained |\n| --- | ---: | --- |\n");
    printf("| memory read bandwidth | %.2f GB/s | %d-thread streaming read of a %d MiB buffer on huge pages "
           "(as the packed weights), best of 5 |\n", bw / 1e9, n_threads, o->bw_mib);
    printf("| weight bytes per decoded token | %.2f MB | model_weight_bytes_per_token (all weights read once%s) |\n",
           wb / 1e6, h->n_expert > 0 ? "; MoE: only the used experts" : "");
    if (bw > 0 && wb > 0) {
        double bound = bw / (double)wb;
        printf("| decode bound | %.2f t/s | bandwidth / weight bytes per token (KV-cache reads ignored) |\n", bound);
        for (int i = 0; i < n_res; i++) {
            const bench_result *r = &res[i];
            if (r->is_pp || r->threads != n_threads) continue;
            char test[48];
            bench_test_name(r, test, sizeof test);
            /* P sequences together: one pass reads the weights once for P
             * tokens and each sequence's cache; a MoE pass reads the experts
             * all P tokens chose, which this table does not know */
            const int P = r->n_par;
            if (P > 1) {   /* several tokens a pass: the products' arithmetic may bind first */
                double macs = bench_layer_macs(h) + bench_attn_macs(h, r->n, r->depth) + (double)h->n_embd * h->n_vocab;
                double rate = 2.0 * macs * r->mean;
                printf("| %s compute | %.2f GFLOP/s | %.2f t/s x %.4f GFLOP per token (weight matmuls, attention, "
                       "output layer) |\n", test, rate / 1e9, r->mean, 2.0 * macs / 1e9);
                if (kpeak > 0)
                    printf("| %s of the kernel ceiling | %.1f%% | of the matmul kernel ceiling %.2f GFLOP/s (below) |\n",
                           test, 100.0 * rate / kpeak, kpeak / 1e9);
            }
            if (P > 1 && h->n_expert > 0) {
                printf("| %s measured | %.2f t/s | (MoE: the experts a pass reads depend on its tokens: no bandwidth "
                       "bound) |\n", test, r->mean);
                continue;
            }
            /* the cache read per token grows with the position: its mean over the run */
            double kvb = bench_kv_bytes(h, o->kv_type, r->depth + (r->n + 1) / 2.0);
            double rb = P * bw / ((double)wb + P * kvb);
            printf("| %s measured | %.2f t/s | %.1f%% of the bound %.2f t/s = %sbandwidth / (weights + %s"
                   "%.2f MB of KV cache at mean position %.0f) |\n", test, r->mean, 100.0 * r->mean / rb, rb,
                   P > 1 ? "sequences x " : "", P > 1 ? "sequences x " : "", kvb / 1e6, r->depth + (r->n + 1) / 2.0);
            if (r->per_bw > 0) {
                int reps = o->reps;
                printf("| %s against its own bandwidth | %.1f%% | median over %s%d rep%s of each rep's t/s against the "
                       "bound at the mean of the readings just before and after it (readings %.2f-%.2f GB/s)%s |\n",
                       test, 100.0 * r->per_bw * ((double)wb + P * kvb) / P, r->n_agree ? "the " : "all ",
                       r->n_agree ? r->n_agree : reps, (r->n_agree ? r->n_agree : reps) == 1 ? "" : "s",
                       r->bw_lo / 1e9, r->bw_hi / 1e9,
                       r->n_agree == reps ? ""
                       : r->n_agree ? "; the other reps' two readings differed by more than 15%"
                                    : "; no rep's two readings agreed within 15%: the machine changed during each");
            }
        }
    }
    if (pp) {
        double macs = bench_layer_macs(h) + bench_attn_macs(h, pp->n, pp->depth) + (double)h->n_embd * h->n_vocab / pp->n;
        double flops = 2.0 * macs, rate = flops * pp->mean;
        printf("| FLOPs per prompt token (pp%d) | %.4g GFLOP | 2 x multiply-adds: weight matmuls %.4g G%s, "
               "attention QK+AV at %.1f keys on average %.4g G, output layer once per prompt %.4g G / %d |\n",
               pp->n, flops / 1e9, 2 * bench_layer_macs(h) / 1e9,
               h->n_expert > 0 ? " (router + used experts)" : "", pp->depth + (pp->n + 1) / 2.0,
               2 * bench_attn_macs(h, pp->n, pp->depth) / 1e9, 2.0 * h->n_embd * h->n_vocab / 1e9, pp->n);
        printf("| pp%d measured | %.2f GFLOP/s | %.2f t/s x FLOPs per token |\n", pp->n, rate / 1e9, pp->mean);
        if (kpeak > 0)
            printf("| matmul kernel ceiling (%s) | %.2f GFLOP/s | %s, %d rows x %d tokens x %d, "
                   "cache-resident, %d threads; pp%d reaches %.1f%% of it |\n", gguf_type_name(bi->main_type),
                   kpeak / 1e9, quant_pack_pays(bi->main_type) ? "quant_mul_mat_tile_packed" : "quant_mul_mat_tile",
                   CK_ROWS, CK_TOK, CK_K, n_threads, pp->n, 100.0 * rate / kpeak);
        int float_w = bi->main_type == GGML_TYPE_F32 || bi->main_type == GGML_TYPE_F16 || bi->main_type == GGML_TYPE_BF16;
        if (ipeak > 0 && !float_w)   /* float weights use FMA kernels, not int8 */
            printf("| int8 multiply-add ceiling | %.2f GOP/s | %s register loop, "
                   "%d threads (2 ops per multiply-add); pp%d reaches %.1f%% of it |\n", ipeak / 1e9,
                   vnni ? "AVX-512 VNNI zmm vpdpbusd" : "AVX2 vpmaddubsw+vpmaddwd+vpaddd", n_threads,
                   pp->n, 100.0 * rate / ipeak);
    } else {
        if (kpeak > 0) {
            snprintf(v, sizeof v, "%.2f GFLOP/s", kpeak / 1e9);
            printf("| matmul kernel ceiling (%s) | %s | quant_mul_mat_tile, cache-resident |\n", gguf_type_name(bi->main_type), v);
        }
    }
    fflush(stdout);
}

/* ==== CUDA: the cuBLAS ceiling ==== */
#ifdef TANDEM_CUDA
/* The weight products of one prompt pass of n tokens, each timed alone as
 * one F16 cublasGemmEx (backend_cuda_gemm_seconds), summed over the layers:
 * the speed a prompt pass would have if it were nothing but cuBLAS at its
 * own shapes. MoE: each expert gets n x used / n_expert tokens (an even
 * routing). Attention, norms and the rest are left out, so a backend can
 * only approach it. Returns the seconds, or -1. */
static double bench_cuda_gemm_pass(backend *be, const model_hparams *h, int n, char *err, size_t errlen) {
    int E = h->n_embd, q = h->n_head * h->head_dim_k, kv = h->n_head_kv * h->head_dim_k;
    int vo = h->n_head * h->head_dim_v, kvv = h->n_head_kv * h->head_dim_v;
    int ne = h->n_expert > 0 ? (int)(((long)n * h->n_expert_used + h->n_expert - 1) / h->n_expert) : 0;
    struct { int m, n, k, count; } g[] = {
        { q, n, E, 1 }, { kv, n, E, 1 }, { kvv, n, E, 1 }, { E, n, vo, 1 },
        { h->n_expert > 0 ? 0 : h->n_ff, n, E, 2 }, { h->n_expert > 0 ? 0 : E, n, h->n_ff, 1 },
        { h->n_expert, n, E, 1 },
        { h->n_expert > 0 ? h->n_ff_exp : 0, ne, E, 2 * h->n_expert }, { h->n_expert > 0 ? E : 0, ne, h->n_ff_exp, h->n_expert },
    };
    double layer = 0;
    for (size_t i = 0; i < sizeof g / sizeof g[0]; i++) {
        if (g[i].m <= 0 || g[i].n <= 0 || g[i].k <= 0) continue;
        double t;
        if (backend_cuda_gemm_seconds(be, g[i].m, g[i].n, g[i].k, &t, err, errlen)) return -1;
        layer += t * g[i].count;
    }
    return layer * h->n_layer;
}

static void bench_print_cuda_bounds(model *m, const bench_result *res, int n_res) {
    backend *be = model_get_backend(m);
    const model_hparams *h = model_get_hparams(m);
    char err[256];
    double big;
    printf("\nbounds (CUDA)\n\n| quantity | value | how it was obtained |\n| --- | ---: | --- |\n");
    if (backend_cuda_gemm_seconds(be, 8192, 8192, 8192, &big, err, sizeof err) == 0)
        printf("| cuBLAS F16 GEMM, 8192^3 | %.1f TFLOP/s | one cublasGemmEx, f32 accumulation, median of 7 |\n",
               2.0 * 8192 * 8192 * 8192 / big / 1e12);
    for (int i = 0; i < n_res; i++) {
        const bench_result *r = &res[i];
        if (!r->is_pp || r->depth) continue;
        double t = bench_cuda_gemm_pass(be, h, r->n, err, sizeof err);
        if (t <= 0) { printf("| pp%d ceiling | - | %s |\n", r->n, err); continue; }
        double flops = 2.0 * bench_layer_macs(h) * r->n;
        printf("| pp%d cuBLAS ceiling | %.1f t/s | the pass's %.4g TFLOP of weight products, each one F16 "
               "cublasGemmEx at its shape (%.1f TFLOP/s); pp%d measured %.1f t/s = %.1f%% of it |\n",
               r->n, r->n / t, flops / 1e12, flops / t / 1e12, r->n, r->mean, 100.0 * r->mean * t / r->n);
    }
    fflush(stdout);
}
#endif

/* ==== The command ==== */

static int bench_threads(const bench_opts *o, int n_threads, bench_info *bi, bench_result *res, int *n_res,
                         char *err, size_t errlen) {
    model_opts mo = { .n_threads = n_threads, .n_batch = o->n_batch, .backend = o->backend, .device = o->device,
                      .fingerprint_later = 1 };
    model *m = NULL;
    session *ps[BENCH_MAX_PAR] = { NULL };   /* ps[0] for every test, the rest for -np */
    bench_bw_reader around = { 0 };
    const int n_sess = o->n_par > 1 ? o->n_par : 1;
    int rc = -1, n_ctx = 1;
    for (int i = 0; i < o->pp.n; i++) if (o->depth + o->pp.v[i] > n_ctx) n_ctx = o->depth + o->pp.v[i];
    for (int i = 0; i < o->tg.n; i++) if (o->depth + o->tg.v[i] > n_ctx) n_ctx = o->depth + o->tg.v[i];
    if (o->gp_n && o->gp_depth + o->gp_n > n_ctx) n_ctx = o->gp_depth + o->gp_n;
    cliopt_progress lp;   /* copying weights to a GPU can take a while */
    cliopt_progress_begin(&lp, BENCH ": loading weights", 1, 0);
    mo.on_load = cliopt_progress_steps;
    mo.on_load_ud = &lp;
    if (model_load(&m, o->model, &mo, err, errlen)) { if (lp.drawn && lp.tty) fputc('\n', stderr); goto out; }
    cliopt_progress_end(&lp);
    for (int j = 0; j < n_sess; j++)
        if (session_new(&ps[j], m, n_ctx, o->kv_type, err, errlen)) goto out;
    bench_describe(m, bi);
    if (*n_res == 0 && n_threads == o->threads.v[0] && o->fmt == BENCH_MD) bench_print_header();
    bench_list gp = { .v = { o->gp_n }, .n = o->gp_n > 0 };
    /* on a shared machine the bandwidth moves between runs: each rep of a
     * generation row is set against readings taken around it (the bounds
     * follow the last -t; without the buffer, no such rows) */
    if (o->bounds && n_threads == o->threads.v[o->threads.n - 1])
        bench_bw_open(&around, n_threads, o->bw_mib < BENCH_BW_AROUND_MIB ? o->bw_mib : BENCH_BW_AROUND_MIB);
    for (int pass = 0; pass < 4; pass++) {   /* pp, tg, -gp, tg with -np sequences */
        const bench_list *l = pass == 0 ? &o->pp : pass == 1 || pass == 3 ? &o->tg : &gp;
        int depth = pass == 2 ? o->gp_depth : o->depth;
        if (pass == 3 && o->n_par < 2) break;
        for (int i = 0; i < l->n; i++) {
            if (l->v[i] == 0) continue;
            bench_result *r = &res[*n_res];
            *r = (bench_result){ 0 };
            if (bench_run_test(m, ps, pass == 3 ? o->n_par : 1, o, pass == 0, depth, l->v[i],
                               pass > 0 && around.buf ? &around : NULL, r, err, errlen))
                goto out;
            r->threads = n_threads;
            if (o->fmt == BENCH_MD) bench_print_row(bi, r);
            else {
                char test[48];
                bench_test_name(r, test, sizeof test);
                fprintf(stderr, BENCH ": %s, %d threads: %.2f t/s\n", test, n_threads, r->mean);
            }
            (*n_res)++;
        }
    }
    const int last = n_threads == o->threads.v[o->threads.n - 1];   /* the bounds follow the last -t */
    if (o->bounds && last) {
        for (int j = 0; j < n_sess; j++) { session_free(ps[j]); ps[j] = NULL; }
        bench_bw_close(&around);   /* the bound's own, bigger read follows */
        bench_print_bounds(m, o, bi, res, *n_res, n_threads);
    }
#ifdef TANDEM_CUDA
    if (o->cuda_bounds && last && !strcmp(model_get_backend(m)->ops->name, "cuda")) bench_print_cuda_bounds(m, res, *n_res);
#endif
    rc = 0;
out:
    bench_bw_close(&around);
    for (int j = 0; j < n_sess; j++) session_free(ps[j]);
    model_free(m);
    return rc;
}

int cli_bench(int argc, char **argv) {
    bench_opts o;
    if (argc == 0) { bench_usage(stderr); return CLI_EXIT_USAGE; }
    if (bench_spec_wanted(argc, argv)) return bench_spec_main(argc, argv);
    int pr = bench_parse(argc, argv, &o);
    if (pr) return pr > 0 ? CLI_EXIT_OK : CLI_EXIT_USAGE;
    bench_result res[4 * BENCH_MAX_LIST * BENCH_MAX_LIST];
    bench_info bi;
    int n_res = 0;
    char err[512];
    for (int i = 0; i < o.threads.n; i++) {
        if (bench_threads(&o, o.threads.v[i], &bi, res, &n_res, err, sizeof err)) {
            fprintf(stderr, BENCH ": %s\n", err);
            return CLI_EXIT_FAIL;
        }
    }
    if (o.fmt == BENCH_CSV) bench_print_csv(&o, &bi, res, n_res);
    if (o.fmt == BENCH_JSON && bench_print_json(&o, &bi, res, n_res)) {
        fprintf(stderr, BENCH ": out of memory\n");
        return CLI_EXIT_FAIL;
    }
    return CLI_EXIT_OK;
}

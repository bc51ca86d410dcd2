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
 * Bounds table (bench_bounds.c): measured streaming-read bandwidth against
 * the bytes of weight read per decoded token (the decode roofline), and the
 * model's FLOPs per prompt token against a measured compute ceiling of the
 * matmul kernel.
 */
#include "cmd/cli.h"

#include <jansson.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "base/cliopt.h"
#include "base/xorshift.h"
#include "cmd/bench_spec.h"
#include "engine/gguf.h"
#include "engine/kvcache.h"
#include "engine/model.h"
#include "engine/quant.h"
#ifdef TANDEM_CUDA
#include "backend/cuda/backend_cuda.h"
#endif

#include "cmd/bench_internal.h"

/* ==== Options ==== */

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

/* A list option ("512" or "128,256,512") of token counts; says what is
 * wrong when it is. */
static int bench_list_opt(const char *opt, const char *v, bench_list *l) {
    return cliopt_int_list(BENCH, opt, v, 0, 1000000, l->v, BENCH_MAX_LIST, &l->n);
}

static int bench_parse(int argc, char **argv, bench_opts *o) {
    memset(o, 0, sizeof *o);
    o->reps = 5; o->n_batch = 0; o->bounds = 1; o->bw_mib = 1024;
    o->kv_name = "f16";
    o->threads = (bench_list){ .v = { 2 }, .n = 1 };
    o->pp = (bench_list){ .v = { 512 }, .n = 1 };
    o->tg = (bench_list){ .v = { 128 }, .n = 1 };
    int k;
    for (int i = 0; i < argc; i++) {
        const char *a = argv[i], *v = i + 1 < argc ? argv[i + 1] : NULL;
        int bad = 0, takes = 1;
        if (!strcmp(a, "-m")) bad = cliopt_str(BENCH, a, v, &o->model);
        else if (!strcmp(a, "-t")) bad = cliopt_int_list(BENCH, a, v, 1, 256, o->threads.v, BENCH_MAX_LIST, &o->threads.n);
        else if (!strcmp(a, "-p")) bad = bench_list_opt(a, v, &o->pp);
        else if (!strcmp(a, "-n")) bad = bench_list_opt(a, v, &o->tg);
        else if (!strcmp(a, "-r")) bad = cliopt_int(BENCH, a, v, 1, 100000, &o->reps);
        else if (!strcmp(a, "-b")) bad = cliopt_int(BENCH, a, v, 1, 1 << 16, &o->n_batch);
        else if (!strcmp(a, "-d")) bad = cliopt_int(BENCH, a, v, 0, 1000000, &o->depth);
        else if (!strcmp(a, "-np")) bad = cliopt_int(BENCH, a, v, 2, BENCH_MAX_PAR, &o->n_par);
        else if (!strcmp(a, "-gp")) {
            bench_list l;
            bad = bench_list_opt(a, v, &l);
            if (!bad && (bad = l.n != 2 || l.v[1] < 1)) fprintf(stderr, BENCH ": -gp needs DEPTH,N (N >= 1), got '%s'\n", v);
            else if (!bad) { o->gp_depth = l.v[0]; o->gp_n = l.v[1]; }
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
    if (!o->model) { if (argc) fprintf(stderr, BENCH ": give -m MODEL.gguf\n"); bench_usage(stderr); return -1; }
    if (o->fmt != BENCH_MD) o->bounds = 0;   /* the bounds are a markdown table of their own */
    o->kv_type = kv_dtype_parse(o->kv_name);
    /* the bounds are the CPU's (memory bandwidth, SIMD peak) */
    o->cuda_bounds = o->bounds;   /* with cuda: the cuBLAS ceiling instead */
    if (o->backend && strcmp(o->backend, "cpu")) o->bounds = 0;
    return 0;
}

/* ==== Small utilities ==== */

double bench_now(void) {
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
uint32_t bench_rand(uint64_t *s) { return xorshift64_u32(s); }

/* ==== Model description ==== */

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
void bench_test_name(const bench_result *r, char *buf, size_t len) {
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

/* bench_internal.h - what `tandem bench`'s files share (not part of its
 * interface: cli.h is). Options, the model's description, a test's result,
 * the bandwidth reader, and the bench_ functions one file calls in another:
 *   bench.c         options, the speed tests, their output (table, JSON,
 *                   CSV), the command
 *   bench_bounds.c  bandwidth, compute ceilings, the bounds table, CUDA's
 *                   cuBLAS ceiling
 */

#ifndef TANDEM_CMD_BENCH_INTERNAL_H
#define TANDEM_CMD_BENCH_INTERNAL_H

#include <stddef.h>
#include <stdint.h>

#include "engine/model.h"
#include "base/threadpool.h"

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

/* ==== Model description ==== */

typedef struct {
    uint64_t params, active_params, tensor_bytes;
    char desc[96];
    uint32_t main_type;       /* type of the first FFN weight */
    const char *backend;      /* "CPU", "CUDA" or "MLX" */
    int n_batch;              /* rows per pass: -b, else the backend's */
} bench_info;

/* ==== Results ==== */

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

/* ==== Memory bandwidth ==== */

typedef struct bench_bw_reader bench_bw_reader;

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

/* ==== bench.c ==== */

double bench_now(void);
/* A fixed xorshift stream for the random prompt tokens. */
uint32_t bench_rand(uint64_t *s);
/* "pp512", "tg128 @ d4096", "tg64 x8": the test's name in every format */
void bench_test_name(const bench_result *r, char *buf, size_t len);

/* ==== bench_bounds.c ==== */

void bench_bw_close(bench_bw_reader *rd);
/* A buffer of mib MiB, every page touched, and n_threads threads to read
 * it; 0, or -1 (rd closed). */
int bench_bw_open(bench_bw_reader *rd, int n_threads, int mib);
/* Best of 5 full passes over the buffer, bytes per second (0 if rd is not open). */
double bench_bw_read(bench_bw_reader *rd);
void bench_print_bounds(model *m, const bench_opts *o, const bench_info *bi, const bench_result *res, int n_res,
                        int n_threads);
#ifdef TANDEM_CUDA
void bench_print_cuda_bounds(model *m, const bench_result *res, int n_res);
#endif

#endif /* TANDEM_CMD_BENCH_INTERNAL_H */

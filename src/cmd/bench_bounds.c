/* bench_bounds.c - `tandem bench`'s bounds: the streaming-read bandwidth
 * (also read around each generation repetition), the matmul kernel's and
 * the int8 multiply-adds' compute ceilings, the model's multiply-adds and
 * KV bytes per token, the bounds table, and with CUDA the cuBLAS ceiling of
 * a prompt pass. */

#include "cmd/cli.h"

#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#if defined(__x86_64__)
#include <immintrin.h>
/* The AVX2 loops below are compiled for AVX2 alone and run only where cpuid
 * says the CPU has it: the rest of the build targets baseline x86-64. */
#define BENCH_AVX2 1
#define BENCH_TARGET_AVX2 __attribute__((target("avx2")))
#define BENCH_TARGET_AVX512 __attribute__((target("avx512f,avx512bw,avx512vnni")))
#endif

#include "engine/gguf.h"
#include "base/hugemap.h"
#include "engine/model.h"
#include "engine/quant.h"
#include "base/threadpool.h"
#ifdef TANDEM_CUDA
#include "backend/cuda/backend_cuda.h"
#endif

#include "cmd/bench_internal.h"

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

void bench_bw_close(bench_bw_reader *rd) {
    if (rd->pool) tpool_destroy(rd->pool);
    hugemap_free(rd->buf, rd->mapped);
    *rd = (bench_bw_reader){ 0 };
}

/* A buffer of mib MiB, every page touched (the lines given distinct
 * values), and n_threads threads to read it; 0, or -1 (rd closed). */
int bench_bw_open(bench_bw_reader *rd, int n_threads, int mib) {
    *rd = (bench_bw_reader){ .size = (size_t)mib << 20 };
    rd->buf = hugemap_alloc(rd->size, &rd->mapped);
    rd->pool = tpool_create(n_threads);
    if (!rd->buf || !rd->pool) { bench_bw_close(rd); return -1; }
    for (size_t i = 0; i < rd->size; i += 4096) memset(rd->buf + i, (int)(i >> 12), 4096);
    return 0;
}

/* Best of 5 full passes over the buffer, bytes per second (0 if rd is not open). */
double bench_bw_read(bench_bw_reader *rd) {
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

void bench_print_bounds(model *m, const bench_opts *o, const bench_info *bi, const bench_result *res, int n_res,
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

void bench_print_cuda_bounds(model *m, const bench_result *res, int n_res) {
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

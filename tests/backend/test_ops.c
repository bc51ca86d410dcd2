/* test_ops.c - vector element-wise kernels (ops.h) against their plain C
 * references: exp accuracy in ulp over the whole useful range, softmax sums,
 * SiLU gating, RMS norm, and odd lengths that exercise the tails. */
#include <math.h>
#include <stdint.h>
#include <string.h>

#include <stdatomic.h>

#include "backend/cpu/ops.h"
#include "engine/quant.h"
#include "base/threadpool.h"
#include "t.h"

static uint64_t rng = 88172645463325252ull;   /* t_rnd_float's state: one sequence through the file */

/* distance in units in the last place between two finite floats of one sign */
static int64_t ulp_diff(float a, float b) {
    int32_t ia, ib;
    memcpy(&ia, &a, 4); memcpy(&ib, &b, 4);
    if (ia < 0) ia = INT32_MIN - ia;
    if (ib < 0) ib = INT32_MIN - ib;
    return ia > ib ? (int64_t)ia - ib : (int64_t)ib - ia;
}

static void test_exp(void) {
    enum { N = 20003 };   /* odd: exercises the tail */
    static float x[N], y[N], r[N];
    for (int i = 0; i < N; i++) x[i] = -100.0f + 188.7f * (float)i / (float)(N - 1);
    double s = ops_exp_sum(x, 0.0f, y, N);
    double sr = ops_ref_exp_sum(x, 0.0f, r, N);
    int64_t worst = 0;
    for (int i = 0; i < N; i++) {
        if (r[i] < 1.17549435e-38f) {   /* subnormal results: absolute error only */
            CHECK(fabsf(y[i] - r[i]) <= 2e-45f * 4, "exp(%g) subnormal %g vs %g", x[i], y[i], r[i]);
            continue;
        }
        int64_t d = ulp_diff(y[i], r[i]);
        if (d > worst) worst = d;
    }
    CHECK(worst <= 1, "exp max ulp error %lld", (long long)worst);
    CHECK(fabs(s - sr) <= 1e-6 * sr, "exp sum %.9g vs %.9g", s, sr);
    float big[9] = { 89.0f, 100.0f, INFINITY, -INFINITY, -200.0f, 0.0f, NAN, 1.0f, -1.0f }, out[9];
    ops_exp_sum(big, 0.0f, out, 9);
    CHECK(isinf(out[0]) && isinf(out[1]) && isinf(out[2]), "exp overflow to inf");
    CHECK(out[3] == 0.0f && out[4] == 0.0f && out[5] == 1.0f, "exp underflow / exp(0)");
    CHECK(isnan(out[6]), "exp(NaN) is NaN");
    CHECK(ulp_diff(out[7], expf(1.0f)) <= 1 && ulp_diff(out[8], expf(-1.0f)) <= 1, "exp(+-1)");
    /* softmax-style use: subtract the max */
    float sc[37], e1[37], e2[37];
    for (int i = 0; i < 37; i++) sc[i] = t_rnd_float(&rng, -30.0f, 30.0f);
    float mx = ops_max(sc, 37);
    double a = ops_exp_sum(sc, mx, e1, 37), b = ops_ref_exp_sum(sc, mx, e2, 37);
    CHECK(fabs(a - b) <= 1e-6 * b && a >= 1.0, "softmax sum %.9g vs %.9g", a, b);
}

static void test_swiglu(void) {
    enum { N = 4099 };
    static float g[N], u[N], y[N], r[N];
    for (int i = 0; i < N; i++) { g[i] = t_rnd_float(&rng, -60.0f, 60.0f); u[i] = t_rnd_float(&rng, -3.0f, 3.0f); }
    g[0] = -100.0f; g[1] = 100.0f; g[2] = 0.0f;
    ops_swiglu(g, u, y, N);
    ops_ref_swiglu(g, u, r, N);
    double worst = 0.0;
    for (int i = 0; i < N; i++) {
        double d = fabs((double)y[i] - r[i]) / (fabs(r[i]) + 1e-30);
        if (r[i] != 0.0f && d > worst) worst = d;
        if (r[i] == 0.0f) CHECK(fabsf(y[i]) < 1e-30f, "swiglu zero at %d: %g", i, y[i]);
    }
    CHECK(worst < 4e-7, "swiglu max relative error %g", worst);
    /* in place, as the backend calls it */
    memcpy(y, g, sizeof g);
    ops_swiglu(y, u, y, N);
    CHECK(fabsf(y[5] - r[5]) <= 4e-7f * fabsf(r[5]) + 1e-30f, "swiglu in place");
}

static void test_rms_norm(void) {
    for (int n = 1; n <= 1031; n += 103) {
        float x[1031], w[1031], y[1031], r[1031];
        for (int i = 0; i < n; i++) { x[i] = t_rnd_float(&rng, -4.0f, 4.0f); w[i] = t_rnd_float(&rng, 0.5f, 1.5f); }
        ops_rms_norm_row(x, w, y, (size_t)n, 1e-6f);
        ops_ref_rms_norm_row(x, w, r, (size_t)n, 1e-6f);
        float worst = 0.0f;
        for (int i = 0; i < n; i++) worst = fmaxf(worst, fabsf(y[i] - r[i]));
        CHECK(worst <= 1e-6f, "rms_norm n=%d max diff %g", n, worst);
        ops_rms_norm_row(x, NULL, y, (size_t)n, 1e-6f);
        ops_ref_rms_norm_row(x, NULL, r, (size_t)n, 1e-6f);
        worst = 0.0f;
        for (int i = 0; i < n; i++) worst = fmaxf(worst, fabsf(y[i] - r[i]));
        CHECK(worst <= 1e-6f, "rms_norm (no weight) n=%d max diff %g", n, worst);
    }
}

static void test_small(void) {
    float x[11], y[11];
    for (int i = 0; i < 11; i++) { x[i] = (float)i; y[i] = 1.0f; }
    ops_add(y, x, 11);
    CHECK(y[10] == 11.0f && y[0] == 1.0f, "add");
    ops_axpy(2.0f, x, y, 11);
    CHECK(y[10] == 31.0f && y[3] == 10.0f, "axpy");
    ops_scale(y, 0.5f, 11);
    CHECK(y[10] == 15.5f, "scale");
    CHECK(ops_max(x, 11) == 10.0f, "max");
    /* scale, axpy and max: each length through the vector body and its tail, the
     * same results as the scalar loops */
    static float z[70], w[70], x70[70];
    for (int n = 1; n <= 70; n += 3) {
        for (int i = 0; i < 70; i++) x70[i] = t_rnd_float(&rng, -3.0f, 3.0f);
        for (int i = 0; i < 70; i++) z[i] = w[i] = t_rnd_float(&rng, -5.0f, 5.0f);
        ops_scale(z, 0.37f, (size_t)n);
        for (int i = 0; i < n; i++) w[i] *= 0.37f;
        CHECK(!memcmp(z, w, sizeof z), "scale n %d", n);
        ops_axpy(-1.7f, x70, z, (size_t)n);
        for (int i = 0; i < n; i++) w[i] += -1.7f * x70[i];
        CHECK(!memcmp(z, w, sizeof z), "axpy n %d", n);
        float m = z[0];
        for (int i = 1; i < n; i++) m = z[i] > m ? z[i] : m;
        CHECK(ops_max(z, (size_t)n) == m, "max n %d", n);
    }
}

/* Attention's P x V for F16, BF16 and Q8_0 V rows: the vector version must
 * equal the reference bit for bit (same products, same order, unfused; a
 * Q8_0 value is its block's scale times the int8, one multiply). */
static void test_attn_pv(void) {
    enum { HD = 128, NPOS = 150, GRP = 11, MAXROW = 2 * HD * 3 };   /* rows of 3 heads: take head 1 */
    static uint8_t vrow[NPOS * MAXROW];
    static float pr[GRP * NPOS], out[GRP * HD], ref[GRP * HD], tmp[128 * HD], f[3 * HD];
    const uint32_t types[3] = { GGML_TYPE_F16, GGML_TYPE_BF16, GGML_TYPE_Q8_0 };
    for (int ti = 0; ti < 3; ti++) {
        const size_t head = gguf_row_bytes(types[ti], HD), stride = 3 * head;
        for (int p = 0; p < NPOS; p++) {
            for (int i = 0; i < 3 * HD; i++) f[i] = t_rnd_float(&rng, -2.0f, 2.0f);
            uint8_t *row = vrow + (size_t)p * stride;
            if (types[ti] == GGML_TYPE_Q8_0) {
                quant_quantize_act_row(GGML_TYPE_Q8_0, f, row, 3 * HD);
                continue;
            }
            for (int i = 0; i < 3 * HD; i++) {
                uint16_t h = types[ti] == GGML_TYPE_F16 ? f32_to_fp16(f[i]) : f32_to_bf16(f[i]);
                memcpy(row + 2 * (size_t)i, &h, 2);
            }
        }
        for (int i = 0; i < GRP * NPOS; i++) pr[i] = t_rnd_float(&rng, 0.0f, 0.05f);
        const uint8_t *v = vrow + head;
        for (int grp = 1; grp <= GRP; grp++) {
            ops_attn_pv(types[ti], v, stride, NPOS, pr, NPOS, grp, HD, out, tmp);
            ops_ref_attn_pv(types[ti], v, stride, NPOS, pr, NPOS, grp, HD, ref, tmp);
            CHECK(!memcmp(out, ref, sizeof(float) * grp * HD), "attn_pv type %u grp %d differs", types[ti], grp);
        }
    }
}

/* Attention scores for F16 and BF16 K rows: the set's version must equal
 * the tile kernel (quant_mul_mat_tile, then the scale) bit for bit, across
 * key counts that cross the 8-key tiles and the 128-key blocks, and query
 * counts on the three paths: decode (1-2 rows, 3-8 rows) and prefill. */
static void test_attn_scores(void) {
    enum { MAXK = 300, MAXQ = 19, STRIDE = 2 * 128 * 3 };   /* rows of 3 heads: take head 1 */
    static uint16_t krow[MAXK * STRIDE / 2];
    static float q[MAXQ * 128], s[MAXQ * MAXK], ref[MAXQ * MAXK], tmp[128 * 128];
    const uint32_t types[2] = { GGML_TYPE_F16, GGML_TYPE_BF16 };
    const int nks[6] = { 1, 7, 8, 129, 136, MAXK }, nqs[8] = { 1, 2, 3, 4, 6, 7, 8, MAXQ }, hds[3] = { 128, 64, 40 };
    for (int ti = 0; ti < 2; ti++) {
        for (size_t i = 0; i < sizeof krow / 2; i++) {
            float f = t_rnd_float(&rng, -2.0f, 2.0f);
            krow[i] = types[ti] == GGML_TYPE_F16 ? f32_to_fp16(f) : f32_to_bf16(f);
        }
        for (int i = 0; i < MAXQ * 128; i++) q[i] = t_rnd_float(&rng, -3.0f, 3.0f);
        for (int hi = 0; hi < 3; hi++)
            for (int a = 0; a < 6; a++)
                for (int b = 0; b < 8; b++) {
                    int hd = hds[hi], nk = nks[a], nq = nqs[b];
                    const uint8_t *k = (const uint8_t *)krow + 2 * 128;
                    size_t qs = (size_t)hd * 4;
                    for (int i = 0; i < MAXQ * MAXK; i++) s[i] = ref[i] = -7.0f;
                    ops_attn_scores(types[ti], k, STRIDE, nk, q, qs, nq, hd, 0.125f, s, MAXK, tmp);
                    quant_mul_mat_tile(types[ti], hd, k, STRIDE, nk, q, qs, nq, ref, MAXK);
                    for (int r = 0; r < nq; r++)
                        for (int i = 0; i < nk; i++) ref[r * MAXK + i] *= 0.125f;
                    CHECK(!memcmp(s, ref, sizeof s), "attn_scores type %u hd %d nk %d nq %d differs", types[ti], hd,
                          nk, nq);
                }
    }
}

/* The AVX-512 exp and sum replays the AVX2 one lane for lane: the same
 * values and the same double sum, bit for bit, tails included. */
static void test_exp_sets_agree(const char *const *sets, int n_sets) {
    int has2 = 0, has512 = 0;
    for (int i = 0; i < n_sets; i++) {
        has2 |= !strcmp(sets[i], "avx2");
        has512 |= !strcmp(sets[i], "avx512");
    }
    if (!has2 || !has512) return;
    enum { N = 1000 };
    static float x[N], y2[N], y5[N];
    for (int i = 0; i < N; i++) x[i] = t_rnd_float(&rng, -90.0f, 10.0f);
    const size_t ns[5] = { 1, 7, 8, 37, N };
    for (int k = 0; k < 5; k++) {
        quant_use_kernels("avx2");
        double s2 = ops_exp_sum(x, 1.5f, y2, ns[k]);
        float m2 = ops_max(x, ns[k]);
        quant_use_kernels("avx512");
        double s5 = ops_exp_sum(x, 1.5f, y5, ns[k]);
        float m5 = ops_max(x, ns[k]);
        CHECK(s2 == s5 && !memcmp(y2, y5, sizeof(float) * ns[k]), "exp_sum avx2 vs avx512 n=%zu", ns[k]);
        CHECK(m2 == m5, "max avx2 vs avx512 n=%zu", ns[k]);
    }
    /* the clamps and NaN in every lane of the unrolled and the plain loops */
    static const float sp[8] = { NAN, INFINITY, -INFINITY, 300.0f, -300.0f, 90.3f, -102.5f, 88.79f };
    for (int k = 0; k < 48; k++) {
        for (int i = 0; i < 48; i++) x[i] = t_rnd_float(&rng, -20.0f, 5.0f);
        x[k] = sp[k % 8];
        quant_use_kernels("avx2");
        double s2 = ops_exp_sum(x, 1.5f, y2, 48);
        quant_use_kernels("avx512");
        double s5 = ops_exp_sum(x, 1.5f, y5, 48);
        CHECK(!memcmp(&s2, &s5, sizeof s2) && !memcmp(y2, y5, sizeof(float) * 48), "exp_sum special %g at %d",
              (double)sp[k % 8], k);
    }
}

/* The chunked pool: every chunk runs exactly once, tids are in range. */
typedef struct { atomic_int hits[1000]; atomic_int bad_tid; int nth; } chunk_ctx;

static void chunk_job(void *ud, int chunk, int tid) {
    chunk_ctx *c = ud;
    atomic_fetch_add(&c->hits[chunk], 1);
    if (tid < 0 || tid >= c->nth) atomic_fetch_add(&c->bad_tid, 1);
}

static void test_pool_chunks(void) {
    static chunk_ctx c;
    const int sizes[5] = { 1, 2, 3, 17, 1000 };
    for (int nth = 1; nth <= 3; nth++) {
        tpool *p = tpool_create(nth);
        CHECK(p != NULL, "pool of %d", nth);
        if (!p) continue;
        for (int si = 0; si < 5; si++) {
            int bad = 0;
            for (int rep = 0; rep < 50; rep++) {
                memset(&c, 0, sizeof c);
                c.nth = nth;
                tpool_run_chunks(p, chunk_job, &c, sizes[si]);
                for (int i = 0; i < sizes[si]; i++) bad += atomic_load(&c.hits[i]) != 1;
                bad += atomic_load(&c.bad_tid);
            }
            CHECK(bad == 0, "pool %d threads, %d chunks: %d wrong", nth, sizes[si], bad);
        }
        tpool_run_chunks(p, chunk_job, &c, 0);   /* no chunks: returns at once */
        tpool_destroy(p);
    }
}

/* More chunks (items) than one job word counts (65535): every one still
 * runs exactly once, in consecutive jobs, on every thread count. */
typedef struct { atomic_uchar *hits; atomic_int bad_tid; int nth; } big_ctx;

static void big_job(void *ud, int chunk, int tid) {
    big_ctx *c = ud;
    atomic_fetch_add(&c->hits[chunk], 1);
    if (tid < 0 || tid >= c->nth) atomic_fetch_add(&c->bad_tid, 1);
}

static void test_pool_many_chunks(void) {
    enum { N = 200001 };
    atomic_uchar *hits = calloc(N, sizeof *hits);
    CHECK(hits != NULL, "alloc");
    if (!hits) return;
    for (int nth = 1; nth <= 3; nth++) {
        tpool *p = tpool_create(nth);
        if (!p) continue;
        for (int ranged = 0; ranged < 2; ranged++) {
            big_ctx c = { hits, 0, nth };
            for (int i = 0; i < N; i++) atomic_store(&hits[i], 0);
            if (ranged) tpool_run_ranges(p, big_job, &c, N);
            else tpool_run_chunks(p, big_job, &c, N);
            int bad = atomic_load(&c.bad_tid);
            for (int i = 0; i < N; i++) bad += atomic_load(&hits[i]) != 1;
            CHECK(bad == 0, "pool %d threads, %d %s: %d wrong", nth, N, ranged ? "items" : "chunks", bad);
        }
        tpool_destroy(p);
    }
    free(hits);
}

int main(void) {
    /* every kernel set the machine runs: each brings its own element-wise ops */
    const char *sets[16];
    int n_sets = quant_kernel_sets(sets, 16);
    const char *best = quant_kernel_name();
    for (int i = 0; i < n_sets && i < 16; i++) {
        quant_use_kernels(sets[i]);
        printf("ops: %s kernels (set %s)\n", ops_vectorised() ? "vector" : "reference", quant_kernel_name());
        test_exp();
        test_swiglu();
        test_rms_norm();
        test_small();
        test_attn_pv();
        test_attn_scores();
    }
    test_exp_sets_agree(sets, n_sets < 16 ? n_sets : 16);
    quant_use_kernels(best);
    test_pool_chunks();
    test_pool_many_chunks();
    return t_done("test_ops");
}

/* ops_avx2.c - AVX2/FMA/F16C versions of the element-wise ops (ops.h).
 *
 * Built with -mavx2 -mfma -mf16c (see the Makefile) and called by ops.c only
 * when the active kernel set is an x86 one, i.e. when cpuid said the CPU has
 * these extensions. Without the flags every entry returns 0 (not handled).
 */
#include "backend/cpu/ops.h"
#include "backend/cpu/ops_kernels.h"
#include "engine/quant.h"

#include <stddef.h>
#include <stdint.h>
#include <string.h>

/* unfused multiply then add where written so (axpy, the float tiles) */
#if defined(__clang__)
#pragma STDC FP_CONTRACT OFF
#endif

#if defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)
#include <immintrin.h>
#include <math.h>


/* ==== AVX2 ==== */

/* expf of 8 lanes. x = n ln2 + r with |r| <= ln2/2 (ln2 split in two so the
 * reduction is exact enough), e^r by its degree-7 Taylor polynomial (the
 * truncation error, r^8/8!, is below 2^-27 relative), then 2^n applied as two
 * exponent-field factors so that results down in the subnormal range and up
 * to FLT_MAX come out right. Inputs are clamped to [-104, 88.8], beyond which
 * expf is 0 or inf anyway; NaN stays NaN. */
static inline __m256 ops_exp8(__m256 x) {
    const __m256 xc = _mm256_min_ps(_mm256_max_ps(x, _mm256_set1_ps(-104.0f)), _mm256_set1_ps(88.8f));
    const __m256 n = _mm256_round_ps(_mm256_mul_ps(xc, _mm256_set1_ps(1.44269504088896341f)),
                                     _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    __m256 r = _mm256_fnmadd_ps(n, _mm256_set1_ps(0.693359375f), xc);     /* ln2 high part: exact product */
    r = _mm256_fnmadd_ps(n, _mm256_set1_ps(-2.12194440e-4f), r);          /* ln2 low part */
    __m256 p = _mm256_set1_ps(1.0f / 5040.0f);
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.0f / 720.0f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.0f / 120.0f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.0f / 24.0f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.0f / 6.0f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(0.5f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.0f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.0f));
    __m256i ni = _mm256_cvtps_epi32(n);
    __m256i n1 = _mm256_srai_epi32(ni, 1), n2 = _mm256_sub_epi32(ni, n1);
    __m256 s1 = _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_add_epi32(n1, _mm256_set1_epi32(127)), 23));
    __m256 s2 = _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_add_epi32(n2, _mm256_set1_epi32(127)), 23));
    __m256 y = _mm256_mul_ps(_mm256_mul_ps(p, s1), s2);
    return _mm256_blendv_ps(y, x, _mm256_cmp_ps(x, x, _CMP_UNORD_Q));
}

static inline double ops_hsum_pd(__m256d v) {
    __m128d s = _mm_add_pd(_mm256_castpd256_pd128(v), _mm256_extractf128_pd(v, 1));
    return _mm_cvtsd_f64(_mm_add_sd(s, _mm_unpackhi_pd(s, s)));
}

static double ops_avx_exp_sum(const float *x, float sub, float *y, size_t n) {
    __m256d s0 = _mm256_setzero_pd(), s1 = _mm256_setzero_pd();
    const __m256 vs = _mm256_set1_ps(sub);
    size_t i = 0;
    for (; i + 8 <= n; i += 8) {
        __m256 e = ops_exp8(_mm256_sub_ps(_mm256_loadu_ps(x + i), vs));
        _mm256_storeu_ps(y + i, e);
        s0 = _mm256_add_pd(s0, _mm256_cvtps_pd(_mm256_castps256_ps128(e)));
        s1 = _mm256_add_pd(s1, _mm256_cvtps_pd(_mm256_extractf128_ps(e, 1)));
    }
    double sum = ops_hsum_pd(_mm256_add_pd(s0, s1));
    if (i < n) {
        float tin[8] = {0}, tout[8];
        for (size_t k = i; k < n; k++) tin[k - i] = x[k];
        _mm256_storeu_ps(tout, ops_exp8(_mm256_sub_ps(_mm256_loadu_ps(tin), vs)));
        for (size_t k = i; k < n; k++) { y[k] = tout[k - i]; sum += tout[k - i]; }
    }
    return sum;
}

static inline __m256 ops_silu_mul8(__m256 g, __m256 u) {
    __m256 e = ops_exp8(_mm256_sub_ps(_mm256_setzero_ps(), g));
    return _mm256_mul_ps(_mm256_div_ps(g, _mm256_add_ps(_mm256_set1_ps(1.0f), e)), u);
}

static void ops_avx_swiglu(const float *g, const float *u, float *y, size_t n) {
    size_t i = 0;
    for (; i + 8 <= n; i += 8)
        _mm256_storeu_ps(y + i, ops_silu_mul8(_mm256_loadu_ps(g + i), _mm256_loadu_ps(u + i)));
    if (i < n) {
        float tg[8] = {0}, tu[8] = {0}, ty[8];
        for (size_t k = i; k < n; k++) { tg[k - i] = g[k]; tu[k - i] = u[k]; }
        _mm256_storeu_ps(ty, ops_silu_mul8(_mm256_loadu_ps(tg), _mm256_loadu_ps(tu)));
        for (size_t k = i; k < n; k++) y[k] = ty[k - i];
    }
}

static void ops_avx_rms_norm_row(const float *x, const float *w, float *y, size_t n, float eps) {
    __m256d s0 = _mm256_setzero_pd(), s1 = _mm256_setzero_pd();
    size_t i = 0;
    for (; i + 8 <= n; i += 8) {
        __m256 v = _mm256_loadu_ps(x + i);
        __m256 sq = _mm256_mul_ps(v, v);   /* float square, then double sum: as the reference */
        s0 = _mm256_add_pd(s0, _mm256_cvtps_pd(_mm256_castps256_ps128(sq)));
        s1 = _mm256_add_pd(s1, _mm256_cvtps_pd(_mm256_extractf128_ps(sq, 1)));
    }
    double sum = ops_hsum_pd(_mm256_add_pd(s0, s1));
    for (size_t k = i; k < n; k++) sum += (double)(x[k] * x[k]);
    float scale = 1.0f / sqrtf((float)(sum / (double)n) + eps);
    const __m256 vs = _mm256_set1_ps(scale);
    for (i = 0; i + 8 <= n; i += 8) {
        __m256 v = _mm256_mul_ps(_mm256_loadu_ps(x + i), vs);
        if (w) v = _mm256_mul_ps(v, _mm256_loadu_ps(w + i));
        _mm256_storeu_ps(y + i, v);
    }
    for (; i < n; i++) { float v = x[i] * scale; y[i] = w ? v * w[i] : v; }
}

/* 8 F16 or BF16 values at p, as f32 */
static inline __m256 ops_load_h8(uint32_t dt, const uint8_t *p) {
    __m128i h = _mm_loadu_si128((const __m128i *)p);
    if (dt == GGML_TYPE_F16) return _mm256_cvtph_ps(h);
    return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16));
}

/* 16 values of a V row (F16, BF16, Q8_0, or F32: a block the prefill walk
 * converted) at element d (a multiple of 16), as two f32 vectors; a Q8_0
 * value is its block's scale times the int8 (quant_dequantize_row's one
 * multiply). */
static inline void ops_load_v16(uint32_t dt, const uint8_t *row, int d, __m256 *lo, __m256 *hi) {
    if (dt == GGML_TYPE_F32) {
        *lo = _mm256_loadu_ps((const float *)row + d);
        *hi = _mm256_loadu_ps((const float *)row + d + 8);
        return;
    }
    if (dt == GGML_TYPE_Q8_0) {
        const uint8_t *blk = row + (size_t)d / 32 * 34;
        uint16_t h16;
        memcpy(&h16, blk, 2);
        const __m256 sc = _mm256_set1_ps(_cvtsh_ss(h16));
        const __m128i q = _mm_loadu_si128((const __m128i *)(blk + 2 + d % 32));
        *lo = _mm256_mul_ps(sc, _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(q)));
        *hi = _mm256_mul_ps(sc, _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_srli_si128(q, 8))));
        return;
    }
    *lo = ops_load_h8(dt, row + 2 * (size_t)d);
    *hi = ops_load_h8(dt, row + 2 * (size_t)d + 16);
}

/* G (<= 4) heads x 16 columns starting at d: accumulators stay in registers
 * while the positions stream past, starting from 0 (first) or from the sums
 * out holds (the prefill walk's later blocks). One fused multiply-add per
 * position, in position order: bit-identical to the reference's fmaf. */
static inline __attribute__((always_inline)) void ops_pv_block(uint32_t dt, int G, const uint8_t *v,
        size_t v_stride, int npos, const float *pr, size_t pr_stride, int hd, int d, float *out, int first) {
    __m256 acc[4][2];
    _Pragma("GCC unroll 4")
    for (int g = 0; g < G; g++) {
        acc[g][0] = first ? _mm256_setzero_ps() : _mm256_loadu_ps(out + (size_t)g * hd + d);
        acc[g][1] = first ? _mm256_setzero_ps() : _mm256_loadu_ps(out + (size_t)g * hd + d + 8);
    }
    for (int p = 0; p < npos; p++) {
        __m256 lo, hi;
        ops_load_v16(dt, v + (size_t)p * v_stride, d, &lo, &hi);
        _Pragma("GCC unroll 4")
        for (int g = 0; g < G; g++) {
            __m256 a = _mm256_broadcast_ss(pr + (size_t)g * pr_stride + (size_t)p);
            acc[g][0] = _mm256_fmadd_ps(a, lo, acc[g][0]);
            acc[g][1] = _mm256_fmadd_ps(a, hi, acc[g][1]);
        }
    }
    _Pragma("GCC unroll 4")
    for (int g = 0; g < G; g++) {
        _mm256_storeu_ps(out + (size_t)g * hd + d, acc[g][0]);
        _mm256_storeu_ps(out + (size_t)g * hd + d + 8, acc[g][1]);
    }
}

/* Rows [0, grp) of pr against npos V rows, every 16 columns, 4 rows per
 * walk (G a constant at each ops_pv_block). */
static inline __attribute__((always_inline)) void ops_pv_rows(uint32_t dt, const uint8_t *v, size_t v_stride,
        int npos, const float *pr, size_t pr_stride, int grp, int hd, float *out, int first) {
    for (int g0 = 0; g0 < grp; g0 += 4) {
        int G = grp - g0 < 4 ? grp - g0 : 4;
        const float *pg = pr + (size_t)g0 * pr_stride;
        float *og = out + (size_t)g0 * hd;
        for (int d = 0; d < hd; d += 16) {
            switch (G) {
            case 1: ops_pv_block(dt, 1, v, v_stride, npos, pg, pr_stride, hd, d, og, first); break;
            case 2: ops_pv_block(dt, 2, v, v_stride, npos, pg, pr_stride, hd, d, og, first); break;
            case 3: ops_pv_block(dt, 3, v, v_stride, npos, pg, pr_stride, hd, d, og, first); break;
            default: ops_pv_block(dt, 4, v, v_stride, npos, pg, pr_stride, hd, d, og, first); break;
            }
        }
    }
}

/* Positions per converted V block in the prefill walk: 64 rows of a
 * 128-wide head are 32 KiB of f32, reused by every query row. */
#define OPS_AVX_PVB 64

/* Prefill, by blocks of positions: the block's V rows converted to f32 once
 * (vf, OPS_AVX_PVB x hd floats), then every query row's sums over it. The
 * walk per 4 rows and 16 columns converted each V value grp / 4 times. */
static void ops_avx_pv_prefill(uint32_t dt, const uint8_t *v, size_t v_stride, int npos, const float *pr,
                               size_t pr_stride, int grp, int hd, float *out, float *vf) {
    for (int p0 = 0; p0 < npos; p0 += OPS_AVX_PVB) {
        int np = npos - p0 < OPS_AVX_PVB ? npos - p0 : OPS_AVX_PVB;
        for (int p = 0; p < np; p++)
            for (int d = 0; d < hd; d += 16) {
                __m256 lo, hi;
                ops_load_v16(dt, v + (size_t)(p0 + p) * v_stride, d, &lo, &hi);
                _mm256_storeu_ps(vf + (size_t)p * hd + d, lo);
                _mm256_storeu_ps(vf + (size_t)p * hd + d + 8, hi);
            }
        /* the block's rows as F32 "V rows": the same walk, carrying the sums */
        ops_pv_rows(GGML_TYPE_F32, (const uint8_t *)vf, sizeof(float) * (size_t)hd, np, pr + p0, pr_stride, grp, hd,
                    out, p0 == 0);
    }
}

int ops_avx2_exp_sum(const float *x, float sub, float *y, size_t n, double *sum) {
    if (n) *sum = ops_avx_exp_sum(x, sub, y, n);
    else *sum = 0.0;
    return 1;
}

int ops_avx2_swiglu(const float *g, const float *u, float *y, size_t n) { ops_avx_swiglu(g, u, y, n); return 1; }

int ops_avx2_rms_norm_row(const float *x, const float *w, float *y, size_t n, float eps) {
    ops_avx_rms_norm_row(x, w, y, n, eps);
    return 1;
}

/* max as the reference's x[i] > m ? x[i] : m (maxps returns its second
 * operand unless the first is greater), 8 lanes, then the lanes and the tail */
int ops_avx2_max(const float *x, size_t n, float *out) {
    if (n < 8) return 0;
    __m256 m = _mm256_loadu_ps(x);
    size_t i = 8;
    for (; i + 8 <= n; i += 8) m = _mm256_max_ps(_mm256_loadu_ps(x + i), m);
    float l[8];
    _mm256_storeu_ps(l, m);
    float r = l[0];
    for (int k = 1; k < 8; k++) r = l[k] > r ? l[k] : r;
    for (; i < n; i++) r = x[i] > r ? x[i] : r;
    *out = r;
    return 1;
}

/* x[i] *= a: attention's probabilities, a row of the context's length */
int ops_avx2_scale(float *x, float a, size_t n) {
    const __m256 va = _mm256_set1_ps(a);
    size_t i = 0;
    for (; i + 8 <= n; i += 8) _mm256_storeu_ps(x + i, _mm256_mul_ps(_mm256_loadu_ps(x + i), va));
    for (; i < n; i++) x[i] *= a;
    return 1;
}

/* y += a x as the scalar loop: the product rounded, then the sum (unfused;
 * this file is built -std=c11, so the compiler contracts nothing). */
int ops_avx2_axpy(float a, const float *x, float *y, size_t n) {
    const __m256 va = _mm256_set1_ps(a);
    size_t i = 0;
    for (; i + 8 <= n; i += 8)
        _mm256_storeu_ps(y + i, _mm256_add_ps(_mm256_loadu_ps(y + i), _mm256_mul_ps(va, _mm256_loadu_ps(x + i))));
    for (; i < n; i++) y[i] += a * x[i];
    return 1;
}

/* ==== Prefill scores ====
 * The float tile of quant_avx2.c, specialised for attention's many query
 * rows: each 128-key block converted to f32 once (kf, [key][hd]) instead of
 * once per 3 query rows, tiles of 3 rows x 4 keys, and the four keys' sums
 * of a row reduced together. Each score is the tile's: eight partial sums
 * (lane l: dims 8 st + l, multiply-adds in step order), then
 * ((l0 + l4) + (l2 + l6)) + ((l1 + l5) + (l3 + l7)), then (0 + dot) * scale.
 * One Zen 5 core, 64 rows x 2048 keys x 128 (TANDEM_KERNELS=avx2): the
 * tile path 44 GFLOP/s, this 80 (ymm FMA peak 134). */
#define OPS_A2_KB 128   /* kf is ops_attn_tmp(hd) floats: 128 rows of hd */

/* a, b, c, d: four keys' eight partial sums -> in each 128-bit lane (a | b)
 * and (c | d) the first two tree levels: [x0 + x2, x1 + x3] per key, as
 * [a0 a1 c0 c1 | b0 b1 d0 d1] */
static inline __attribute__((always_inline)) __m256 ops_a2_reduce2(__m256 a, __m256 b, __m256 c, __m256 d) {
    __m256 ab = _mm256_add_ps(_mm256_permute2f128_ps(a, b, 0x20), _mm256_permute2f128_ps(a, b, 0x31));
    __m256 cd = _mm256_add_ps(_mm256_permute2f128_ps(c, d, 0x20), _mm256_permute2f128_ps(c, d, 0x31));
    return _mm256_add_ps(_mm256_shuffle_ps(ab, cd, _MM_SHUFFLE(1, 0, 1, 0)),
                         _mm256_shuffle_ps(ab, cd, _MM_SHUFFLE(3, 2, 3, 2)));
}

/* RQ (<= 3) rows x 4 keys of kf (rows of hd floats). RQ is a constant at
 * each call (inlined): its loops unroll into registers; as a call the tile
 * ran at 60 GFLOP/s instead of 80. */
static inline __attribute__((always_inline)) void ops_a2_tile(int RQ, const float *kf, int hd,
                                                              const float *const *qr, float scale, float *s,
                                                              size_t s_stride, int nvalid) {
    __m256 acc[3][4];
    _Pragma("GCC unroll 3")
    for (int r = 0; r < RQ; r++)
        _Pragma("GCC unroll 4")
        for (int j = 0; j < 4; j++) acc[r][j] = _mm256_setzero_ps();
    for (int d = 0; d < hd; d += 8) {
        __m256 q[3];
        _Pragma("GCC unroll 3")
        for (int r = 0; r < RQ; r++) q[r] = _mm256_loadu_ps(qr[r] + d);
        _Pragma("GCC unroll 4")
        for (int j = 0; j < 4; j++) {
            const __m256 k = _mm256_loadu_ps(kf + (size_t)j * hd + d);
            _Pragma("GCC unroll 3")
            for (int r = 0; r < RQ; r++) acc[r][j] = _mm256_fmadd_ps(k, q[r], acc[r][j]);
        }
    }
    __m256 w[3];
    _Pragma("GCC unroll 3")
    for (int r = 0; r < RQ; r++) w[r] = ops_a2_reduce2(acc[r][0], acc[r][1], acc[r][2], acc[r][3]);
    const __m256i idx = _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7);
    _Pragma("GCC unroll 2")
    for (int r = 0; r < RQ; r += 2) {
        __m256 u = w[r], v = r + 1 < RQ ? w[r + 1] : w[r];
        /* third level: [a c a' c' | b d b' d'] -> [a b c d | a' b' c' d'] */
        __m256 t = _mm256_add_ps(_mm256_shuffle_ps(u, v, _MM_SHUFFLE(2, 0, 2, 0)),
                                 _mm256_shuffle_ps(u, v, _MM_SHUFFLE(3, 1, 3, 1)));
        t = _mm256_permutevar8x32_ps(t, idx);
        t = _mm256_mul_ps(_mm256_add_ps(_mm256_setzero_ps(), t), _mm256_set1_ps(scale));
        const __m128i m = _mm_cmpgt_epi32(_mm_set1_epi32(nvalid), _mm_setr_epi32(0, 1, 2, 3));
        _mm_maskstore_ps(s + (size_t)r * s_stride, m, _mm256_castps256_ps128(t));
        if (r + 1 < RQ) _mm_maskstore_ps(s + (size_t)(r + 1) * s_stride, m, _mm256_extractf128_ps(t, 1));
    }
}

int ops_avx2_attn_scores(uint32_t dt, const uint8_t *k, size_t k_stride, int nk, const float *q, size_t q_stride,
                         int nq, int hd, float scale, float *s, size_t s_stride, float *kf) {
    /* the tile reduces in one chunk up to 512 values (QA_FCHUNK); few rows keep the tile */
    if ((dt != GGML_TYPE_F16 && dt != GGML_TYPE_BF16) || hd % 8 || hd > 512 || nq <= 4 || nk < 1) return 0;
    for (int k0 = 0; k0 < nk; k0 += OPS_A2_KB) {
        int nkb = nk - k0 < OPS_A2_KB ? nk - k0 : OPS_A2_KB;
        for (int i = 0; i < nkb; i++) {
            const uint8_t *row = k + (size_t)(k0 + i) * k_stride;
            for (int d = 0; d < hd; d += 8) _mm256_storeu_ps(kf + (size_t)i * hd + d, ops_load_h8(dt, row + 2 * (size_t)d));
        }
        for (int i = nkb; i < (nkb + 3) / 4 * 4; i++) memset(kf + (size_t)i * hd, 0, sizeof(float) * (size_t)hd);
        for (int r0 = 0; r0 < nq; r0 += 3) {
            int RQ = nq - r0 < 3 ? nq - r0 : 3;
            const float *qr[3];
            for (int r = 0; r < 3; r++)
                qr[r] = (const float *)((const uint8_t *)q + (size_t)(r0 + (r < RQ ? r : 0)) * q_stride);
            for (int j0 = 0; j0 < nkb; j0 += 4) {
                int nv = nkb - j0 < 4 ? nkb - j0 : 4;
                float *so = s + (size_t)r0 * s_stride + k0 + j0;
                const float *kfj = kf + (size_t)j0 * hd;
                if (RQ == 3) ops_a2_tile(3, kfj, hd, qr, scale, so, s_stride, nv);
                else if (RQ == 2) ops_a2_tile(2, kfj, hd, qr, scale, so, s_stride, nv);
                else ops_a2_tile(1, kfj, hd, qr, scale, so, s_stride, nv);
            }
        }
    }
    return 1;
}

/* vf: OPS_AVX_PVB * hd floats of scratch, or NULL. More than 8 rows (a
 * prefill block) go by converted blocks, fewer (decode) by one walk per 4
 * rows and 16 columns. */
int ops_avx2_attn_pv(uint32_t dt, const uint8_t *v, size_t v_stride, int npos, const float *pr,
                     size_t pr_stride, int grp, int hd, float *out, float *vf) {
    if ((dt != GGML_TYPE_F16 && dt != GGML_TYPE_BF16 && dt != GGML_TYPE_Q8_0) || hd % 16) return 0;
    if (grp > 8 && vf && npos > 0) ops_avx_pv_prefill(dt, v, v_stride, npos, pr, pr_stride, grp, hd, out, vf);
    else ops_pv_rows(dt, v, v_stride, npos, pr, pr_stride, grp, hd, out, 1);
    return 1;
}
#else
int ops_avx2_exp_sum(const float *x, float sub, float *y, size_t n, double *sum) { return 0; }
int ops_avx2_swiglu(const float *g, const float *u, float *y, size_t n) { return 0; }
int ops_avx2_rms_norm_row(const float *x, const float *w, float *y, size_t n, float eps) { return 0; }
int ops_avx2_scale(float *x, float a, size_t n) { return 0; }
int ops_avx2_axpy(float a, const float *x, float *y, size_t n) { return 0; }
int ops_avx2_max(const float *x, size_t n, float *m) { return 0; }
int ops_avx2_attn_scores(uint32_t dt, const uint8_t *k, size_t k_stride, int nk, const float *q, size_t q_stride,
                         int nq, int hd, float scale, float *s, size_t s_stride, float *kf) { return 0; }
int ops_avx2_attn_pv(uint32_t dt, const uint8_t *v, size_t v_stride, int npos, const float *pr,
                     size_t pr_stride, int grp, int hd, float *out, float *vf) { return 0; }
#endif

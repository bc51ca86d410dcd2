/* ops_avx512.c - attention's inner kernels on zmm registers: the scores
 * (ops_attn_scores), the softmax pieces (max, exp and sum) and the weighted
 * sum of V rows (ops_attn_pv). Built with the avx512 kernel set's flags and
 * used with that set (quant_kernel_vec_ops() == QK_VEC_AVX512).
 *
 * Every kernel here computes each value with the same operations in the
 * same order as the version it replaces, so results are bit-identical:
 *   - scores: the ymm float tile of quant_avx2.c keeps eight partial sums per
 *     (key, query) and adds them in a fixed tree; here one zmm register holds
 *     the eight partial sums of two keys side by side, so each lane sees the
 *     same fused multiply-adds, and the tree is replayed with shuffles;
 *   - exp: the float polynomial of ops_avx2.c (ops_exp8), sixteen lanes at once;
 *   - V sum: one fused multiply-add per position, in position order (the
 *     reference's fmaf), for up to 8 query rows per walk (prefill) or all
 *     128 columns of 2 rows (decode: each V row segment read once,
 *     prefetched). Fused since the V sums were a third of a 4096-token
 *     prefill on a Zen 4 (512-bit multiply and add are two double-pumped
 *     operations there): Qwen3-0.6B Q4_K_M pp4096 195 -> 218 t/s; the
 *     F16 files' argmax unchanged, qwen3-mini-Q4_K_M's worst step 0.505 ->
 *     0.542 here and 0.594 -> 0.617 with the avx2 set (its tolerance 0.65).
 * The quantised golden tests sit close to their tolerances and move with
 * any change of rounding, which is why exactness is kept. */
#include "backend/cpu/ops.h"
#include "backend/cpu/ops_kernels.h"
#include "engine/quant.h"

#include <stddef.h>
#include <stdint.h>
#include <string.h>

#if defined(__clang__)
#pragma STDC FP_CONTRACT OFF
#endif

#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512DQ__)
#include <immintrin.h>

#define OPS_INLINE static inline __attribute__((always_inline))

/* ==== Weighted sum of V rows ==== */

/* Bytes from a V row's start to its element d (a multiple of 32), and of
 * n such values: F16 and BF16 2 a value, Q8_0 34 per block of 32 (an f16
 * scale, 32 int8). */
OPS_INLINE size_t ops_v_off(uint32_t dt, size_t d) { return dt == GGML_TYPE_Q8_0 ? d / 32 * 34 : 2 * d; }

/* 32 values of a V row (F16, BF16, Q8_0, or F32: a block the prefill walk
 * converted) at element d (a multiple of 32), as two f32 vectors. A Q8_0
 * block's values are scale x int8, the one float multiply
 * quant_dequantize_row does. */
OPS_INLINE void ops_load_v32(uint32_t dt, const uint8_t *row, int d, __m512 *lo, __m512 *hi) {
    if (dt == GGML_TYPE_F32) {
        *lo = _mm512_loadu_ps((const float *)row + d);
        *hi = _mm512_loadu_ps((const float *)row + d + 16);
        return;
    }
    if (dt == GGML_TYPE_Q8_0) {
        const uint8_t *blk = row + (size_t)d / 32 * 34;
        uint16_t h16;
        memcpy(&h16, blk, 2);
        const __m512 sc = _mm512_set1_ps(_cvtsh_ss(h16));
        const __m128i q0 = _mm_loadu_si128((const __m128i *)(blk + 2)), q1 = _mm_loadu_si128((const __m128i *)(blk + 18));
        *lo = _mm512_mul_ps(sc, _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(q0)));
        *hi = _mm512_mul_ps(sc, _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(q1)));
        return;
    }
    __m512i h = _mm512_loadu_si512((const void *)(row + 2 * (size_t)d));
    __m256i h0 = _mm512_castsi512_si256(h), h1 = _mm512_extracti64x4_epi64(h, 1);
    if (dt == GGML_TYPE_F16) {
        *lo = _mm512_cvtph_ps(h0);
        *hi = _mm512_cvtph_ps(h1);
    } else {
        *lo = _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h0), 16));
        *hi = _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h1), 16));
    }
}

/* Rows ahead that the decode walks prefetch (3 KiB of a 128-wide F16
 * head). The cache is head-major, so a walk is one sequential stream:
 * 12, 32 and 64 rows ahead measured the same (Qwen3-0.6B shape at depth
 * 4096, 2 threads: 35-37 GB/s with the machine streaming 40-42). */
#define OPS_PF_ROWS 12
/* Rows ahead that the block conversions (keys to kf, values to vf) prefetch.
 * Without it a decode step of many heads per KV head (the prefill path:
 * Qwen2.5-0.5B's 7, the 30B-A3B's 8) read its cache at 5-10 GB/s; measured
 * at depth 4096, 2 threads: 12 rows ahead 4.0 ms per token, 32: 3.4, 64:
 * 3.3-3.4, 128: 3.8 (Qwen2.5-0.5B shape); 30B-A3B shape, 8 layers: 6.5
 * without, 4.8 with 32. */
#define OPS_PF_CONV 32

OPS_INLINE void ops_prefetch_seg(const uint8_t *p, int bytes) {
    for (int o = 0; o < bytes; o += 64) _mm_prefetch((const char *)p + o, _MM_HINT_T0);
}

/* G (<= 8) query rows x 32 columns from d; the accumulators stay in
 * registers while the positions stream past, starting from 0 (first) or from
 * the sums out holds (the prefill walk's later blocks), and each converted V
 * vector serves all G rows. pf (or NULL): pf_bytes of the row at pf + p *
 * v_stride are prefetched beside position p. */
OPS_INLINE void ops_pv_block32(uint32_t dt, int G, const uint8_t *v, size_t v_stride, int npos, const float *pr,
                               size_t pr_stride, int hd, int d, float *out, int first, const uint8_t *pf, int pf_bytes) {
    __m512 acc[8][2];
    _Pragma("GCC unroll 8")
    for (int g = 0; g < G; g++) {
        acc[g][0] = first ? _mm512_setzero_ps() : _mm512_loadu_ps(out + (size_t)g * hd + d);
        acc[g][1] = first ? _mm512_setzero_ps() : _mm512_loadu_ps(out + (size_t)g * hd + d + 16);
    }
    for (int p = 0; p < npos; p++) {
        __m512 lo, hi;
        if (pf) ops_prefetch_seg(pf + (size_t)p * v_stride, pf_bytes);
        ops_load_v32(dt, v + (size_t)p * v_stride, d, &lo, &hi);
        _Pragma("GCC unroll 8")
        for (int g = 0; g < G; g++) {
            __m512 a = _mm512_set1_ps(pr[(size_t)g * pr_stride + (size_t)p]);
            acc[g][0] = _mm512_fmadd_ps(a, lo, acc[g][0]);
            acc[g][1] = _mm512_fmadd_ps(a, hi, acc[g][1]);
        }
    }
    _Pragma("GCC unroll 8")
    for (int g = 0; g < G; g++) {
        _mm512_storeu_ps(out + (size_t)g * hd + d, acc[g][0]);
        _mm512_storeu_ps(out + (size_t)g * hd + d + 16, acc[g][1]);
    }
}

/* Rows [0, grp) of pr against npos V rows, every 32 columns, 8 rows per
 * walk (G a constant at each ops_pv_block32). */
OPS_INLINE void ops_pv_rows32(uint32_t dt, const uint8_t *v, size_t v_stride, int npos, const float *pr,
                              size_t pr_stride, int grp, int hd, float *out, int first, const uint8_t *pf) {
    const int pfb = (int)ops_v_off(dt, (size_t)hd);   /* a whole row of the next block */
    for (int g0 = 0; g0 < grp; g0 += 8) {
        int G = grp - g0 < 8 ? grp - g0 : 8;
        const float *pg = pr + (size_t)g0 * pr_stride;
        float *og = out + (size_t)g0 * hd;
        for (int d = 0; d < hd; d += 32) {
            /* the first walk of a block prefetches the next block's rows */
            const uint8_t *pfd = g0 == 0 && d == 0 ? pf : NULL;
            switch (G) {
            case 1: ops_pv_block32(dt, 1, v, v_stride, npos, pg, pr_stride, hd, d, og, first, pfd, pfb); break;
            case 2: ops_pv_block32(dt, 2, v, v_stride, npos, pg, pr_stride, hd, d, og, first, pfd, pfb); break;
            case 3: ops_pv_block32(dt, 3, v, v_stride, npos, pg, pr_stride, hd, d, og, first, pfd, pfb); break;
            case 4: ops_pv_block32(dt, 4, v, v_stride, npos, pg, pr_stride, hd, d, og, first, pfd, pfb); break;
            case 5: ops_pv_block32(dt, 5, v, v_stride, npos, pg, pr_stride, hd, d, og, first, pfd, pfb); break;
            case 6: ops_pv_block32(dt, 6, v, v_stride, npos, pg, pr_stride, hd, d, og, first, pfd, pfb); break;
            case 7: ops_pv_block32(dt, 7, v, v_stride, npos, pg, pr_stride, hd, d, og, first, pfd, pfb); break;
            default: ops_pv_block32(dt, 8, v, v_stride, npos, pg, pr_stride, hd, d, og, first, pfd, pfb); break;
            }
        }
    }
}

/* Decode: G (1 or 2) query rows x 128 columns from d: each position's
 * 256-byte V segment is read once, in one pass (16 accumulators). */
OPS_INLINE void ops_pv_block128(uint32_t dt, int G, const uint8_t *v, size_t v_stride, int npos, const float *pr,
                                size_t pr_stride, int hd, int d, float *out) {
    __m512 acc[2][8];
    _Pragma("GCC unroll 8")
    for (int c = 0; c < 8; c++) acc[0][c] = acc[1][c] = _mm512_setzero_ps();
    for (int p = 0; p < npos; p++) {
        const uint8_t *row = v + (size_t)p * v_stride;
        if (p + OPS_PF_ROWS < npos)
            ops_prefetch_seg(row + OPS_PF_ROWS * v_stride + ops_v_off(dt, (size_t)d), (int)ops_v_off(dt, 128));
        __m512 x[8];
        _Pragma("GCC unroll 4")
        for (int c = 0; c < 4; c++) ops_load_v32(dt, row, d + 32 * c, &x[2 * c], &x[2 * c + 1]);
        _Pragma("GCC unroll 2")
        for (int g = 0; g < G; g++) {
            __m512 a = _mm512_set1_ps(pr[(size_t)g * pr_stride + (size_t)p]);
            _Pragma("GCC unroll 8")
            for (int c = 0; c < 8; c++) acc[g][c] = _mm512_fmadd_ps(a, x[c], acc[g][c]);
        }
    }
    _Pragma("GCC unroll 2")
    for (int g = 0; g < G; g++)
        _Pragma("GCC unroll 8")
        for (int c = 0; c < 8; c++) _mm512_storeu_ps(out + (size_t)g * hd + d + 16 * c, acc[g][c]);
}

/* Positions per converted V block in the prefill walk: 64 rows of a
 * 128-wide head are 32 KiB of f32 (L1), reused by every query row. */
#define OPS_PVB 64

/* Prefill, by blocks of positions: the block's V rows are converted to f32
 * once (vf, [OPS_PVB][hd]) and then serve all query rows, G (<= 8) rows x
 * 32 columns at a time, the partial sums carried in out between blocks.
 * Each output is still 0 + p_0 v_0 + p_1 v_1 + ... rounded step by step in
 * position order: the same value as one walk over all positions. */
static void ops_pv_prefill(uint32_t dt, const uint8_t *v, size_t v_stride, int npos, const float *pr,
                           size_t pr_stride, int grp, int hd, float *out, float *vf) {
    for (int p0 = 0; p0 < npos; p0 += OPS_PVB) {
        int np = npos - p0 < OPS_PVB ? npos - p0 : OPS_PVB;
        for (int p = 0; p < np; p++) {
            if (p0 + p + OPS_PF_CONV < npos)
                ops_prefetch_seg(v + (size_t)(p0 + p + OPS_PF_CONV) * v_stride, (int)ops_v_off(dt, (size_t)hd));
            for (int d = 0; d < hd; d += 32) {
                __m512 lo, hi;
                ops_load_v32(dt, v + (size_t)(p0 + p) * v_stride, d, &lo, &hi);
                _mm512_storeu_ps(vf + (size_t)p * hd + d, lo);
                _mm512_storeu_ps(vf + (size_t)p * hd + d + 16, hi);
            }
        }
        /* the block's rows as F32 "V rows": the same walk, carrying the sums */
        ops_pv_rows32(GGML_TYPE_F32, (const uint8_t *)vf, sizeof(float) * (size_t)hd, np, pr + p0, pr_stride, grp,
                      hd, out, p0 == 0, NULL);
    }
}

/* vf: OPS_PVB * hd floats of scratch, or NULL (then one walk per 32 columns). */
int ops_avx512_attn_pv(uint32_t dt, const uint8_t *v, size_t v_stride, int npos, const float *pr,
                       size_t pr_stride, int grp, int hd, float *out, float *vf) {
    if ((dt != GGML_TYPE_F16 && dt != GGML_TYPE_BF16 && dt != GGML_TYPE_Q8_0) || hd % 32) return 0;
    if (grp <= 4 && hd % 128 == 0) {
        /* a few rows (decode): one sequential pass over V per pair of rows */
        for (int g0 = 0; g0 < grp; g0 += 2) {
            const float *pg = pr + (size_t)g0 * pr_stride;
            float *og = out + (size_t)g0 * hd;
            for (int d = 0; d < hd; d += 128) {
                if (grp - g0 == 1) ops_pv_block128(dt, 1, v, v_stride, npos, pg, pr_stride, hd, d, og);
                else ops_pv_block128(dt, 2, v, v_stride, npos, pg, pr_stride, hd, d, og);
            }
        }
        return 1;
    }
    if (grp <= 8) {
        /* up to 8 rows (decode, 5-8 query heads per KV head): each block of
         * OPS_PVB rows (16 KiB of a 128-wide F16 head, in L1) walked once per
         * 32 columns, converted in registers; the first walk prefetches the
         * next block. Against converting the block to f32 first (the path
         * below), 2 threads at depth 4096, the 30B-A3B shape's 8 rows x 128:
         * V sums +13-16%, the whole attention +6-7%; Qwen2.5-0.5B's 7 x 64:
         * +25-60% and +15-18%. Same products, same order: the same bits. */
        for (int p0 = 0; p0 < npos; p0 += OPS_PVB) {
            int np = npos - p0 < OPS_PVB ? npos - p0 : OPS_PVB;
            /* the next block, when it is as long as this one (its np rows are prefetched) */
            const uint8_t *pf = p0 + 2 * np <= npos ? v + (size_t)(p0 + np) * v_stride : NULL;
            ops_pv_rows32(dt, v + (size_t)p0 * v_stride, v_stride, np, pr + p0, pr_stride, grp, hd, out, p0 == 0, pf);
        }
        return 1;
    }
    if (vf && npos > 0) {
        ops_pv_prefill(dt, v, v_stride, npos, pr, pr_stride, grp, hd, out, vf);
        return 1;
    }
    ops_pv_rows32(dt, v, v_stride, npos, pr, pr_stride, grp, hd, out, 1, NULL);
    return 1;
}

/* ==== Softmax pieces ==== */

/* expf of 16 floats: ops_exp8 of ops_avx2.c lane for lane (the same
 * clamps, reduction, degree-7 polynomial and two-factor scaling; NaN stays
 * NaN). Within 1 ulp of libm's expf (0.45% of the floats in [-87, 0] are
 * 1 ulp off, none more). It replaced a double-precision
 * polynomial (8 lanes, degree 10) that the 4096-token prefill spent 7% of
 * its time in. */
OPS_INLINE __m512 ops_exp16(__m512 x) {
    const __m512 xc = _mm512_min_ps(_mm512_max_ps(x, _mm512_set1_ps(-104.0f)), _mm512_set1_ps(88.8f));
    const __m512 n = _mm512_roundscale_ps(_mm512_mul_ps(xc, _mm512_set1_ps(1.44269504088896341f)),
                                          _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    __m512 r = _mm512_fnmadd_ps(n, _mm512_set1_ps(0.693359375f), xc);
    r = _mm512_fnmadd_ps(n, _mm512_set1_ps(-2.12194440e-4f), r);
    __m512 p = _mm512_set1_ps(1.0f / 5040.0f);
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f / 720.0f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f / 120.0f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f / 24.0f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f / 6.0f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(0.5f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f));
    const __m512i ni = _mm512_cvtps_epi32(n);
    const __m512i n1 = _mm512_srai_epi32(ni, 1), n2 = _mm512_sub_epi32(ni, n1);
    const __m512 s1 = _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_add_epi32(n1, _mm512_set1_epi32(127)), 23));
    const __m512 s2 = _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_add_epi32(n2, _mm512_set1_epi32(127)), 23));
    const __m512 y = _mm512_mul_ps(_mm512_mul_ps(p, s1), s2);
    return _mm512_mask_mov_ps(y, _mm512_cmp_ps_mask(x, x, _CMP_UNORD_Q), x);
}

/* 8 lanes of the same */
OPS_INLINE __m256 ops_exp8_512(__m256 x) { return _mm512_castps512_ps256(ops_exp16(_mm512_castps256_ps512(x))); }

/* The sum keeps ops_avx2.c's order: 8 values at a time into two running
 * quadruples (here the halves of one zmm), those added and reduced, then the
 * tail one by one. */
int ops_avx512_exp_sum(const float *x, float sub, float *y, size_t n, double *sum) {
    __m512d acc = _mm512_setzero_pd();
    const __m256 vs = _mm256_set1_ps(sub);
    const __m512 vs16 = _mm512_set1_ps(sub);
    size_t i = 0;
    for (; i + 32 <= n; i += 32) {
        __m512 e0 = ops_exp16(_mm512_sub_ps(_mm512_loadu_ps(x + i), vs16));
        __m512 e1 = ops_exp16(_mm512_sub_ps(_mm512_loadu_ps(x + i + 16), vs16));
        _mm512_storeu_ps(y + i, e0);
        _mm512_storeu_ps(y + i + 16, e1);
        acc = _mm512_add_pd(acc, _mm512_cvtps_pd(_mm512_castps512_ps256(e0)));
        acc = _mm512_add_pd(acc, _mm512_cvtps_pd(_mm512_extractf32x8_ps(e0, 1)));
        acc = _mm512_add_pd(acc, _mm512_cvtps_pd(_mm512_castps512_ps256(e1)));
        acc = _mm512_add_pd(acc, _mm512_cvtps_pd(_mm512_extractf32x8_ps(e1, 1)));
    }
    for (; i + 8 <= n; i += 8) {
        __m256 e = ops_exp8_512(_mm256_sub_ps(_mm256_loadu_ps(x + i), vs));
        _mm256_storeu_ps(y + i, e);
        acc = _mm512_add_pd(acc, _mm512_cvtps_pd(e));
    }
    __m256d q = _mm256_add_pd(_mm512_castpd512_pd256(acc), _mm512_extractf64x4_pd(acc, 1));
    __m128d h = _mm_add_pd(_mm256_castpd256_pd128(q), _mm256_extractf128_pd(q, 1));
    double s = _mm_cvtsd_f64(_mm_add_sd(h, _mm_unpackhi_pd(h, h)));
    if (i < n) {
        __mmask8 m = (__mmask8)((1u << (n - i)) - 1);
        __m256 t = ops_exp8_512(_mm256_sub_ps(_mm256_maskz_loadu_ps(m, x + i), vs));
        float tout[8];
        _mm256_storeu_ps(tout, t);
        for (size_t k = i; k < n; k++) { y[k] = tout[k - i]; s += tout[k - i]; }
    }
    *sum = s;
    return 1;
}

/* max as the reference's x[i] > m ? x[i] : m (maxps picks its second operand
 * unless the first is greater). */
int ops_avx512_max(const float *x, size_t n, float *out) {
    if (n < 16) return 0;
    __m512 m = _mm512_loadu_ps(x);
    size_t i = 16;
    for (; i + 16 <= n; i += 16) m = _mm512_max_ps(_mm512_loadu_ps(x + i), m);
    float r = _mm512_reduce_max_ps(m);
    for (; i < n; i++) r = x[i] > r ? x[i] : r;
    *out = r;
    return 1;
}

/* x[i] *= a, the tail masked */
int ops_avx512_scale(float *x, float a, size_t n) {
    const __m512 va = _mm512_set1_ps(a);
    size_t i = 0;
    for (; i + 16 <= n; i += 16) _mm512_storeu_ps(x + i, _mm512_mul_ps(_mm512_loadu_ps(x + i), va));
    if (i < n) {
        __mmask16 m = (__mmask16)((1u << (n - i)) - 1);
        _mm512_mask_storeu_ps(x + i, m, _mm512_mul_ps(_mm512_maskz_loadu_ps(m, x + i), va));
    }
    return 1;
}

/* ==== Scores ==== */

/* Query rows and key pairs per score tile: 4 x 4 accumulators (8 keys). */
#define OPS_QT 4
#define OPS_PT 4
/* Keys per converted block: 128 keys of a 128-wide head are 64 KiB of f32. */
#define OPS_KBLK 128

/* Eight partial sums of keys 2j and 2j+1 side by side (lanes 0-7, 8-15):
 * the quarters are [key 2j: lanes 0-3, 4-7 | key 2j+1: lanes 0-3, 4-7].
 * Reduces acc[0..3] (four pairs, eight keys) in the ymm tile's tree
 * ((l0+l4)+(l2+l6)) + ((l1+l5)+(l3+l7)) and returns the 8 sums in key order. */
OPS_INLINE __m256 ops_reduce8(__m512 a0, __m512 a1, __m512 a2, __m512 a3) {
    /* lo128 + hi128 of each key: [k0 k1 k2 k3] as four quadruples */
    __m512 s01 = _mm512_add_ps(_mm512_shuffle_f32x4(a0, a1, _MM_SHUFFLE(2, 0, 2, 0)),
                               _mm512_shuffle_f32x4(a0, a1, _MM_SHUFFLE(3, 1, 3, 1)));
    __m512 s23 = _mm512_add_ps(_mm512_shuffle_f32x4(a2, a3, _MM_SHUFFLE(2, 0, 2, 0)),
                               _mm512_shuffle_f32x4(a2, a3, _MM_SHUFFLE(3, 1, 3, 1)));
    /* [a b c d] -> lane 0: (a + c) + (b + d) */
    s01 = _mm512_add_ps(s01, _mm512_permute_ps(s01, _MM_SHUFFLE(1, 0, 3, 2)));
    s23 = _mm512_add_ps(s23, _mm512_permute_ps(s23, _MM_SHUFFLE(1, 0, 3, 2)));
    s01 = _mm512_add_ps(s01, _mm512_permute_ps(s01, _MM_SHUFFLE(2, 3, 0, 1)));
    s23 = _mm512_add_ps(s23, _mm512_permute_ps(s23, _MM_SHUFFLE(2, 3, 0, 1)));
    const __m512i idx = _mm512_setr_epi32(0, 4, 8, 12, 16, 20, 24, 28, 0, 0, 0, 0, 0, 0, 0, 0);
    return _mm512_castps512_ps256(_mm512_permutex2var_ps(s01, idx, s23));
}

/* Store 8 scores (nvalid of them) as the tile path does: (0 + dot) * scale. */
OPS_INLINE void ops_store_scores(float *s, __m256 r, float scale, int nvalid) {
    r = _mm256_mul_ps(_mm256_add_ps(_mm256_setzero_ps(), r), _mm256_set1_ps(scale));
    if (nvalid >= 8) _mm256_storeu_ps(s, r);
    else _mm256_mask_storeu_ps(s, (__mmask8)((1u << nvalid) - 1), r);
}

/* Prefill tile: RQ query rows x 8 keys, each score's eight partial sums
 * split over two registers so that the tree's first level is a vertical
 * add: acc[r][g][h], lane 4 * kk + l, holds partial sum 4 h + l of key
 * 4 g + kk (same fused multiply-adds per lane, same order). kf, the
 * converted block's group of 8 keys, is [step][h][g][4 keys x 4 values];
 * qp the rows' packed values, [step][OPS_QT][8]. The reduction of all RQ
 * rows then takes 13 operations (in-lane shuffles) per 16 scores instead of
 * 26 (half of them across lanes) with two keys per register. With the
 * pointers per row and per pair of that layout the compiler had also run
 * out of registers and spilled a key vector inside the loop. One Zen 5
 * core, 64 query rows x 2048 keys x 128 (FMA peak 268 GFLOP/s): 162 ->
 * 175-190 GFLOP/s. */
OPS_INLINE void ops_score_tile_kf(int RQ, const float *kf, int nsteps, const float *qp, float scale,
                                  float *s, size_t s_stride, int nvalid) {
    __m512 acc[OPS_QT][2][2];
    _Pragma("GCC unroll 4")
    for (int r = 0; r < RQ; r++)
        acc[r][0][0] = acc[r][0][1] = acc[r][1][0] = acc[r][1][1] = _mm512_setzero_ps();
    for (int st = 0; st < nsteps; st++) {
        const float *kst = kf + (size_t)st * 64, *qst = qp + (size_t)st * 8 * OPS_QT;
        _Pragma("GCC unroll 2")
        for (int h = 0; h < 2; h++) {
            __m512 w0 = _mm512_loadu_ps(kst + 32 * h), w1 = _mm512_loadu_ps(kst + 32 * h + 16);
            _Pragma("GCC unroll 4")
            for (int r = 0; r < RQ; r++) {
                __m512 a = _mm512_broadcast_f32x4(_mm_loadu_ps(qst + 8 * r + 4 * h));
                acc[r][0][h] = _mm512_fmadd_ps(w0, a, acc[r][0][h]);
                acc[r][1][h] = _mm512_fmadd_ps(w1, a, acc[r][1][h]);
            }
        }
    }
    /* per 128-bit lane kk: (l0+l4)+(l2+l6) and (l1+l5)+(l3+l7) of keys kk
     * (g 0) and 4+kk (g 1), then their sum, two rows per register: lanes
     * [row r key kk, row r key 4+kk, row r+1 key kk, row r+1 key 4+kk] */
    const __m512i idx = _mm512_setr_epi32(0, 4, 8, 12, 1, 5, 9, 13, 2, 6, 10, 14, 3, 7, 11, 15);
    const __m512 vs = _mm512_set1_ps(scale);
    _Pragma("GCC unroll 2")
    for (int r = 0; r < RQ; r += 2) {
        __m512 e[2];
        _Pragma("GCC unroll 2")
        for (int i = 0; i < 2; i++) {
            int rr = r + i < RQ ? r + i : r;
            __m512 x = _mm512_add_ps(acc[rr][0][0], acc[rr][0][1]), y = _mm512_add_ps(acc[rr][1][0], acc[rr][1][1]);
            e[i] = _mm512_add_ps(_mm512_shuffle_ps(x, y, _MM_SHUFFLE(1, 0, 1, 0)),
                                 _mm512_shuffle_ps(x, y, _MM_SHUFFLE(3, 2, 3, 2)));
        }
        __m512 t = _mm512_add_ps(_mm512_shuffle_ps(e[0], e[1], _MM_SHUFFLE(2, 0, 2, 0)),
                                 _mm512_shuffle_ps(e[0], e[1], _MM_SHUFFLE(3, 1, 3, 1)));
        /* the tile path's (0 + dot) * scale, row r in the low half */
        t = _mm512_mul_ps(_mm512_add_ps(_mm512_setzero_ps(), _mm512_permutexvar_ps(idx, t)), vs);
        const __mmask8 m = nvalid >= 8 ? 0xff : (__mmask8)((1u << nvalid) - 1);
        _mm256_mask_storeu_ps(s + (size_t)r * s_stride, m, _mm512_castps512_ps256(t));
        if (r + 1 < RQ) _mm256_mask_storeu_ps(s + (size_t)(r + 1) * s_stride, m, _mm512_extractf32x8_ps(t, 1));
    }
}

/* 8 values of keys a and b (F16 or BF16) at step st, as one f32 vector. */
OPS_INLINE __m512 ops_load_pair(uint32_t dt, const uint8_t *a, const uint8_t *b, int st) {
    __m256i h = _mm256_inserti128_si256(_mm256_castsi128_si256(_mm_loadu_si128((const __m128i *)(a + 16 * st))),
                                        _mm_loadu_si128((const __m128i *)(b + 16 * st)), 1);
    if (dt == GGML_TYPE_F16) return _mm512_cvtph_ps(h);
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
}

/* Decode tile: RQ (1 or 2) query rows x 8 keys converted as they stream
 * (each key row read once: conversion is cheaper than a second pass). */
OPS_INLINE void ops_score_tile_kv(uint32_t dt, int RQ, const uint8_t *const *kr, int nsteps,
                                  const float *const *qr, float scale, float *s, size_t s_stride, int nvalid) {
    __m512 acc[2][OPS_PT];
    _Pragma("GCC unroll 2")
    for (int r = 0; r < RQ; r++)
        _Pragma("GCC unroll 4")
        for (int j = 0; j < OPS_PT; j++) acc[r][j] = _mm512_setzero_ps();
    for (int st = 0; st < nsteps; st++) {
        __m512 w[OPS_PT];
        _Pragma("GCC unroll 4")
        for (int j = 0; j < OPS_PT; j++) w[j] = ops_load_pair(dt, kr[2 * j], kr[2 * j + 1], st);
        _Pragma("GCC unroll 2")
        for (int r = 0; r < RQ; r++) {
            __m512 a = _mm512_broadcast_f32x8(_mm256_loadu_ps(qr[r] + 8 * st));
            _Pragma("GCC unroll 4")
            for (int j = 0; j < OPS_PT; j++) acc[r][j] = _mm512_fmadd_ps(w[j], a, acc[r][j]);
        }
    }
    _Pragma("GCC unroll 2")
    for (int r = 0; r < RQ; r++)
        ops_store_scores(s + (size_t)r * s_stride, ops_reduce8(acc[r][0], acc[r][1], acc[r][2], acc[r][3]), scale,
                         nvalid);
}

/* Step st of keys a, b, c, d (F16 or BF16) as kf's two vectors: values
 * 0-3 of the four keys, then values 4-7. */
OPS_INLINE void ops_convert_quad(uint32_t dt, const uint8_t *a, const uint8_t *b, const uint8_t *c,
                                 const uint8_t *d, int st, float *out) {
    __m512 ab = ops_load_pair(dt, a, b, st), cd = ops_load_pair(dt, c, d, st);
    _mm512_storeu_ps(out, _mm512_shuffle_f32x4(ab, cd, _MM_SHUFFLE(2, 0, 2, 0)));
    _mm512_storeu_ps(out + 32, _mm512_shuffle_f32x4(ab, cd, _MM_SHUFFLE(3, 1, 3, 1)));
}

/* Convert keys [k0, k0 + nkb) to kf's layout, per group of 8 keys
 * [step][h][g][4 keys x 4 values]; missing keys of the last group are
 * zeros. dt is a constant at each call of ops_convert_quad. */
static void ops_convert_keys(uint32_t dt, const uint8_t *k, size_t k_stride, int k0, int nkb, int nk, int hd,
                             float *kf) {
    const int nsteps = hd / 8, nquads = (nkb + 7) / 8 * 2;
    for (int j = 0; j < nquads; j++) {
        int ka = k0 + 4 * j;
        for (int e = ka + OPS_PF_CONV; e < ka + 4 + OPS_PF_CONV && e < nk; e++)
            ops_prefetch_seg(k + (size_t)e * k_stride, 2 * hd);
        float *kfj = kf + (size_t)(j / 2) * nsteps * 64 + 16 * (j % 2);
        const uint8_t *r[4];
        for (int i = 0; i < 4; i++) r[i] = k + (size_t)(4 * j + i < nkb ? ka + i : k0) * k_stride;
        if (4 * j + 4 <= nkb) {
            for (int st = 0; st < nsteps; st++)
                if (dt == GGML_TYPE_F16) ops_convert_quad(GGML_TYPE_F16, r[0], r[1], r[2], r[3], st, kfj + (size_t)st * 64);
                else ops_convert_quad(GGML_TYPE_BF16, r[0], r[1], r[2], r[3], st, kfj + (size_t)st * 64);
            continue;
        }
        /* the block's last keys: lanes of missing keys are zeros */
        __mmask16 m = 0;
        for (int i = 0; i < 4; i++)
            if (4 * j + i < nkb) m |= (__mmask16)(0xf << (4 * i));
        for (int st = 0; st < nsteps; st++) {
            float *o = kfj + (size_t)st * 64;
            ops_convert_quad(dt, r[0], r[1], r[2], r[3], st, o);
            _mm512_storeu_ps(o, _mm512_maskz_mov_ps(m, _mm512_loadu_ps(o)));
            _mm512_storeu_ps(o + 32, _mm512_maskz_mov_ps(m, _mm512_loadu_ps(o + 32)));
        }
    }
}

/* query row r (q_stride is in bytes) */
OPS_INLINE const float *ops_qrow(const float *q, size_t q_stride, int r) {
    return (const float *)((const uint8_t *)q + (size_t)r * q_stride);
}

static void ops_scores_prefill(uint32_t dt, const uint8_t *k, size_t k_stride, int nk, const float *q,
                               size_t q_stride, int nq, int hd, float scale, float *s, size_t s_stride, float *kf) {
    const int nsteps = hd / 8;
    for (int k0 = 0; k0 < nk; k0 += OPS_KBLK) {
        int nkb = nk - k0 < OPS_KBLK ? nk - k0 : OPS_KBLK;
        ops_convert_keys(dt, k, k_stride, k0, nkb, nk, hd, kf);
        for (int r0 = 0; r0 < nq; r0 += OPS_QT) {
            int RQ = nq - r0 < OPS_QT ? nq - r0 : OPS_QT;
            float qp[512 / 8 * 8 * OPS_QT];   /* the group's rows, [step][row][8] (hd <= 512) */
            for (int r = 0; r < RQ; r++) {
                const float *qr = ops_qrow(q, q_stride, r0 + r);
                for (int st = 0; st < nsteps; st++)
                    _mm256_storeu_ps(qp + (size_t)st * 8 * OPS_QT + 8 * r, _mm256_loadu_ps(qr + 8 * st));
            }
            float *so = s + (size_t)r0 * s_stride + k0;
            for (int j0 = 0; j0 < nkb; j0 += 8) {
                const float *kfj = kf + (size_t)(j0 / 8) * nsteps * 64;
                int nv = nkb - j0 < 8 ? nkb - j0 : 8;
                switch (RQ) {
                case 1: ops_score_tile_kf(1, kfj, nsteps, qp, scale, so + j0, s_stride, nv); break;
                case 2: ops_score_tile_kf(2, kfj, nsteps, qp, scale, so + j0, s_stride, nv); break;
                case 3: ops_score_tile_kf(3, kfj, nsteps, qp, scale, so + j0, s_stride, nv); break;
                default: ops_score_tile_kf(4, kfj, nsteps, qp, scale, so + j0, s_stride, nv); break;
                }
            }
        }
    }
}

/* Decode tile for 3 to 8 query rows (a KV head's query heads, one token):
 * RQ rows x 4 keys (two pairs, converted as they stream, each key row read
 * once for all rows); qp holds the rows packed, [step][8][8]. Converting
 * blocks of keys to f32 first (the prefill path) cost more than the
 * products for so few rows: 7 rows x 4096 keys x 64 from memory, 64-77 us
 * per head that way, 57-60 this way. */
OPS_INLINE void ops_score_tile_kv4(uint32_t dt, int RQ, const uint8_t *const *kr, int nsteps, const float *qp,
                                   float scale, float *s, size_t s_stride, int nvalid) {
    __m512 acc[8][2];
    _Pragma("GCC unroll 8")
    for (int r = 0; r < RQ; r++) acc[r][0] = acc[r][1] = _mm512_setzero_ps();
    for (int st = 0; st < nsteps; st++) {
        const __m512 w0 = ops_load_pair(dt, kr[0], kr[1], st), w1 = ops_load_pair(dt, kr[2], kr[3], st);
        _Pragma("GCC unroll 8")
        for (int r = 0; r < RQ; r++) {
            __m512 a = _mm512_broadcast_f32x8(_mm256_loadu_ps(qp + (size_t)st * 64 + 8 * r));
            acc[r][0] = _mm512_fmadd_ps(w0, a, acc[r][0]);
            acc[r][1] = _mm512_fmadd_ps(w1, a, acc[r][1]);
        }
    }
    const __mmask8 m = (__mmask8)((1u << nvalid) - 1);
    const __m256 vs = _mm256_set1_ps(scale);
    _Pragma("GCC unroll 4")
    for (int r = 0; r < RQ; r += 2) {
        int r1 = r + 1 < RQ ? r + 1 : r;
        /* lanes 0-3: row r's four keys, 4-7: row r1's; the tile path's (0 + dot) * scale */
        __m256 t = ops_reduce8(acc[r][0], acc[r][1], acc[r1][0], acc[r1][1]);
        t = _mm256_mul_ps(_mm256_add_ps(_mm256_setzero_ps(), t), vs);
        _mm_mask_storeu_ps(s + (size_t)r * s_stride, m, _mm256_castps256_ps128(t));
        if (r + 1 < RQ) _mm_mask_storeu_ps(s + (size_t)(r + 1) * s_stride, m, _mm256_extractf128_ps(t, 1));
    }
}

/* Rows ahead for that walk: 4 keys take longer than 8 of the 2-row tile.
 * Qwen2.5-0.5B shape (7 rows, 64 wide, 2 KV heads) from memory, one core:
 * 12 rows ahead 63-64 us per head at 4096 keys, 24: 58-62, 32: 57-58, 64:
 * 60-62; the 30B-A3B shape (8 rows x 128) gave 110-118 at every distance. */
#define OPS_PF_DEC8 32

static void ops_scores_decode8(uint32_t dt, const uint8_t *k, size_t k_stride, int nk, const float *q,
                               size_t q_stride, int nq, int hd, float scale, float *s, size_t s_stride) {
    const int nsteps = hd / 8, seg = hd * 2;
    float qp[512 / 8 * 64];   /* [step][8 rows][8] (hd <= 512) */
    for (int r = 0; r < nq; r++)
        for (int st = 0; st < nsteps; st++)
            _mm256_storeu_ps(qp + (size_t)st * 64 + 8 * r, _mm256_loadu_ps(ops_qrow(q, q_stride, r) + 8 * st));
    for (int j0 = 0; j0 < nk; j0 += 4) {
        const uint8_t *kr[4];
        int nv = nk - j0 < 4 ? nk - j0 : 4;
        for (int j = 0; j < 4; j++) kr[j] = k + (size_t)(j0 + (j < nv ? j : 0)) * k_stride;
        for (int j = 0; j < 4 && j0 + OPS_PF_DEC8 + j < nk; j++)
            ops_prefetch_seg(k + (size_t)(j0 + OPS_PF_DEC8 + j) * k_stride, seg);
        float *so = s + j0;
        switch (nq) {
        case 3: ops_score_tile_kv4(dt, 3, kr, nsteps, qp, scale, so, s_stride, nv); break;
        case 4: ops_score_tile_kv4(dt, 4, kr, nsteps, qp, scale, so, s_stride, nv); break;
        case 5: ops_score_tile_kv4(dt, 5, kr, nsteps, qp, scale, so, s_stride, nv); break;
        case 6: ops_score_tile_kv4(dt, 6, kr, nsteps, qp, scale, so, s_stride, nv); break;
        case 7: ops_score_tile_kv4(dt, 7, kr, nsteps, qp, scale, so, s_stride, nv); break;
        default: ops_score_tile_kv4(dt, 8, kr, nsteps, qp, scale, so, s_stride, nv); break;
        }
    }
}

static void ops_scores_decode(uint32_t dt, const uint8_t *k, size_t k_stride, int nk, const float *q,
                              size_t q_stride, int nq, int hd, float scale, float *s, size_t s_stride) {
    const int nsteps = hd / 8, seg = hd * 2;
    for (int r0 = 0; r0 < nq; r0 += 2) {
        int RQ = nq - r0 < 2 ? nq - r0 : 2;
        const float *qr[2] = { ops_qrow(q, q_stride, r0), ops_qrow(q, q_stride, r0 + RQ - 1) };
        for (int j0 = 0; j0 < nk; j0 += 8) {
            const uint8_t *kr[8];
            int nv = nk - j0 < 8 ? nk - j0 : 8;
            for (int j = 0; j < 8; j++) kr[j] = k + (size_t)(j0 + (j < nv ? j : 0)) * k_stride;
            for (int j = 0; j < 8 && j0 + OPS_PF_ROWS + j < nk; j++)
                ops_prefetch_seg(k + (size_t)(j0 + OPS_PF_ROWS + j) * k_stride, seg);
            if (RQ == 1) ops_score_tile_kv(dt, 1, kr, nsteps, qr, scale, s + (size_t)r0 * s_stride + j0, s_stride, nv);
            else ops_score_tile_kv(dt, 2, kr, nsteps, qr, scale, s + (size_t)r0 * s_stride + j0, s_stride, nv);
        }
    }
}

/* tmp: OPS_KBLK * hd floats (the converted key block), used when nq > 4. */
int ops_avx512_attn_scores(uint32_t dt, const uint8_t *k, size_t k_stride, int nk, const float *q, size_t q_stride,
                           int nq, int hd, float scale, float *s, size_t s_stride, float *tmp) {
    /* the ymm tile reduces in one chunk up to 512 values (QA_FCHUNK) */
    if ((dt != GGML_TYPE_F16 && dt != GGML_TYPE_BF16) || hd % 8 || hd > 512 || nk < 1 || nq < 1) return 0;
    if (nq > 8) ops_scores_prefill(dt, k, k_stride, nk, q, q_stride, nq, hd, scale, s, s_stride, tmp);
    else if (nq > 2) ops_scores_decode8(dt, k, k_stride, nk, q, q_stride, nq, hd, scale, s, s_stride);
    else ops_scores_decode(dt, k, k_stride, nk, q, q_stride, nq, hd, scale, s, s_stride);
    return 1;
}
#else
int ops_avx512_attn_pv(uint32_t dt, const uint8_t *v, size_t v_stride, int npos, const float *pr,
                       size_t pr_stride, int grp, int hd, float *out, float *vf) { return 0; }
int ops_avx512_exp_sum(const float *x, float sub, float *y, size_t n, double *sum) { return 0; }
int ops_avx512_max(const float *x, size_t n, float *m) { return 0; }
int ops_avx512_scale(float *x, float a, size_t n) { return 0; }
int ops_avx512_attn_scores(uint32_t dt, const uint8_t *k, size_t k_stride, int nk, const float *q, size_t q_stride,
                           int nq, int hd, float scale, float *s, size_t s_stride, float *tmp) { return 0; }
#endif

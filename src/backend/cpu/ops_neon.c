/* ops_neon.c - NEON versions of the element-wise ops and of attention's V
 * sums (ops.h), for arm64.
 *
 * NEON is part of armv8-a, so this file needs no flags of its own; ops.c
 * calls it when the active kernel set is one of the arm64 ones (neon,
 * dotprod, i8mm: quant_kernel_vec_ops() == QK_VEC_NEON). Built for any
 * other target, every entry returns 0 (not handled). The attention scores
 * need nothing here: on arm64 they run on the NEON float tiles of
 * quant_neon.c (ops_attn_scores' fallback).
 *
 * Numerics follow ops_avx2.c: the same exp (argument reduction, degree-7
 * polynomial, two exponent-field factors), so within 1 ulp of expf;
 * softmax and RMS sums in double; the V sums one fused multiply-add per
 * term in position order, as the reference (the same bits).
 */
#include "backend/cpu/ops.h"
#include "backend/cpu/ops_kernels.h"
#include "engine/quant.h"

#include <stddef.h>
#include <stdint.h>
#include <string.h>

/* unfused multiply then add where written so (axpy) */
#if defined(__clang__)
#pragma STDC FP_CONTRACT OFF
#endif

#if defined(__aarch64__) && defined(__ARM_NEON)
#include <arm_neon.h>
#include <math.h>

#define OPS_NEON_UNROLL _Pragma("GCC unroll 4")

/* ==== exp ==== */

/* expf of 4 lanes: ops_avx2.c's ops_exp8 lane for lane (its comment says
 * why each step is exact enough). Inputs clamped to [-104, 88.8]; NaN stays
 * NaN. vrndnq rounds half to even, as _MM_FROUND_TO_NEAREST_INT does. */
static inline float32x4_t ops_neon_exp4(float32x4_t x) {
    const float32x4_t xc = vminq_f32(vmaxq_f32(x, vdupq_n_f32(-104.0f)), vdupq_n_f32(88.8f));
    const float32x4_t n = vrndnq_f32(vmulq_f32(xc, vdupq_n_f32(1.44269504088896341f)));
    float32x4_t r = vfmsq_f32(xc, n, vdupq_n_f32(0.693359375f));   /* ln2 high part: exact product */
    r = vfmsq_f32(r, n, vdupq_n_f32(-2.12194440e-4f));              /* ln2 low part */
    float32x4_t p = vdupq_n_f32(1.0f / 5040.0f);
    p = vfmaq_f32(vdupq_n_f32(1.0f / 720.0f), p, r);
    p = vfmaq_f32(vdupq_n_f32(1.0f / 120.0f), p, r);
    p = vfmaq_f32(vdupq_n_f32(1.0f / 24.0f), p, r);
    p = vfmaq_f32(vdupq_n_f32(1.0f / 6.0f), p, r);
    p = vfmaq_f32(vdupq_n_f32(0.5f), p, r);
    p = vfmaq_f32(vdupq_n_f32(1.0f), p, r);
    p = vfmaq_f32(vdupq_n_f32(1.0f), p, r);
    const int32x4_t ni = vcvtq_s32_f32(n);   /* n is integral: truncation is exact */
    const int32x4_t n1 = vshrq_n_s32(ni, 1), n2 = vsubq_s32(ni, n1);
    const float32x4_t s1 = vreinterpretq_f32_s32(vshlq_n_s32(vaddq_s32(n1, vdupq_n_s32(127)), 23));
    const float32x4_t s2 = vreinterpretq_f32_s32(vshlq_n_s32(vaddq_s32(n2, vdupq_n_s32(127)), 23));
    const float32x4_t y = vmulq_f32(vmulq_f32(p, s1), s2);
    return vbslq_f32(vceqq_f32(x, x), y, x);   /* NaN lanes: x itself */
}

/* y = exp(x - sub), returning the sum of y in double: four double lanes
 * (two pairs), then the tail's lanes in order. */
static double ops_neon_exp_sum_run(const float *x, float sub, float *y, size_t n) {
    float64x2_t s0 = vdupq_n_f64(0.0), s1 = vdupq_n_f64(0.0);
    const float32x4_t vs = vdupq_n_f32(sub);
    size_t i = 0;
    for (; i + 4 <= n; i += 4) {
        const float32x4_t e = ops_neon_exp4(vsubq_f32(vld1q_f32(x + i), vs));
        vst1q_f32(y + i, e);
        s0 = vaddq_f64(s0, vcvt_f64_f32(vget_low_f32(e)));
        s1 = vaddq_f64(s1, vcvt_high_f64_f32(e));
    }
    double sum = vaddvq_f64(vaddq_f64(s0, s1));
    if (i < n) {
        float tin[4] = { 0 }, tout[4];
        for (size_t k = i; k < n; k++) tin[k - i] = x[k];
        vst1q_f32(tout, ops_neon_exp4(vsubq_f32(vld1q_f32(tin), vs)));
        for (size_t k = i; k < n; k++) { y[k] = tout[k - i]; sum += tout[k - i]; }
    }
    return sum;
}

/* ==== SiLU gate, RMS norm, scale, axpy, max ==== */

static inline float32x4_t ops_neon_silu_mul4(float32x4_t g, float32x4_t u) {
    const float32x4_t e = ops_neon_exp4(vnegq_f32(g));
    return vmulq_f32(vdivq_f32(g, vaddq_f32(vdupq_n_f32(1.0f), e)), u);
}

int ops_neon_swiglu(const float *g, const float *u, float *y, size_t n) {
    size_t i = 0;
    for (; i + 4 <= n; i += 4) vst1q_f32(y + i, ops_neon_silu_mul4(vld1q_f32(g + i), vld1q_f32(u + i)));
    if (i < n) {
        float tg[4] = { 0 }, tu[4] = { 0 }, ty[4];
        for (size_t k = i; k < n; k++) { tg[k - i] = g[k]; tu[k - i] = u[k]; }
        vst1q_f32(ty, ops_neon_silu_mul4(vld1q_f32(tg), vld1q_f32(tu)));
        for (size_t k = i; k < n; k++) y[k] = ty[k - i];
    }
    return 1;
}

int ops_neon_rms_norm_row(const float *x, const float *w, float *y, size_t n, float eps) {
    float64x2_t s0 = vdupq_n_f64(0.0), s1 = vdupq_n_f64(0.0);
    size_t i = 0;
    for (; i + 4 <= n; i += 4) {
        const float32x4_t v = vld1q_f32(x + i), sq = vmulq_f32(v, v);   /* float square, double sum: as the reference */
        s0 = vaddq_f64(s0, vcvt_f64_f32(vget_low_f32(sq)));
        s1 = vaddq_f64(s1, vcvt_high_f64_f32(sq));
    }
    double sum = vaddvq_f64(vaddq_f64(s0, s1));
    for (size_t k = i; k < n; k++) sum += (double)(x[k] * x[k]);
    const float scale = 1.0f / sqrtf((float)(sum / (double)n) + eps);
    const float32x4_t vs = vdupq_n_f32(scale);
    for (i = 0; i + 4 <= n; i += 4) {
        float32x4_t v = vmulq_f32(vld1q_f32(x + i), vs);
        if (w) v = vmulq_f32(v, vld1q_f32(w + i));
        vst1q_f32(y + i, v);
    }
    for (; i < n; i++) { const float v = x[i] * scale; y[i] = w ? v * w[i] : v; }
    return 1;
}

int ops_neon_scale(float *x, float a, size_t n) {
    const float32x4_t va = vdupq_n_f32(a);
    size_t i = 0;
    for (; i + 4 <= n; i += 4) vst1q_f32(x + i, vmulq_f32(vld1q_f32(x + i), va));
    for (; i < n; i++) x[i] *= a;
    return 1;
}

/* y += a x, multiply then add (unfused, as the plain loop) */
int ops_neon_axpy(float a, const float *x, float *y, size_t n) {
    const float32x4_t va = vdupq_n_f32(a);
    size_t i = 0;
    for (; i + 4 <= n; i += 4) vst1q_f32(y + i, vaddq_f32(vld1q_f32(y + i), vmulq_f32(va, vld1q_f32(x + i))));
    for (; i < n; i++) y[i] += a * x[i];
    return 1;
}

/* max as the reference's x[i] > m ? x[i] : m, 4 lanes, then the lanes in
 * order and the tail */
int ops_neon_max(const float *x, size_t n, float *out) {
    if (n < 4) return 0;
    float32x4_t m = vld1q_f32(x);
    size_t i = 4;
    for (; i + 4 <= n; i += 4) {
        const float32x4_t v = vld1q_f32(x + i);
        m = vbslq_f32(vcgtq_f32(v, m), v, m);
    }
    float l[4];
    vst1q_f32(l, m);
    float r = l[0];
    for (int k = 1; k < 4; k++) r = l[k] > r ? l[k] : r;
    for (; i < n; i++) r = x[i] > r ? x[i] : r;
    *out = r;
    return 1;
}

/* ==== Weighted sum of V rows ==== */

/* 16 values of a V row (F16, BF16, Q8_0, or F32) at element d (a multiple of
 * 16: for Q8_0 the first or second half of block d / 32) as f32; a Q8_0
 * value is its block's scale times the int8, the one multiply
 * quant_dequantize_row does. */
static inline void ops_neon_load_v16(uint32_t dt, const uint8_t *row, int d, float32x4_t v[4]) {
    if (dt == GGML_TYPE_F32) {   /* a block the prefill walk converted */
        for (int i = 0; i < 4; i++) v[i] = vld1q_f32((const float *)row + d + 4 * i);
        return;
    }
    if (dt == GGML_TYPE_Q8_0) {
        const uint8_t *blk = row + (size_t)d / 32 * 34;
        uint16_t h16;
        memcpy(&h16, blk, 2);
        const float sc = fp16_to_f32(h16);
        const int8x16_t q = vld1q_s8((const int8_t *)blk + 2 + d % 32);
        const int16x8_t lo = vmovl_s8(vget_low_s8(q)), hi = vmovl_high_s8(q);
        v[0] = vmulq_n_f32(vcvtq_f32_s32(vmovl_s16(vget_low_s16(lo))), sc);
        v[1] = vmulq_n_f32(vcvtq_f32_s32(vmovl_high_s16(lo)), sc);
        v[2] = vmulq_n_f32(vcvtq_f32_s32(vmovl_s16(vget_low_s16(hi))), sc);
        v[3] = vmulq_n_f32(vcvtq_f32_s32(vmovl_high_s16(hi)), sc);
        return;
    }
    const uint16x8_t h0 = vld1q_u16((const uint16_t *)row + d), h1 = vld1q_u16((const uint16_t *)row + d + 8);
    if (dt == GGML_TYPE_F16) {
        v[0] = vcvt_f32_f16(vreinterpret_f16_u16(vget_low_u16(h0)));
        v[1] = vcvt_f32_f16(vreinterpret_f16_u16(vget_high_u16(h0)));
        v[2] = vcvt_f32_f16(vreinterpret_f16_u16(vget_low_u16(h1)));
        v[3] = vcvt_f32_f16(vreinterpret_f16_u16(vget_high_u16(h1)));
        return;
    }
    v[0] = vreinterpretq_f32_u32(vshll_n_u16(vget_low_u16(h0), 16));   /* BF16: the top half of an f32 */
    v[1] = vreinterpretq_f32_u32(vshll_n_u16(vget_high_u16(h0), 16));
    v[2] = vreinterpretq_f32_u32(vshll_n_u16(vget_low_u16(h1), 16));
    v[3] = vreinterpretq_f32_u32(vshll_n_u16(vget_high_u16(h1), 16));
}

/* Positions per block: 64 rows of a 128-wide F16 head are 16 KiB, in L1
 * while each group of columns and rows passes over them. */
#define OPS_NEON_PVB 64

/* Columns [d, d + 16) of RG (1..4) query rows over the block's np
 * positions, carrying the sums in registers: out[g][d..] (zero at the first
 * block) + one fused multiply-add per position, in position order. */
static inline __attribute__((always_inline)) void ops_neon_pv_tile(uint32_t dt, int RG, const uint8_t *v,
                                                                    size_t v_stride, int np, const float *pr,
                                                                    size_t pr_stride, int d, float *out, int hd,
                                                                    int first) {
    float32x4_t acc[4][4];
    OPS_NEON_UNROLL
    for (int r = 0; r < RG; r++)
        OPS_NEON_UNROLL
        for (int i = 0; i < 4; i++)
            acc[r][i] = first ? vdupq_n_f32(0.0f) : vld1q_f32(out + (size_t)r * hd + d + 4 * i);
    for (int p = 0; p < np; p++) {
        float32x4_t x[4];
        ops_neon_load_v16(dt, v + (size_t)p * v_stride, d, x);
        OPS_NEON_UNROLL
        for (int r = 0; r < RG; r++) {
            const float a = pr[(size_t)r * pr_stride + (size_t)p];
            OPS_NEON_UNROLL
            for (int i = 0; i < 4; i++) acc[r][i] = vfmaq_n_f32(acc[r][i], x[i], a);
        }
    }
    OPS_NEON_UNROLL
    for (int r = 0; r < RG; r++)
        OPS_NEON_UNROLL
        for (int i = 0; i < 4; i++) vst1q_f32(out + (size_t)r * hd + d + 4 * i, acc[r][i]);
}

/* Rows above which a block of V is converted to f32 once (into vf) and the
 * rows' sums read it from there: with a few rows (decode) converting in
 * registers, once per group of 4 rows, is cheaper than the round trip. */
#define OPS_NEON_PV_CONVERT 8

/* out[g] = sum over p of pr[g][p] V[p] for g < grp: blocks of positions,
 * 16 columns and 4 rows at a time (16 sums in registers). vf: scratch of
 * OPS_NEON_PVB x hd floats (ops_attn_tmp), or NULL. */
int ops_neon_attn_pv(uint32_t dt, const uint8_t *v, size_t v_stride, int npos, const float *pr,
                     size_t pr_stride, int grp, int hd, float *out, float *vf) {
    if ((dt != GGML_TYPE_F16 && dt != GGML_TYPE_BF16 && dt != GGML_TYPE_Q8_0) || grp < 1 || hd < 16) return 0;
    if (hd % (dt == GGML_TYPE_Q8_0 ? 32 : 16)) return 0;
    if (npos < 1) {
        memset(out, 0, sizeof(float) * (size_t)grp * (size_t)hd);
        return 1;
    }
    const int convert = vf && grp > OPS_NEON_PV_CONVERT;
    const uint32_t bt = convert ? GGML_TYPE_F32 : dt;
    const size_t bs = convert ? sizeof(float) * (size_t)hd : v_stride;
    for (int p0 = 0; p0 < npos; p0 += OPS_NEON_PVB) {
        const int np = npos - p0 < OPS_NEON_PVB ? npos - p0 : OPS_NEON_PVB;
        const uint8_t *vb = v + (size_t)p0 * v_stride;
        if (convert) {   /* exact: the same values the tiles would convert */
            for (int p = 0; p < np; p++)
                for (int d = 0; d < hd; d += 16) {
                    float32x4_t x[4];
                    ops_neon_load_v16(dt, vb + (size_t)p * v_stride, d, x);
                    for (int i = 0; i < 4; i++) vst1q_f32(vf + (size_t)p * hd + d + 4 * i, x[i]);
                }
            vb = (const uint8_t *)vf;
        }
        for (int d = 0; d < hd; d += 16)
            for (int g0 = 0; g0 < grp; g0 += 4) {
                const float *pg = pr + (size_t)g0 * pr_stride + (size_t)p0;
                float *og = out + (size_t)g0 * hd;
                switch (grp - g0 < 4 ? grp - g0 : 4) {
                case 1: ops_neon_pv_tile(bt, 1, vb, bs, np, pg, pr_stride, d, og, hd, p0 == 0); break;
                case 2: ops_neon_pv_tile(bt, 2, vb, bs, np, pg, pr_stride, d, og, hd, p0 == 0); break;
                case 3: ops_neon_pv_tile(bt, 3, vb, bs, np, pg, pr_stride, d, og, hd, p0 == 0); break;
                default: ops_neon_pv_tile(bt, 4, vb, bs, np, pg, pr_stride, d, og, hd, p0 == 0); break;
                }
            }
    }
    return 1;
}

int ops_neon_exp_sum(const float *x, float sub, float *y, size_t n, double *sum) {
    *sum = n ? ops_neon_exp_sum_run(x, sub, y, n) : 0.0;
    return 1;
}

#else
int ops_neon_exp_sum(const float *x, float sub, float *y, size_t n, double *sum) { return 0; }
int ops_neon_swiglu(const float *g, const float *u, float *y, size_t n) { return 0; }
int ops_neon_rms_norm_row(const float *x, const float *w, float *y, size_t n, float eps) { return 0; }
int ops_neon_scale(float *x, float a, size_t n) { return 0; }
int ops_neon_axpy(float a, const float *x, float *y, size_t n) { return 0; }
int ops_neon_max(const float *x, size_t n, float *m) { return 0; }
int ops_neon_attn_pv(uint32_t dt, const uint8_t *v, size_t v_stride, int npos, const float *pr,
                     size_t pr_stride, int grp, int hd, float *out, float *vf) { return 0; }
#endif

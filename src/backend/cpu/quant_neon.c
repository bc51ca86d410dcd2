/* quant_neon.c - NEON kernels (arm64).
 *
 * This file is the neon set (quant_kernels.h: armv8-a, what every arm64 CPU
 * runs) and the body of the dotprod set: quant_neon_dotprod.c includes it
 * with QN_SET renamed and is compiled for armv8.2-a+dotprod, so qn_dot is
 * one sdot there and quant_dispatch.c picks that set when the hwcaps say the CPU has
 * it (most arm64 cores since 2018: Graviton 2 on, Apple M1 on, the Grace and
 * GB10 CPUs). quant_neon_i8mm.c builds it a third time for
 * armv8.2-a+dotprod+i8mm: there the prefill tiles take two weight rows
 * against two activation rows at once with smmla (an 8-deep int8 product of
 * 2x8 by 8x2 matrices), picked where the hwcaps say the CPU has it (Neoverse
 * V1/V2 and N2, so Graviton 3/4 and Grace; Cortex-X2 on; Apple M2 on). No
 * -march flag is needed for any of them.
 *
 * Each weight block is decoded once and multiplied against up to four
 * activation rows. Per-block integer sums equal the reference ones, and the
 * float accumulation follows the reference order (one block after another).
 */
#include "engine/quant.h"
#include "engine/quant_kernels.h"

#ifndef QN_SET
#define QN_SET neon
#define QN_SET_OK 1     /* the includer says whether the build has its extension */
#endif
#define QN_CAT2(a, b) a##_##b
#define QN_CAT(a, b) QN_CAT2(a, b)
#define QN_STR2(a) #a
#define QN_STR(a) QN_STR2(a)
#define QN_NEEDS_neon 0u
#define QN_NEEDS_dotprod QK_CPU_DOTPROD
#define QN_NEEDS_i8mm (QK_CPU_DOTPROD | QK_CPU_I8MM)

#if defined(__ARM_NEON) && defined(__aarch64__) && QN_SET_OK
#include <arm_neon.h>
#include <string.h>

#define QN_INLINE static inline __attribute__((always_inline))
#define QN_UNROLL _Pragma("GCC unroll 8")
/* Activation rows per pass: enough reuse of a decoded block, few registers. */
#define QN_ROWS 4

/* ==== Helpers ==== */
/* acc + four-way int8 dot products per int32 lane */
QN_INLINE int32x4_t qn_dot(int32x4_t acc, int8x16_t a, int8x16_t b) {
#if defined(__ARM_FEATURE_DOTPROD)
    return vdotq_s32(acc, a, b);
#else
    int16x8_t lo = vmull_s8(vget_low_s8(a), vget_low_s8(b));
    int16x8_t hi = vmull_high_s8(a, b);
    return vpadalq_s16(vpadalq_s16(acc, lo), hi);
#endif
}

QN_INLINE float qn_h2f(fp16_t h) { return fp16_to_f32(h); }

/* 16 bits starting at byte p[0] (bits of p[0], then p[1]) -> 16 bytes of 0x10 or 0 */
QN_INLINE uint8x16_t qn_bits16(uint8_t b0, uint8_t b1) {
    const uint8x16_t mask = { 1, 2, 4, 8, 16, 32, 64, 128, 1, 2, 4, 8, 16, 32, 64, 128 };
    uint8x16_t v = vcombine_u8(vdup_n_u8(b0), vdup_n_u8(b1));
    return vandq_u8(vtstq_u8(v, mask), vdupq_n_u8(0x10));
}

/* ==== 32-element formats (Q4_0, Q5_0, Q8_0) x Q8_0 ==== */
QN_INLINE void qn_decode_b32(uint32_t type, const uint8_t *blk, int8x16_t *v0, int8x16_t *v1, float *d) {
    if (type == GGML_TYPE_Q8_0) {
        const block_q8_0 *b = (const block_q8_0 *)blk;
        *d = qn_h2f(b->d);
        *v0 = vld1q_s8(b->qs);
        *v1 = vld1q_s8(b->qs + 16);
        return;
    }
    if (type == GGML_TYPE_Q4_0) {
        const block_q4_0 *b = (const block_q4_0 *)blk;
        uint8x16_t raw = vld1q_u8(b->qs);
        *d = qn_h2f(b->d);
        *v0 = vsubq_s8(vreinterpretq_s8_u8(vandq_u8(raw, vdupq_n_u8(0xF))), vdupq_n_s8(8));
        *v1 = vsubq_s8(vreinterpretq_s8_u8(vshrq_n_u8(raw, 4)), vdupq_n_s8(8));
        return;
    }
    const block_q5_0 *b = (const block_q5_0 *)blk;
    uint8x16_t raw = vld1q_u8(b->qs);
    *d = qn_h2f(b->d);
    uint8x16_t lo = vorrq_u8(vandq_u8(raw, vdupq_n_u8(0xF)), qn_bits16(b->qh[0], b->qh[1]));
    uint8x16_t hi = vorrq_u8(vshrq_n_u8(raw, 4), qn_bits16(b->qh[2], b->qh[3]));
    *v0 = vsubq_s8(vreinterpretq_s8_u8(lo), vdupq_n_s8(16));
    *v1 = vsubq_s8(vreinterpretq_s8_u8(hi), vdupq_n_s8(16));
}

QN_INLINE size_t qn_bsize_b32(uint32_t type) {
    return type == GGML_TYPE_Q8_0 ? sizeof(block_q8_0)
         : type == GGML_TYPE_Q4_0 ? sizeof(block_q4_0) : sizeof(block_q5_0);
}

QN_INLINE void qn_row_b32(uint32_t type, int RA, int64_t nb, const uint8_t *w, const block_q8_0 *const *a,
                          float *res) {
    float acc[QN_ROWS] = { 0 };
    const size_t bs = qn_bsize_b32(type);
    for (int64_t b = 0; b < nb; b++) {
        int8x16_t v0, v1;
        float dw;
        qn_decode_b32(type, w + (size_t)b * bs, &v0, &v1, &dw);
        QN_UNROLL
        for (int r = 0; r < RA; r++) {
            int32x4_t s = qn_dot(qn_dot(vdupq_n_s32(0), v0, vld1q_s8(a[r][b].qs)), v1, vld1q_s8(a[r][b].qs + 16));
            acc[r] += (float)vaddvq_s32(s) * (dw * qn_h2f(a[r][b].d));
        }
    }
    for (int r = 0; r < RA; r++) res[r] = acc[r];
}

/* ==== Q4_1 / Q5_1 x Q8_1 ====
 * Levels 0..15 (0..31) are non-negative int8, so the signed dot products
 * take them as they are; per block the reference's arithmetic,
 * (d_w d_a) * sumi + m_w * s_a, in its order (bit for bit). */
QN_INLINE void qn_decode_b32u(uint32_t type, const uint8_t *blk, int8x16_t *v0, int8x16_t *v1, float *d, float *m) {
    const uint8_t *qs = type == GGML_TYPE_Q4_1 ? ((const block_q4_1 *)blk)->qs : ((const block_q5_1 *)blk)->qs;
    uint8x16_t raw = vld1q_u8(qs), lo = vandq_u8(raw, vdupq_n_u8(0xF)), hi = vshrq_n_u8(raw, 4);
    if (type == GGML_TYPE_Q5_1) {
        const block_q5_1 *b = (const block_q5_1 *)blk;
        lo = vorrq_u8(lo, qn_bits16(b->qh[0], b->qh[1]));
        hi = vorrq_u8(hi, qn_bits16(b->qh[2], b->qh[3]));
    }
    const fp16_t *dm = (const fp16_t *)blk;   /* d, then m: both layouts start so */
    *d = qn_h2f(dm[0]);
    *m = qn_h2f(dm[1]);
    *v0 = vreinterpretq_s8_u8(lo);
    *v1 = vreinterpretq_s8_u8(hi);
}

QN_INLINE void qn_row_b32u(uint32_t type, int RA, int64_t nb, const uint8_t *w, const block_q8_1 *const *a,
                           float *res) {
    float acc[QN_ROWS] = { 0 };
    const size_t bs = type == GGML_TYPE_Q4_1 ? sizeof(block_q4_1) : sizeof(block_q5_1);
    for (int64_t b = 0; b < nb; b++) {
        int8x16_t v0, v1;
        float dw, mw;
        qn_decode_b32u(type, w + (size_t)b * bs, &v0, &v1, &dw, &mw);
        QN_UNROLL
        for (int r = 0; r < RA; r++) {
            int32x4_t s = qn_dot(qn_dot(vdupq_n_s32(0), v0, vld1q_s8(a[r][b].qs)), v1, vld1q_s8(a[r][b].qs + 16));
            acc[r] += (dw * qn_h2f(a[r][b].d)) * (float)vaddvq_s32(s) + mw * qn_h2f(a[r][b].s);
        }
    }
    for (int r = 0; r < RA; r++) res[r] = acc[r];
}

/* ==== K-quants (Q4_K, Q5_K, Q6_K) x Q8_K ==== */
QN_INLINE void qn_k4_scales(const uint8_t *q, uint8_t *sc, uint8_t *mn) {
    for (int j = 0; j < 4; j++) {
        sc[j] = q[j] & 63;
        mn[j] = q[j + 4] & 63;
        sc[j + 4] = (uint8_t)((q[j + 8] & 0xF) | ((q[j] >> 6) << 4));
        mn[j + 4] = (uint8_t)((q[j + 8] >> 4) | ((q[j + 4] >> 6) << 4));
    }
}

/* Sub-block k (32 values, 0..7) of a Q4_K or Q5_K block as int8. */
QN_INLINE void qn_k45_sub(int five, const uint8_t *wb, int k, int8x16_t *lo, int8x16_t *hi) {
    const block_q4_K *x4 = (const block_q4_K *)wb;
    const block_q5_K *x5 = (const block_q5_K *)wb;
    const uint8_t *qs = (five ? x5->qs : x4->qs) + 32 * (k / 2);
    uint8x16_t r0 = vld1q_u8(qs), r1 = vld1q_u8(qs + 16), m4 = vdupq_n_u8(0xF);
    uint8x16_t v0 = k & 1 ? vshrq_n_u8(r0, 4) : vandq_u8(r0, m4);
    uint8x16_t v1 = k & 1 ? vshrq_n_u8(r1, 4) : vandq_u8(r1, m4);
    if (five) {
        const uint8x16_t bit = vdupq_n_u8((uint8_t)(1u << k)), h = vdupq_n_u8(0x10);
        v0 = vorrq_u8(v0, vandq_u8(vtstq_u8(vld1q_u8(x5->qh), bit), h));
        v1 = vorrq_u8(v1, vandq_u8(vtstq_u8(vld1q_u8(x5->qh + 16), bit), h));
    }
    *lo = vreinterpretq_s8_u8(v0);
    *hi = vreinterpretq_s8_u8(v1);
}

/* Sub-block j (16 values, 0..15: its scale index) of a Q6_K block as int8,
 * levels minus 32: element 128 h + 32 g + l is nibble g >> 1 of
 * ql[64 h + 32 (g & 1) + l] with bits 2g, 2g + 1 of qh[32 h + l] above it. */
QN_INLINE int8x16_t qn_q6_sub(const block_q6_K *x, int j) {
    const int k = j / 2, half = j % 2, h = k / 4, t = k % 4;
    const uint8_t *ql = x->ql + 64 * h + 16 * half + (t & 1) * 32;
    uint8x16_t l = vld1q_u8(ql), hb = vld1q_u8(x->qh + 32 * h + 16 * half);
    uint8x16_t lo = t < 2 ? vandq_u8(l, vdupq_n_u8(0xF)) : vshrq_n_u8(l, 4);
    uint8x16_t hi = vandq_u8(vshlq_u8(hb, vdupq_n_s8((int8_t)(-2 * t))), vdupq_n_u8(3));
    return vsubq_s8(vreinterpretq_s8_u8(vorrq_u8(lo, vshlq_n_u8(hi, 4))), vdupq_n_s8(32));
}

QN_INLINE void qn_kblock(uint32_t type, int RA, const uint8_t *wb, const block_q8_K *const *a, int64_t b,
                         float *acc) {
    int32x4_t isum[QN_ROWS];
    QN_UNROLL
    for (int r = 0; r < RA; r++) isum[r] = vdupq_n_s32(0);
    if (type == GGML_TYPE_Q6_K) {
        const block_q6_K *x = (const block_q6_K *)wb;
        _Pragma("GCC unroll 16")   /* whole: each sub-block's decode has constant shifts */
        for (int j = 0; j < QK_K / 16; j++) {
            const int8x16_t wq = qn_q6_sub(x, j);
            QN_UNROLL
            for (int r = 0; r < RA; r++) {
                int32x4_t dt = qn_dot(vdupq_n_s32(0), wq, vld1q_s8(a[r][b].qs + 16 * j));
                isum[r] = vmlaq_n_s32(isum[r], dt, x->scales[j]);
            }
        }
        const float d = qn_h2f(x->d);
        QN_UNROLL
        for (int r = 0; r < RA; r++) acc[r] += a[r][b].d * d * (float)vaddvq_s32(isum[r]);
        return;
    }
    const block_q4_K *x4 = (const block_q4_K *)wb;
    const block_q5_K *x5 = (const block_q5_K *)wb;
    const int five = type == GGML_TYPE_Q5_K;
    uint8_t sc[8], mn[8];
    qn_k4_scales(five ? x5->scales : x4->scales, sc, mn);
    QN_UNROLL
    for (int k = 0; k < 8; k++) {
        int8x16_t w0, w1;
        qn_k45_sub(five, wb, k, &w0, &w1);
        QN_UNROLL
        for (int r = 0; r < RA; r++) {
            int32x4_t dt = qn_dot(vdupq_n_s32(0), w0, vld1q_s8(a[r][b].qs + 32 * k));
            dt = qn_dot(dt, w1, vld1q_s8(a[r][b].qs + 32 * k + 16));
            isum[r] = vmlaq_n_s32(isum[r], dt, sc[k]);
        }
    }
    const float d = qn_h2f(five ? x5->d : x4->d), dmin = qn_h2f(five ? x5->dmin : x4->dmin);
    QN_UNROLL
    for (int r = 0; r < RA; r++) {
        int summ = 0;
        for (int j = 0; j < 8; j++) summ += mn[j] * (a[r][b].bsums[2 * j] + a[r][b].bsums[2 * j + 1]);
        acc[r] += a[r][b].d * d * (float)vaddvq_s32(isum[r]) - a[r][b].d * dmin * (float)summ;
    }
}

QN_INLINE void qn_row_k(uint32_t type, int RA, int64_t nb, const uint8_t *w, size_t bsz,
                        const block_q8_K *const *a, float *res) {
    float acc[QN_ROWS] = { 0 };
    for (int64_t b = 0; b < nb; b++) qn_kblock(type, RA, w + (size_t)b * bsz, a, b, acc);
    for (int r = 0; r < RA; r++) res[r] = acc[r];
}

/* ==== Two weight rows x two activation rows (i8mm) ====
 * smmla multiplies a 2x8 int8 matrix by the transpose of another and adds
 * the 2x2 int32 result: with weight rows w0, w1 as the first operand's rows
 * and activation rows a0, a1 as the second's, one instruction gives the four
 * 8-value dot products [w0.a0, w0.a1, w1.a0, w1.a1], the lane order of every
 * int32x4 and float32x4 below. The integer sums per block are exactly the
 * one-row path's, and each lane's float arithmetic is the reference's, in
 * its order (products formed as there, then added block after block). */
#if defined(__ARM_FEATURE_MATMUL_INT8)
#define QN_MMLA 1

/* 8-byte groups of two rows side by side: [x[0..8), y[0..8)] and [x[8..16), y[8..16)] */
QN_INLINE int8x16_t qn_zip_lo(int8x16_t x, int8x16_t y) {
    return vreinterpretq_s8_s64(vzip1q_s64(vreinterpretq_s64_s8(x), vreinterpretq_s64_s8(y)));
}
QN_INLINE int8x16_t qn_zip_hi(int8x16_t x, int8x16_t y) {
    return vreinterpretq_s8_s64(vzip2q_s64(vreinterpretq_s64_s8(x), vreinterpretq_s64_s8(y)));
}

/* acc + the four dot products of 16 values: weights x0 (row 0), x1 (row 1)
 * against activations y0, y1 */
QN_INLINE int32x4_t qn_mmla16(int32x4_t acc, int8x16_t x0, int8x16_t x1, int8x16_t y0, int8x16_t y1) {
    acc = vmmlaq_s32(acc, qn_zip_lo(x0, x1), qn_zip_lo(y0, y1));
    return vmmlaq_s32(acc, qn_zip_hi(x0, x1), qn_zip_hi(y0, y1));
}

/* [p, q, p, q] and [p, p, q, q]: a per-activation and a per-weight value in the lane order */
QN_INLINE float32x4_t qn_lanes_a(float p, float q) { return (float32x4_t){ p, q, p, q }; }
QN_INLINE float32x4_t qn_lanes_w(float p, float q) { return (float32x4_t){ p, p, q, q }; }

/* NP (1 or 2) pairs of activation rows a[2p], a[2p + 1] against weight rows
 * w0, w1 of a 32-value format: acc[p] as above. */
QN_INLINE void qn_pair_b32(uint32_t type, int NP, int64_t nb, const uint8_t *w0, const uint8_t *w1,
                           const block_q8_0 *const *a, float32x4_t *res) {
    float32x4_t acc[2] = { vdupq_n_f32(0.0f), vdupq_n_f32(0.0f) };
    const size_t bs = qn_bsize_b32(type);
    for (int64_t b = 0; b < nb; b++) {
        int8x16_t x00, x01, x10, x11;
        float d0, d1;
        qn_decode_b32(type, w0 + (size_t)b * bs, &x00, &x01, &d0);
        qn_decode_b32(type, w1 + (size_t)b * bs, &x10, &x11, &d1);
        const float32x4_t dw = qn_lanes_w(d0, d1);
        for (int p = 0; p < NP; p++) {
            const block_q8_0 *y0 = &a[2 * p][b], *y1 = &a[2 * p + 1][b];
            int32x4_t s = qn_mmla16(vdupq_n_s32(0), x00, x10, vld1q_s8(y0->qs), vld1q_s8(y1->qs));
            s = qn_mmla16(s, x01, x11, vld1q_s8(y0->qs + 16), vld1q_s8(y1->qs + 16));
            /* (float)isum * (dw * da) */
            const float32x4_t sc = vmulq_f32(dw, qn_lanes_a(qn_h2f(y0->d), qn_h2f(y1->d)));
            acc[p] = vaddq_f32(acc[p], vmulq_f32(vcvtq_f32_s32(s), sc));
        }
    }
    for (int p = 0; p < NP; p++) res[p] = acc[p];
}

/* Two K-quant weight blocks (w0, w1: super-block b of each row) against NP
 * pairs of Q8_K activation rows: acc[p] += the block's term per lane. */
QN_INLINE void qn_pair_kblock(uint32_t type, int NP, const uint8_t *w0, const uint8_t *w1,
                              const block_q8_K *const *a, int64_t b, float32x4_t *acc) {
    int32x4_t isum[2] = { vdupq_n_s32(0), vdupq_n_s32(0) };
    if (type == GGML_TYPE_Q6_K) {
        const block_q6_K *x0 = (const block_q6_K *)w0, *x1 = (const block_q6_K *)w1;
        _Pragma("GCC unroll 16")   /* as qn_kblock: constant shifts per sub-block */
        for (int j = 0; j < QK_K / 16; j++) {
            const int8x16_t v0 = qn_q6_sub(x0, j), v1 = qn_q6_sub(x1, j);
            const int32x4_t sc = { x0->scales[j], x0->scales[j], x1->scales[j], x1->scales[j] };
            for (int p = 0; p < NP; p++) {
                const int8x16_t y0 = vld1q_s8(a[2 * p][b].qs + 16 * j), y1 = vld1q_s8(a[2 * p + 1][b].qs + 16 * j);
                isum[p] = vmlaq_s32(isum[p], qn_mmla16(vdupq_n_s32(0), v0, v1, y0, y1), sc);
            }
        }
        const float32x4_t dw = qn_lanes_w(qn_h2f(x0->d), qn_h2f(x1->d));
        for (int p = 0; p < NP; p++) {
            /* a.d * d * (float)isum */
            const float32x4_t da = qn_lanes_a(a[2 * p][b].d, a[2 * p + 1][b].d);
            acc[p] = vaddq_f32(acc[p], vmulq_f32(vmulq_f32(da, dw), vcvtq_f32_s32(isum[p])));
        }
        return;
    }
    const int five = type == GGML_TYPE_Q5_K;
    const block_q4_K *b40 = (const block_q4_K *)w0, *b41 = (const block_q4_K *)w1;
    const block_q5_K *b50 = (const block_q5_K *)w0, *b51 = (const block_q5_K *)w1;
    uint8_t sc0[8], mn0[8], sc1[8], mn1[8];
    qn_k4_scales(five ? b50->scales : b40->scales, sc0, mn0);
    qn_k4_scales(five ? b51->scales : b41->scales, sc1, mn1);
    for (int k = 0; k < 8; k++) {
        int8x16_t v00, v01, v10, v11;
        qn_k45_sub(five, w0, k, &v00, &v01);
        qn_k45_sub(five, w1, k, &v10, &v11);
        const int32x4_t sc = { sc0[k], sc0[k], sc1[k], sc1[k] };
        for (int p = 0; p < NP; p++) {
            const int8_t *y0 = a[2 * p][b].qs + 32 * k, *y1 = a[2 * p + 1][b].qs + 32 * k;
            int32x4_t dt = qn_mmla16(vdupq_n_s32(0), v00, v10, vld1q_s8(y0), vld1q_s8(y1));
            dt = qn_mmla16(dt, v01, v11, vld1q_s8(y0 + 16), vld1q_s8(y1 + 16));
            isum[p] = vmlaq_s32(isum[p], dt, sc);
        }
    }
    const float32x4_t dw = five ? qn_lanes_w(qn_h2f(b50->d), qn_h2f(b51->d))
                                : qn_lanes_w(qn_h2f(b40->d), qn_h2f(b41->d));
    const float32x4_t mw = five ? qn_lanes_w(qn_h2f(b50->dmin), qn_h2f(b51->dmin))
                                : qn_lanes_w(qn_h2f(b40->dmin), qn_h2f(b41->dmin));
    for (int p = 0; p < NP; p++) {
        const block_q8_K *y0 = &a[2 * p][b], *y1 = &a[2 * p + 1][b];
        int summ[4] = { 0, 0, 0, 0 };
        for (int j = 0; j < 8; j++) {
            int s0 = y0->bsums[2 * j] + y0->bsums[2 * j + 1], s1 = y1->bsums[2 * j] + y1->bsums[2 * j + 1];
            summ[0] += mn0[j] * s0; summ[1] += mn0[j] * s1; summ[2] += mn1[j] * s0; summ[3] += mn1[j] * s1;
        }
        /* a.d * d * (float)isum - a.d * dmin * (float)summ */
        const float32x4_t da = qn_lanes_a(y0->d, y1->d);
        const float32x4_t t = vsubq_f32(vmulq_f32(vmulq_f32(da, dw), vcvtq_f32_s32(isum[p])),
                                        vmulq_f32(vmulq_f32(da, mw), vcvtq_f32_s32(vld1q_s32(summ))));
        acc[p] = vaddq_f32(acc[p], t);
    }
}

QN_INLINE void qn_pair_k(uint32_t type, int NP, int64_t nb, const uint8_t *w0, const uint8_t *w1, size_t bsz,
                         const block_q8_K *const *a, float32x4_t *res) {
    float32x4_t acc[2] = { vdupq_n_f32(0.0f), vdupq_n_f32(0.0f) };
    for (int64_t b = 0; b < nb; b++)
        qn_pair_kblock(type, NP, w0 + (size_t)b * bsz, w1 + (size_t)b * bsz, a, b, acc);
    for (int p = 0; p < NP; p++) res[p] = acc[p];
}

/* One pair of weight rows against NP pairs of activation rows, for a
 * constant (type, NP). */
#define QN_PAIR_B32(T)                                                                               \
    static void qn_pair_##T(int NP, int64_t n, const uint8_t *w0, const uint8_t *w1,                 \
                            const uint8_t *const *a, float32x4_t *res) {                             \
        const block_q8_0 *const *y = (const block_q8_0 *const *)a;                                   \
        if (NP == 1) qn_pair_b32(GGML_TYPE_##T, 1, n / 32, w0, w1, y, res);                          \
        else qn_pair_b32(GGML_TYPE_##T, 2, n / 32, w0, w1, y, res);                                  \
    }
#define QN_PAIR_K(T, B)                                                                              \
    static void qn_pair_##T(int NP, int64_t n, const uint8_t *w0, const uint8_t *w1,                 \
                            const uint8_t *const *a, float32x4_t *res) {                             \
        const block_q8_K *const *y = (const block_q8_K *const *)a;                                   \
        if (NP == 1) qn_pair_k(GGML_TYPE_##T, 1, n / QK_K, w0, w1, sizeof(B), y, res);               \
        else qn_pair_k(GGML_TYPE_##T, 2, n / QK_K, w0, w1, sizeof(B), y, res);                       \
    }
QN_PAIR_B32(Q4_0)
QN_PAIR_B32(Q5_0)
QN_PAIR_B32(Q8_0)
QN_PAIR_K(Q4_K, block_q4_K)
QN_PAIR_K(Q5_K, block_q5_K)
QN_PAIR_K(Q6_K, block_q6_K)

typedef void (*qn_pair_fn)(int, int64_t, const uint8_t *, const uint8_t *, const uint8_t *const *, float32x4_t *);

static qn_pair_fn qn_pair_for(uint32_t wtype) {
    switch (wtype) {
    case GGML_TYPE_Q4_0: return qn_pair_Q4_0;
    case GGML_TYPE_Q5_0: return qn_pair_Q5_0;
    case GGML_TYPE_Q8_0: return qn_pair_Q8_0;
    case GGML_TYPE_Q4_K: return qn_pair_Q4_K;
    case GGML_TYPE_Q5_K: return qn_pair_Q5_K;
    case GGML_TYPE_Q6_K: return qn_pair_Q6_K;
    default: return NULL;
    }
}
#else
#define QN_MMLA 0
#endif

/* ==== Float formats ==== */
QN_INLINE float32x4_t qn_load4(uint32_t type, const void *p, int64_t k) {
    if (type == GGML_TYPE_F32) return vld1q_f32((const float *)p + k);
    uint16x4_t h = vld1_u16((const uint16_t *)p + k);
    if (type == GGML_TYPE_F16) return vcvt_f32_f16(vreinterpret_f16_u16(h));
    return vreinterpretq_f32_u32(vshll_n_u16(h, 16));
}

QN_INLINE float qn_load1(uint32_t type, const void *p, int64_t k) {
    if (type == GGML_TYPE_F32) return ((const float *)p)[k];
    if (type == GGML_TYPE_F16) return fp16_to_f32(((const uint16_t *)p)[k]);
    return bf16_to_f32(((const uint16_t *)p)[k]);
}

/* Partial sums per activation row: one 4-lane sum made every multiply-add
 * wait for the one before (a 3-4 cycle latency chain: at most one FMA per
 * cycle with 4 rows, a quarter of one with a single row, on cores that
 * issue 2-4 a cycle); four independent sums per row hide it. Derived, not
 * timed: no arm64 machine here (docs/architecture.md). */
#define QN_FACC 4
_Static_assert(QN_FACC >= 1 && (QN_FACC & (QN_FACC - 1)) == 0, "QN_FACC: a power of two (pairwise sums)");

QN_INLINE void qn_row_float(uint32_t type, int RA, int64_t n, const uint8_t *w, const uint8_t *const *a,
                            float *res) {
    float32x4_t acc[QN_ROWS][QN_FACC];
    QN_UNROLL
    for (int r = 0; r < RA; r++)
        QN_UNROLL
        for (int i = 0; i < QN_FACC; i++) acc[r][i] = vdupq_n_f32(0.0f);
    int64_t k = 0;
    for (; k + 4 * QN_FACC <= n; k += 4 * QN_FACC) {
        float32x4_t x[QN_FACC];
        QN_UNROLL
        for (int i = 0; i < QN_FACC; i++) x[i] = qn_load4(type, w, k + 4 * i);
        QN_UNROLL
        for (int r = 0; r < RA; r++)
            QN_UNROLL
            for (int i = 0; i < QN_FACC; i++)   /* f32 activations */
                acc[r][i] = vfmaq_f32(acc[r][i], x[i], vld1q_f32((const float *)a[r] + k + 4 * i));
    }
    for (; k + 4 <= n; k += 4) {
        float32x4_t x = qn_load4(type, w, k);
        QN_UNROLL
        for (int r = 0; r < RA; r++) acc[r][0] = vfmaq_f32(acc[r][0], x, vld1q_f32((const float *)a[r] + k));
    }
    for (int r = 0; r < RA; r++) {
        /* pairwise, neighbours first: (a0 + a1) + (a2 + a3) for four */
        QN_UNROLL
        for (int step = 1; step < QN_FACC; step *= 2)
            QN_UNROLL
            for (int i = 0; i < QN_FACC; i += 2 * step) acc[r][i] = vaddq_f32(acc[r][i], acc[r][i + step]);
        float s = vaddvq_f32(acc[r][0]);
        for (int64_t t = k; t < n; t++) s += qn_load1(type, w, t) * ((const float *)a[r])[t];
        res[r] = s;
    }
}

/* ==== Tile driver ==== */
/* One weight row against RA activation rows, for a constant (type, RA). */
QN_INLINE void qn_row(uint32_t type, int RA, int64_t n, const uint8_t *w, const uint8_t *const *a, float *res) {
    switch (type) {
    case GGML_TYPE_Q4_0: case GGML_TYPE_Q5_0: case GGML_TYPE_Q8_0:
        qn_row_b32(type, RA, n / 32, w, (const block_q8_0 *const *)a, res);
        break;
    case GGML_TYPE_Q4_1: case GGML_TYPE_Q5_1:
        qn_row_b32u(type, RA, n / 32, w, (const block_q8_1 *const *)a, res);
        break;
    case GGML_TYPE_Q4_K: qn_row_k(type, RA, n / QK_K, w, sizeof(block_q4_K), (const block_q8_K *const *)a, res); break;
    case GGML_TYPE_Q5_K: qn_row_k(type, RA, n / QK_K, w, sizeof(block_q5_K), (const block_q8_K *const *)a, res); break;
    case GGML_TYPE_Q6_K: qn_row_k(type, RA, n / QK_K, w, sizeof(block_q6_K), (const block_q8_K *const *)a, res); break;
    default: qn_row_float(type, RA, n, w, a, res); break;
    }
}

#define QN_ROW_FN(T)                                                                               \
    static void qn_row_##T(int RA, int64_t n, const uint8_t *w, const uint8_t *const *a, float *res) { \
        switch (RA) {                                                                              \
        case 1: qn_row(GGML_TYPE_##T, 1, n, w, a, res); break;                                     \
        case 2: qn_row(GGML_TYPE_##T, 2, n, w, a, res); break;                                     \
        case 3: qn_row(GGML_TYPE_##T, 3, n, w, a, res); break;                                     \
        default: qn_row(GGML_TYPE_##T, 4, n, w, a, res); break;                                    \
        }                                                                                          \
    }
QN_ROW_FN(Q4_0)
QN_ROW_FN(Q5_0)
QN_ROW_FN(Q8_0)
QN_ROW_FN(Q4_1)
QN_ROW_FN(Q5_1)
QN_ROW_FN(Q4_K)
QN_ROW_FN(Q5_K)
QN_ROW_FN(Q6_K)
QN_ROW_FN(F32)
QN_ROW_FN(F16)
QN_ROW_FN(BF16)

typedef void (*qn_row_fn)(int, int64_t, const uint8_t *, const uint8_t *const *, float *);

/* Weight rows two at a time against RA (2..4) activation rows (the last
 * repeated when RA is odd, its extra products dropped); returns the rows
 * done (nw rounded down to even). */
#if QN_MMLA
static int qn_tile_pairs(qn_pair_fn pf, int64_t n, const uint8_t *w, size_t w_stride, int nw,
                         const uint8_t *const *ar, int RA, float *out, size_t out_stride) {
    const uint8_t *ap[QN_ROWS] = { ar[0], ar[1], ar[RA > 2 ? 2 : 1], ar[RA > 3 ? 3 : RA - 1] };
    const int NP = (RA + 1) / 2;
    int i = 0;
    for (; i + 2 <= nw; i += 2) {
        float32x4_t res[2];
        pf(NP, n, w + (size_t)i * w_stride, w + (size_t)(i + 1) * w_stride, ap, res);
        for (int p = 0; p < NP; p++) {
            float v[4];
            vst1q_f32(v, res[p]);
            for (int h = 0; h < 2 && 2 * p + h < RA; h++) {
                out[(size_t)(2 * p + h) * out_stride + (size_t)i] = v[h];
                out[(size_t)(2 * p + h) * out_stride + (size_t)i + 1] = v[2 + h];
            }
        }
    }
    return i;
}
#endif

static int qn_mul_mat_tile(uint32_t wtype, int64_t n, const void *w, size_t w_stride, int nw,
                            const void *a, size_t a_stride, int na, float *out, size_t out_stride) {
    qn_row_fn fn;
    switch (wtype) {
    case GGML_TYPE_Q4_0: fn = qn_row_Q4_0; break;
    case GGML_TYPE_Q5_0: fn = qn_row_Q5_0; break;
    case GGML_TYPE_Q8_0: fn = qn_row_Q8_0; break;
    case GGML_TYPE_Q4_1: fn = qn_row_Q4_1; break;
    case GGML_TYPE_Q5_1: fn = qn_row_Q5_1; break;
    case GGML_TYPE_Q4_K: fn = qn_row_Q4_K; break;
    case GGML_TYPE_Q5_K: fn = qn_row_Q5_K; break;
    case GGML_TYPE_Q6_K: fn = qn_row_Q6_K; break;
    case GGML_TYPE_F32: fn = qn_row_F32; break;
    case GGML_TYPE_F16: fn = qn_row_F16; break;
    case GGML_TYPE_BF16: fn = qn_row_BF16; break;
    default: return 0;
    }
    float res[QN_ROWS];
    for (int j0 = 0; j0 < na; j0 += QN_ROWS) {
        int RA = na - j0 < QN_ROWS ? na - j0 : QN_ROWS;
        const uint8_t *ar[QN_ROWS];
        for (int r = 0; r < RA; r++) ar[r] = (const uint8_t *)a + (size_t)(j0 + r) * a_stride;
        int i = 0;
#if QN_MMLA
        qn_pair_fn pf = RA >= 2 ? qn_pair_for(wtype) : NULL;
        if (pf) i = qn_tile_pairs(pf, n, (const uint8_t *)w, w_stride, nw, ar, RA, out + (size_t)j0 * out_stride,
                                  out_stride);
#endif
        for (; i < nw; i++) {
            fn(RA, n, (const uint8_t *)w + (size_t)i * w_stride, ar, res);
            for (int r = 0; r < RA; r++) out[(size_t)(j0 + r) * out_stride + (size_t)i] = res[r];
        }
    }
    return 1;
}

/* ==== Activation quantization ==== */
static void qn_act_q8_0(const float *x, block_q8_0 *y, int64_t nb) {
    for (int64_t i = 0; i < nb; i++, x += 32) {
        float32x4_t v[8], m = vdupq_n_f32(0.0f);
        for (int k = 0; k < 8; k++) {
            v[k] = vld1q_f32(x + 4 * k);
            m = vmaxq_f32(m, vabsq_f32(v[k]));
        }
        float amax = vmaxvq_f32(m);
        float d = amax / 127.0f;
        float id = d != 0.0f ? 1.0f / d : 0.0f;
        y[i].d = f32_to_fp16(d);
        for (int k = 0; k < 8; k += 2) {
            /* vrndaq: round to nearest, ties away from zero, as roundf */
            int32x4_t q0 = vcvtq_s32_f32(vrndaq_f32(vmulq_n_f32(v[k], id)));
            int32x4_t q1 = vcvtq_s32_f32(vrndaq_f32(vmulq_n_f32(v[k + 1], id)));
            int16x8_t q16 = vcombine_s16(vqmovn_s32(q0), vqmovn_s32(q1));
            vst1_s8(y[i].qs + 4 * k, vqmovn_s16(q16));
        }
    }
}

static void qn_act_q8_K(const float *x, block_q8_K *y, int64_t nb) {
    for (int64_t i = 0; i < nb; i++, x += QK_K) {
        float32x4_t m = vdupq_n_f32(0.0f);
        for (int k = 0; k < QK_K; k += 4) m = vmaxq_f32(m, vabsq_f32(vld1q_f32(x + k)));
        float amax = vmaxvq_f32(m);
        if (!(amax > 0.0f)) {
            memset(&y[i], 0, sizeof y[i]);
            continue;
        }
        float max = 0.0f;
        for (int k = 0; k < QK_K; k++)
            if (x[k] == amax || x[k] == -amax) { max = x[k]; break; }
        float iscale = -127.0f / max;
        for (int k = 0; k < QK_K; k += 8) {
            /* vcvtnq: nearest, ties to even, as the reference's nearest_int */
            int32x4_t q0 = vminq_s32(vcvtnq_s32_f32(vmulq_n_f32(vld1q_f32(x + k), iscale)), vdupq_n_s32(127));
            int32x4_t q1 = vminq_s32(vcvtnq_s32_f32(vmulq_n_f32(vld1q_f32(x + k + 4), iscale)), vdupq_n_s32(127));
            vst1_s8(y[i].qs + k, vqmovn_s16(vcombine_s16(vqmovn_s32(q0), vqmovn_s32(q1))));
        }
        for (int j = 0; j < QK_K / 16; j++)
            y[i].bsums[j] = (int16_t)vaddlvq_s8(vld1q_s8(y[i].qs + 16 * j));
        y[i].d = 1.0f / iscale;
    }
}

static int qn_quantize_act_row(uint32_t type, const float *x, void *y, int64_t n) {
    switch (type) {
    case GGML_TYPE_Q8_0: qn_act_q8_0(x, y, n / QK8_0); return 1;
    case GGML_TYPE_Q8_K: qn_act_q8_K(x, y, n / QK_K); return 1;
    default: return 0;
    }
}

const quant_kset QN_CAT(quant_kset, QN_SET) = {
    .name = QN_STR(QN_SET), .needs = QN_CAT(QN_NEEDS, QN_SET), .built = 1, .vec_ops = QK_VEC_NEON,
    .mul_mat_tile = qn_mul_mat_tile, .quantize_act_row = qn_quantize_act_row,
};
#else
/* not an arm64 build, or built without the set's extension: empty */
const quant_kset QN_CAT(quant_kset, QN_SET) = { .name = QN_STR(QN_SET) };
#endif

/* quant_neon.c - NEON kernels (arm64).
 *
 * This file is the neon set (quant_kernels.h: armv8-a, what every arm64 CPU
 * runs) and the body of the dotprod set: quant_neon_dotprod.c includes it
 * with QN_SET renamed and is compiled for armv8.2-a+dotprod, so qn_dot is
 * one sdot there and quant.c picks that set when the hwcaps say the CPU has
 * it (most arm64 cores since 2018: Graviton 2 on, Apple M1 on, the Grace and
 * GB10 CPUs). No -march flag is needed for either.
 *
 * Each weight block is decoded once and multiplied against up to four
 * activation rows. Per-block integer sums equal the reference ones, and the
 * float accumulation follows the reference order (one block after another).
 */
#include "quant.h"
#include "quant_kernels.h"

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

/* ==== K-quants (Q4_K, Q5_K, Q6_K) x Q8_K ==== */
QN_INLINE void qn_k4_scales(const uint8_t *q, uint8_t *sc, uint8_t *mn) {
    for (int j = 0; j < 4; j++) {
        sc[j] = q[j] & 63;
        mn[j] = q[j + 4] & 63;
        sc[j + 4] = (uint8_t)((q[j + 8] & 0xF) | ((q[j] >> 6) << 4));
        mn[j + 4] = (uint8_t)((q[j + 8] >> 4) | ((q[j + 4] >> 6) << 4));
    }
}

QN_INLINE void qn_kblock(uint32_t type, int RA, const uint8_t *wb, const block_q8_K *const *a, int64_t b,
                         float *acc) {
    int32x4_t isum[QN_ROWS];
    QN_UNROLL
    for (int r = 0; r < RA; r++) isum[r] = vdupq_n_s32(0);
    const uint8x16_t m4 = vdupq_n_u8(0xF);
    if (type == GGML_TYPE_Q6_K) {
        const block_q6_K *x = (const block_q6_K *)wb;
        const uint8x16_t m3 = vdupq_n_u8(3);
        QN_UNROLL
        for (int h = 0; h < 2; h++) {
            const uint8_t *ql = x->ql + 64 * h, *qh = x->qh + 32 * h;
            QN_UNROLL
            for (int half = 0; half < 2; half++) {  /* values l = 16*half .. 16*half+15 of each group */
                uint8x16_t l0 = vld1q_u8(ql + 16 * half), l1 = vld1q_u8(ql + 32 + 16 * half);
                uint8x16_t hb = vld1q_u8(qh + 16 * half);
                uint8x16_t g[4];
                g[0] = vorrq_u8(vandq_u8(l0, m4), vshlq_n_u8(vandq_u8(hb, m3), 4));
                g[1] = vorrq_u8(vandq_u8(l1, m4), vshlq_n_u8(vandq_u8(vshrq_n_u8(hb, 2), m3), 4));
                g[2] = vorrq_u8(vshrq_n_u8(l0, 4), vshlq_n_u8(vandq_u8(vshrq_n_u8(hb, 4), m3), 4));
                g[3] = vorrq_u8(vshrq_n_u8(l1, 4), vshlq_n_u8(vshrq_n_u8(hb, 6), 4));
                QN_UNROLL
                for (int t = 0; t < 4; t++) {
                    const int k = 4 * h + t, sub = 2 * k + half;  /* scale index of these 16 values */
                    int8x16_t wq = vsubq_s8(vreinterpretq_s8_u8(g[t]), vdupq_n_s8(32));
                    QN_UNROLL
                    for (int r = 0; r < RA; r++) {
                        int32x4_t dt = qn_dot(vdupq_n_s32(0), wq, vld1q_s8(a[r][b].qs + 16 * sub));
                        isum[r] = vmlaq_n_s32(isum[r], dt, x->scales[sub]);
                    }
                }
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
    const uint8_t *qs = five ? x5->qs : x4->qs;
    uint8_t sc[8], mn[8];
    qn_k4_scales(five ? x5->scales : x4->scales, sc, mn);
    uint8x16_t qh0 = vdupq_n_u8(0), qh1 = vdupq_n_u8(0);
    if (five) { qh0 = vld1q_u8(x5->qh); qh1 = vld1q_u8(x5->qh + 16); }
    QN_UNROLL
    for (int c = 0; c < 4; c++) {
        uint8x16_t raw0 = vld1q_u8(qs + 32 * c), raw1 = vld1q_u8(qs + 32 * c + 16);
        QN_UNROLL
        for (int s = 0; s < 2; s++) {
            const int k = 2 * c + s;
            uint8x16_t w0 = s ? vshrq_n_u8(raw0, 4) : vandq_u8(raw0, m4);
            uint8x16_t w1 = s ? vshrq_n_u8(raw1, 4) : vandq_u8(raw1, m4);
            if (five) {
                uint8x16_t bit = vdupq_n_u8((uint8_t)(1u << k));
                w0 = vorrq_u8(w0, vandq_u8(vtstq_u8(qh0, bit), vdupq_n_u8(0x10)));
                w1 = vorrq_u8(w1, vandq_u8(vtstq_u8(qh1, bit), vdupq_n_u8(0x10)));
            }
            QN_UNROLL
            for (int r = 0; r < RA; r++) {
                int32x4_t dt = qn_dot(vdupq_n_s32(0), vreinterpretq_s8_u8(w0), vld1q_s8(a[r][b].qs + 32 * k));
                dt = qn_dot(dt, vreinterpretq_s8_u8(w1), vld1q_s8(a[r][b].qs + 32 * k + 16));
                isum[r] = vmlaq_n_s32(isum[r], dt, sc[k]);
            }
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

QN_INLINE void qn_row_float(uint32_t type, int RA, int64_t n, const uint8_t *w, const uint8_t *const *a,
                            float *res) {
    float32x4_t acc[QN_ROWS];
    QN_UNROLL
    for (int r = 0; r < RA; r++) acc[r] = vdupq_n_f32(0.0f);
    int64_t k = 0;
    for (; k + 4 <= n; k += 4) {
        float32x4_t x = qn_load4(type, w, k);
        QN_UNROLL
        for (int r = 0; r < RA; r++) acc[r] = vfmaq_f32(acc[r], x, vld1q_f32((const float *)a[r] + k));  /* f32 activations */
    }
    for (int r = 0; r < RA; r++) {
        float s = vaddvq_f32(acc[r]);
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
QN_ROW_FN(Q4_K)
QN_ROW_FN(Q5_K)
QN_ROW_FN(Q6_K)
QN_ROW_FN(F32)
QN_ROW_FN(F16)
QN_ROW_FN(BF16)

typedef void (*qn_row_fn)(int, int64_t, const uint8_t *, const uint8_t *const *, float *);

static int qn_mul_mat_tile(uint32_t wtype, int64_t n, const void *w, size_t w_stride, int nw,
                            const void *a, size_t a_stride, int na, float *out, size_t out_stride) {
    qn_row_fn fn;
    switch (wtype) {
    case GGML_TYPE_Q4_0: fn = qn_row_Q4_0; break;
    case GGML_TYPE_Q5_0: fn = qn_row_Q5_0; break;
    case GGML_TYPE_Q8_0: fn = qn_row_Q8_0; break;
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
        for (int i = 0; i < nw; i++) {
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
    .name = QN_STR(QN_SET), .needs = QN_CAT(QN_NEEDS, QN_SET), .built = 1, .vec_ops = 0,
    .mul_mat_tile = qn_mul_mat_tile, .quantize_act_row = qn_quantize_act_row,
};
#else
/* not an arm64 build, or built without the set's extension: empty */
const quant_kset QN_CAT(quant_kset, QN_SET) = { .name = QN_STR(QN_SET) };
#endif

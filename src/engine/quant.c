/* quant.c - scalar conversions, reference kernels, weight quantizers, dispatch.
 *
 * Everything here is plain C and serves as the definition the SIMD kernels in
 * quant_avx2.c and quant_neon.c must reproduce: the same integer sums per
 * block, scaled the same way, so results differ only by float summation order.
 * Activation quantizers (Q8_0, Q8_K) follow llama.cpp's reference definitions
 * exactly, because the oracle's logits depend on them.
 */
#include "engine/quant.h"
#include "engine/quant_kernels.h"

#include <math.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

/* ==== Scalar conversions ==== */
static inline uint32_t quant_f32_bits(float f) { uint32_t u; memcpy(&u, &f, 4); return u; }
static inline float quant_bits_f32(uint32_t u) { float f; memcpy(&f, &u, 4); return f; }

float fp16_to_f32(fp16_t h) {
    uint32_t sign = (uint32_t)(h & 0x8000) << 16;
    uint32_t exp = (h >> 10) & 0x1f;
    uint32_t mant = h & 0x3ff;
    if (exp == 0) {
        /* zero or subnormal: mant * 2^-24, exact in f32 */
        float v = (float)mant * 0x1p-24f;
        return sign ? -v : v;
    }
    if (exp == 31)
        return quant_bits_f32(sign | 0x7f800000u | (mant << 13));
    /* rebias exponent 15 -> 127 */
    return quant_bits_f32(sign | ((exp + 112) << 23) | (mant << 13));
}

/* Round mant >> shift to nearest, ties to even. shift in 1..31. */
static inline uint32_t quant_shift_rne(uint32_t mant, unsigned shift) {
    uint32_t r = mant >> shift;
    uint32_t rem = mant & ((1u << shift) - 1);
    uint32_t half = 1u << (shift - 1);
    if (rem > half || (rem == half && (r & 1))) r++;
    return r;
}

fp16_t f32_to_fp16(float f) {
    uint32_t x = quant_f32_bits(f);
    uint32_t sign = (x >> 16) & 0x8000;
    uint32_t ax = x & 0x7fffffffu;
    if (ax > 0x7f800000u)   /* NaN: keep it quiet and keep the top payload bits */
        return (fp16_t)(sign | 0x7e00 | ((ax >> 13) & 0x3ff));
    if (ax >= 0x477ff000u)  /* >= 65520 rounds to infinity (65504 is the max half) */
        return (fp16_t)(sign | 0x7c00);
    if (ax < 0x38800000u) { /* below 2^-14: subnormal half (or zero) */
        uint32_t e = ax >> 23;
        if (e < 102) return (fp16_t)sign;  /* < 2^-25: rounds to zero */
        uint32_t mant = (ax & 0x7fffff) | 0x800000;
        /* value = mant * 2^(e-150); in units of the half subnormal step 2^-24
         * that is mant * 2^(e-126), i.e. a right shift by 126 - e (14..24) */
        return (fp16_t)(sign | quant_shift_rne(mant, 126 - e));
    }
    /* normal: rebias 127 -> 15; a mantissa carry correctly bumps the exponent */
    uint32_t r = (((ax >> 23) - 112) << 10) | ((ax & 0x7fffff) >> 13);
    uint32_t rem = ax & 0x1fff;
    if (rem > 0x1000 || (rem == 0x1000 && (r & 1))) r++;
    return (fp16_t)(sign | r);
}

float bf16_to_f32(bf16_t h) { return quant_bits_f32((uint32_t)h << 16); }

bf16_t f32_to_bf16(float f) {
    uint32_t u = quant_f32_bits(f);
    if ((u & 0x7fffffffu) > 0x7f800000u)  /* NaN: truncate, force quiet bit */
        return (bf16_t)((u >> 16) | 0x40);
    return (bf16_t)((u + 0x7fff + ((u >> 16) & 1)) >> 16);
}

/* ==== Type queries ==== */
int quant_is_supported(uint32_t type) {
    switch (type) {
    case GGML_TYPE_F32: case GGML_TYPE_F16: case GGML_TYPE_BF16:
    case GGML_TYPE_Q4_0: case GGML_TYPE_Q5_0: case GGML_TYPE_Q8_0:
    case GGML_TYPE_Q4_1: case GGML_TYPE_Q5_1:
    case GGML_TYPE_Q4_K: case GGML_TYPE_Q5_K: case GGML_TYPE_Q6_K:
        return 1;
    default:
        return 0;
    }
}

/* GGML_TYPE_COUNT for a type this engine cannot multiply. */
uint32_t quant_vec_dot_type(uint32_t wtype) {
    switch (wtype) {
    case GGML_TYPE_F32: return GGML_TYPE_F32;
    /* Half-precision weights meet f32 activations unrounded: that is what the
     * primary oracle (ik_llama.cpp) does, and it agrees with it to 1e-4
     * logits where rounding the activations to f16 (mainline ggml) leaves
     * 1e-2 and flips near-tied MoE routing decisions. The experts of a MoE
     * block are the exception: both oracles round their inputs to f16
     * (backend_cpu.c, moe_round_f16). */
    case GGML_TYPE_F16: return GGML_TYPE_F32;
    case GGML_TYPE_BF16: return GGML_TYPE_F32;
    case GGML_TYPE_Q4_0: case GGML_TYPE_Q5_0: case GGML_TYPE_Q8_0: return GGML_TYPE_Q8_0;
    /* the min term needs the activation block's sum: ggml's pairing */
    case GGML_TYPE_Q4_1: case GGML_TYPE_Q5_1: return GGML_TYPE_Q8_1;
    case GGML_TYPE_Q4_K: case GGML_TYPE_Q5_K: case GGML_TYPE_Q6_K: return GGML_TYPE_Q8_K;
    default: return GGML_TYPE_COUNT;
    }
}

/* ==== K-quant scale packing ==== */
/* Sub-block j (0..7) of a Q4_K/Q5_K super-block: 6-bit scale and min.
 * Bytes 0-3 hold scales 0-3 (low 6 bits), bytes 4-7 mins 0-3 (low 6 bits);
 * bytes 8-11 hold the low nibbles of scale/min 4-7, whose top two bits sit in
 * the spare top bits of bytes 0-3 (scales) and 4-7 (mins). */
static inline void quant_get_scale_min_k4(int j, const uint8_t *q, uint8_t *sc, uint8_t *m) {
    if (j < 4) {
        *sc = q[j] & 63;
        *m = q[j + 4] & 63;
    } else {
        *sc = (uint8_t)((q[j + 4] & 0xF) | ((q[j - 4] >> 6) << 4));
        *m = (uint8_t)((q[j + 4] >> 4) | ((q[j] >> 6) << 4));
    }
}

static void quant_put_scale_min_k4(uint8_t *q, const uint8_t *sc, const uint8_t *m) {
    memset(q, 0, K_SCALE_SIZE);
    for (int j = 0; j < 8; j++) {
        if (j < 4) {
            q[j] |= sc[j] & 63;
            q[j + 4] |= m[j] & 63;
        } else {
            q[j + 4] = (uint8_t)((sc[j] & 0xF) | ((m[j] & 0xF) << 4));
            q[j - 4] |= (uint8_t)((sc[j] >> 4) << 6);
            q[j] |= (uint8_t)((m[j] >> 4) << 6);
        }
    }
}

/* ==== Dequantization ==== */
static void quant_dequant_q4_0(const block_q4_0 *x, float *y, int64_t nb) {
    for (int64_t i = 0; i < nb; i++, y += QK4_0) {
        float d = fp16_to_f32(x[i].d);
        for (int j = 0; j < QK4_0 / 2; j++) {
            y[j] = d * (float)((x[i].qs[j] & 0xF) - 8);
            y[j + QK4_0 / 2] = d * (float)((x[i].qs[j] >> 4) - 8);
        }
    }
}

static void quant_dequant_q5_0(const block_q5_0 *x, float *y, int64_t nb) {
    for (int64_t i = 0; i < nb; i++, y += QK5_0) {
        float d = fp16_to_f32(x[i].d);
        uint32_t qh;
        memcpy(&qh, x[i].qh, 4);
        for (int j = 0; j < QK5_0 / 2; j++) {
            int lo = (x[i].qs[j] & 0xF) | (int)(((qh >> j) & 1) << 4);
            int hi = (x[i].qs[j] >> 4) | (int)(((qh >> (j + 16)) & 1) << 4);
            y[j] = d * (float)(lo - 16);
            y[j + QK5_0 / 2] = d * (float)(hi - 16);
        }
    }
}

/* Q5_1's fifth bits: bit j of qh for element j, bit j + 16 for element j + 16 */
static inline void quant_q5_1_levels(const block_q5_1 *b, uint8_t L[32]) {
    uint32_t qh;
    memcpy(&qh, b->qh, 4);
    for (int j = 0; j < 16; j++) {
        L[j] = (uint8_t)((b->qs[j] & 0xF) | (((qh >> j) & 1) << 4));
        L[j + 16] = (uint8_t)((b->qs[j] >> 4) | (((qh >> (j + 16)) & 1) << 4));
    }
}

static void quant_dequant_q4_1(const block_q4_1 *x, float *y, int64_t nb) {
    for (int64_t i = 0; i < nb; i++, y += QK4_1) {
        float d = fp16_to_f32(x[i].d), m = fp16_to_f32(x[i].m);
        for (int j = 0; j < QK4_1 / 2; j++) {
            y[j] = d * (float)(x[i].qs[j] & 0xF) + m;
            y[j + QK4_1 / 2] = d * (float)(x[i].qs[j] >> 4) + m;
        }
    }
}

static void quant_dequant_q5_1(const block_q5_1 *x, float *y, int64_t nb) {
    for (int64_t i = 0; i < nb; i++, y += QK5_1) {
        float d = fp16_to_f32(x[i].d), m = fp16_to_f32(x[i].m);
        uint8_t L[32];
        quant_q5_1_levels(&x[i], L);
        for (int j = 0; j < QK5_1; j++) y[j] = d * (float)L[j] + m;
    }
}

static void quant_dequant_q8_0(const block_q8_0 *x, float *y, int64_t nb) {
    for (int64_t i = 0; i < nb; i++, y += QK8_0) {
        float d = fp16_to_f32(x[i].d);
        for (int j = 0; j < QK8_0; j++) y[j] = d * (float)x[i].qs[j];
    }
}

static void quant_dequant_q4_K(const block_q4_K *x, float *y, int64_t nb) {
    for (int64_t i = 0; i < nb; i++) {
        float d = fp16_to_f32(x[i].d), dmin = fp16_to_f32(x[i].dmin);
        const uint8_t *q = x[i].qs;
        for (int c = 0; c < 4; c++, q += 32) {  /* 4 chunks of 64: low nibbles, then high */
            uint8_t sc, m;
            quant_get_scale_min_k4(2 * c, x[i].scales, &sc, &m);
            float d1 = d * sc, m1 = dmin * m;
            quant_get_scale_min_k4(2 * c + 1, x[i].scales, &sc, &m);
            float d2 = d * sc, m2 = dmin * m;
            for (int l = 0; l < 32; l++) *y++ = d1 * (float)(q[l] & 0xF) - m1;
            for (int l = 0; l < 32; l++) *y++ = d2 * (float)(q[l] >> 4) - m2;
        }
    }
}

static void quant_dequant_q5_K(const block_q5_K *x, float *y, int64_t nb) {
    for (int64_t i = 0; i < nb; i++) {
        float d = fp16_to_f32(x[i].d), dmin = fp16_to_f32(x[i].dmin);
        const uint8_t *q = x[i].qs, *qh = x[i].qh;
        for (int c = 0; c < 4; c++, q += 32) {
            uint8_t sc, m;
            quant_get_scale_min_k4(2 * c, x[i].scales, &sc, &m);
            float d1 = d * sc, m1 = dmin * m;
            quant_get_scale_min_k4(2 * c + 1, x[i].scales, &sc, &m);
            float d2 = d * sc, m2 = dmin * m;
            /* bit 2c of qh[l] is the 5th bit of the low half, bit 2c+1 of the high half */
            for (int l = 0; l < 32; l++)
                *y++ = d1 * (float)((q[l] & 0xF) | (((qh[l] >> (2 * c)) & 1) << 4)) - m1;
            for (int l = 0; l < 32; l++)
                *y++ = d2 * (float)((q[l] >> 4) | (((qh[l] >> (2 * c + 1)) & 1) << 4)) - m2;
        }
    }
}

/* The 256 levels of a Q6_K super-block, each 0..63 (subtract 32 for the
 * signed value): element 128 h + 32 g + l is nibble g >> 1 of
 * ql[64 h + 32 (g & 1) + l] with bits 2g, 2g + 1 of qh[32 h + l] above it. */
static void quant_q6_K_levels(const block_q6_K *b, uint8_t lv[QK_K]) {
    for (int h = 0; h < 2; h++) {
        const uint8_t *ql = b->ql + 64 * h, *qh = b->qh + 32 * h;
        uint8_t *o = lv + 128 * h;
        for (int l = 0; l < 32; l++) {
            o[l] = (uint8_t)((ql[l] & 0xF) | (qh[l] & 3) << 4);
            o[l + 32] = (uint8_t)((ql[l + 32] & 0xF) | (qh[l] >> 2 & 3) << 4);
            o[l + 64] = (uint8_t)((ql[l] >> 4) | (qh[l] >> 4 & 3) << 4);
            o[l + 96] = (uint8_t)((ql[l + 32] >> 4) | (qh[l] >> 6 & 3) << 4);
        }
    }
}

static void quant_dequant_q6_K(const block_q6_K *x, float *y, int64_t nb) {
    for (int64_t i = 0; i < nb; i++) {
        float d = fp16_to_f32(x[i].d);
        uint8_t lv[QK_K];
        quant_q6_K_levels(&x[i], lv);
        for (int e = 0; e < QK_K; e++)
            *y++ = d * (float)x[i].scales[e / 16] * (float)(lv[e] - 32);
    }
}

void quant_dequantize_row(uint32_t type, const void *x, float *y, int64_t n) {
    switch (type) {
    case GGML_TYPE_F32: memcpy(y, x, (size_t)n * sizeof(float)); break;
    case GGML_TYPE_F16: {
        const fp16_t *h = x;
        for (int64_t i = 0; i < n; i++) y[i] = fp16_to_f32(h[i]);
        break;
    }
    case GGML_TYPE_BF16: {
        const bf16_t *h = x;
        for (int64_t i = 0; i < n; i++) y[i] = bf16_to_f32(h[i]);
        break;
    }
    case GGML_TYPE_Q4_0: quant_dequant_q4_0(x, y, n / QK4_0); break;
    case GGML_TYPE_Q5_0: quant_dequant_q5_0(x, y, n / QK5_0); break;
    case GGML_TYPE_Q8_0: quant_dequant_q8_0(x, y, n / QK8_0); break;
    case GGML_TYPE_Q4_1: quant_dequant_q4_1(x, y, n / QK4_1); break;
    case GGML_TYPE_Q5_1: quant_dequant_q5_1(x, y, n / QK5_1); break;
    case GGML_TYPE_Q8_1: {
        const block_q8_1 *b = x;
        for (int64_t i = 0; i < n / QK8_1; i++) {
            float d = fp16_to_f32(b[i].d);
            for (int j = 0; j < QK8_1; j++) *y++ = d * (float)b[i].qs[j];
        }
        break;
    }
    case GGML_TYPE_Q4_K: quant_dequant_q4_K(x, y, n / QK_K); break;
    case GGML_TYPE_Q5_K: quant_dequant_q5_K(x, y, n / QK_K); break;
    case GGML_TYPE_Q6_K: quant_dequant_q6_K(x, y, n / QK_K); break;
    case GGML_TYPE_Q8_K: {
        const block_q8_K *b = x;
        for (int64_t i = 0; i < n / QK_K; i++)
            for (int j = 0; j < QK_K; j++) *y++ = b[i].d * (float)b[i].qs[j];
        break;
    }
    default:
        memset(y, 0, (size_t)n * sizeof(float));
        break;
    }
}

/* ==== Activation quantization (llama.cpp's reference definitions) ==== */
/* roundf(v) as an int8; NaN (an activation of a file with NaN or infinite
 * weights) becomes 0: converting NaN to an integer type is undefined. */
static inline int8_t quant_round_i8(float v) {
    float r = roundf(v);
    return r >= -128.0f && r <= 127.0f ? (int8_t)r : 0;
}

/* Q8_0: d = amax/127 (stored as fp16), q = roundf(x / d) with ties away from zero. */
static void quant_ref_act_q8_0(const float *x, block_q8_0 *y, int64_t nb) {
    for (int64_t i = 0; i < nb; i++, x += QK8_0) {
        float amax = 0.0f;
        for (int j = 0; j < QK8_0; j++) amax = fmaxf(amax, fabsf(x[j]));
        float d = amax / 127.0f;
        float id = d != 0.0f ? 1.0f / d : 0.0f;
        y[i].d = f32_to_fp16(d);
        for (int j = 0; j < QK8_0; j++) y[i].qs[j] = quant_round_i8(x[j] * id);
    }
}

/* Q8_1: Q8_0's levels, and s = d * sum(q) rounded to fp16 from the
 * unrounded f32 d (ggml's quantize_row_q8_1_ref). */
static void quant_ref_act_q8_1(const float *x, block_q8_1 *y, int64_t nb) {
    for (int64_t i = 0; i < nb; i++, x += QK8_1) {
        float amax = 0.0f;
        for (int j = 0; j < QK8_1; j++) amax = fmaxf(amax, fabsf(x[j]));
        float d = amax / 127.0f;
        float id = d != 0.0f ? 1.0f / d : 0.0f;
        int sum = 0;
        y[i].d = f32_to_fp16(d);
        for (int j = 0; j < QK8_1; j++) {
            y[i].qs[j] = quant_round_i8(x[j] * id);
            sum += y[i].qs[j];
        }
        y[i].s = f32_to_fp16((float)sum * d);
    }
}

/* nearest integer, ties to even (the default rounding mode), |v| < 2^22 */
static inline int quant_nearest_int(float v) { return (int)lrintf(v); }

/* Q8_K: the signed value of largest magnitude (first one on ties) maps to -127;
 * q = nearest(x * -127/max) clamped to 127; bsums are sums of 16; d = 1/iscale. */
static void quant_ref_act_q8_K(const float *x, block_q8_K *y, int64_t nb) {
    for (int64_t i = 0; i < nb; i++, x += QK_K) {
        float amax = 0.0f, max = 0.0f;
        for (int j = 0; j < QK_K; j++) {
            float ax = fabsf(x[j]);
            if (ax > amax) { amax = ax; max = x[j]; }
        }
        if (amax == 0.0f) {
            memset(&y[i], 0, sizeof y[i]);
            continue;
        }
        float iscale = -127.0f / max;
        for (int j = 0; j < QK_K; j++) {
            int v = quant_nearest_int(iscale * x[j]);
            y[i].qs[j] = (int8_t)(v < 127 ? v : 127);
        }
        for (int j = 0; j < QK_K / 16; j++) {
            int sum = 0;
            for (int k = 0; k < 16; k++) sum += y[i].qs[16 * j + k];
            y[i].bsums[j] = (int16_t)sum;
        }
        y[i].d = 1.0f / iscale;
    }
}

void quant_ref_quantize_act_row(uint32_t type, const float *x, void *y, int64_t n) {
    switch (type) {
    case GGML_TYPE_F32: memcpy(y, x, (size_t)n * sizeof(float)); break;
    case GGML_TYPE_F16: {
        fp16_t *h = y;
        for (int64_t i = 0; i < n; i++) h[i] = f32_to_fp16(x[i]);
        break;
    }
    case GGML_TYPE_BF16: {
        bf16_t *h = y;
        for (int64_t i = 0; i < n; i++) h[i] = f32_to_bf16(x[i]);
        break;
    }
    case GGML_TYPE_Q8_0: quant_ref_act_q8_0(x, y, n / QK8_0); break;
    case GGML_TYPE_Q8_1: quant_ref_act_q8_1(x, y, n / QK8_1); break;
    case GGML_TYPE_Q8_K: quant_ref_act_q8_K(x, y, n / QK_K); break;
    default: break;
    }
}

/* ==== Reference dot products ==== */
static float quant_ref_dot_q4_0(int64_t nb, const block_q4_0 *x, const block_q8_0 *y) {
    float sumf = 0.0f;
    for (int64_t i = 0; i < nb; i++) {
        int sumi = 0;
        for (int j = 0; j < QK4_0 / 2; j++) {
            sumi += ((x[i].qs[j] & 0xF) - 8) * y[i].qs[j];
            sumi += ((x[i].qs[j] >> 4) - 8) * y[i].qs[j + QK4_0 / 2];
        }
        sumf += (float)sumi * (fp16_to_f32(x[i].d) * fp16_to_f32(y[i].d));
    }
    return sumf;
}

static float quant_ref_dot_q5_0(int64_t nb, const block_q5_0 *x, const block_q8_0 *y) {
    float sumf = 0.0f;
    for (int64_t i = 0; i < nb; i++) {
        uint32_t qh;
        memcpy(&qh, x[i].qh, 4);
        int sumi = 0;
        for (int j = 0; j < QK5_0 / 2; j++) {
            int lo = ((x[i].qs[j] & 0xF) | (int)(((qh >> j) & 1) << 4)) - 16;
            int hi = ((x[i].qs[j] >> 4) | (int)(((qh >> (j + 16)) & 1) << 4)) - 16;
            sumi += lo * y[i].qs[j] + hi * y[i].qs[j + QK5_0 / 2];
        }
        sumf += (float)sumi * (fp16_to_f32(x[i].d) * fp16_to_f32(y[i].d));
    }
    return sumf;
}

static float quant_ref_dot_q8_0(int64_t nb, const block_q8_0 *x, const block_q8_0 *y) {
    float sumf = 0.0f;
    for (int64_t i = 0; i < nb; i++) {
        int sumi = 0;
        for (int j = 0; j < QK8_0; j++) sumi += x[i].qs[j] * y[i].qs[j];
        sumf += (float)sumi * (fp16_to_f32(x[i].d) * fp16_to_f32(y[i].d));
    }
    return sumf;
}

/* Q4_1 / Q5_1: sum over blocks of d_w d_a * dot(q, a) + m_w * s_a (ggml's
 * order of operations within a block). */
static float quant_ref_dot_q45_1(int64_t nb, const void *vx, const block_q8_1 *y, int five) {
    float sumf = 0.0f;
    for (int64_t i = 0; i < nb; i++) {
        uint8_t L[32];
        fp16_t d, m;
        if (five) {
            const block_q5_1 *b = (const block_q5_1 *)vx + i;
            quant_q5_1_levels(b, L);
            d = b->d; m = b->m;
        } else {
            const block_q4_1 *b = (const block_q4_1 *)vx + i;
            for (int j = 0; j < 16; j++) { L[j] = b->qs[j] & 0xF; L[j + 16] = b->qs[j] >> 4; }
            d = b->d; m = b->m;
        }
        int sumi = 0;
        for (int j = 0; j < 32; j++) sumi += L[j] * y[i].qs[j];
        sumf += (fp16_to_f32(d) * fp16_to_f32(y[i].d)) * (float)sumi + fp16_to_f32(m) * fp16_to_f32(y[i].s);
    }
    return sumf;
}

/* Q4_K/Q5_K: sum_j sc_j * dot(q, a) over 8 sub-blocks, minus sum_j m_j * (sum of a). */
static float quant_ref_dot_q45_K(int64_t nb, const void *vx, const block_q8_K *y, int five) {
    float sumf = 0.0f;
    for (int64_t i = 0; i < nb; i++) {
        const block_q4_K *x4 = (const block_q4_K *)vx + i;
        const block_q5_K *x5 = (const block_q5_K *)vx + i;
        const uint8_t *scales = five ? x5->scales : x4->scales;
        const uint8_t *qs = five ? x5->qs : x4->qs;
        float d = fp16_to_f32(five ? x5->d : x4->d), dmin = fp16_to_f32(five ? x5->dmin : x4->dmin);
        int sumi = 0, summ = 0;
        for (int j = 0; j < 8; j++) {
            uint8_t sc, m;
            quant_get_scale_min_k4(j, scales, &sc, &m);
            int c = j / 2, dot = 0;
            for (int l = 0; l < 32; l++) {
                int q = (j & 1) ? (qs[32 * c + l] >> 4) : (qs[32 * c + l] & 0xF);
                if (five) q |= ((x5->qh[l] >> j) & 1) << 4;
                dot += q * y[i].qs[32 * j + l];
            }
            sumi += sc * dot;
            summ += m * (y[i].bsums[2 * j] + y[i].bsums[2 * j + 1]);
        }
        sumf += y[i].d * d * (float)sumi - y[i].d * dmin * (float)summ;
    }
    return sumf;
}

static float quant_ref_dot_q6_K(int64_t nb, const block_q6_K *x, const block_q8_K *y) {
    float sumf = 0.0f;
    for (int64_t i = 0; i < nb; i++) {
        int sumi = 0;
        uint8_t lv[QK_K];
        quant_q6_K_levels(&x[i], lv);
        for (int j = 0; j < QK_K / 16; j++) {
            int dot = 0;
            for (int l = 0; l < 16; l++)
                dot += (lv[16 * j + l] - 32) * y[i].qs[16 * j + l];
            sumi += x[i].scales[j] * dot;
        }
        sumf += y[i].d * fp16_to_f32(x[i].d) * (float)sumi;
    }
    return sumf;
}

void quant_ref_vec_dot(uint32_t wtype, int64_t n, float *s, const void *x, const void *y) {
    double acc = 0.0;
    switch (wtype) {
    case GGML_TYPE_F32: {
        const float *a = x, *b = y;
        for (int64_t i = 0; i < n; i++) acc += (double)(a[i] * b[i]);
        *s = (float)acc;
        return;
    }
    case GGML_TYPE_F16: {
        const fp16_t *a = x;
        const float *b = y;
        for (int64_t i = 0; i < n; i++) acc += (double)(fp16_to_f32(a[i]) * b[i]);
        *s = (float)acc;
        return;
    }
    case GGML_TYPE_BF16: {
        const bf16_t *a = x;
        const float *b = y;
        for (int64_t i = 0; i < n; i++) acc += (double)(bf16_to_f32(a[i]) * b[i]);
        *s = (float)acc;
        return;
    }
    case GGML_TYPE_Q4_0: *s = quant_ref_dot_q4_0(n / QK4_0, x, y); return;
    case GGML_TYPE_Q5_0: *s = quant_ref_dot_q5_0(n / QK5_0, x, y); return;
    case GGML_TYPE_Q8_0: *s = quant_ref_dot_q8_0(n / QK8_0, x, y); return;
    case GGML_TYPE_Q4_1: *s = quant_ref_dot_q45_1(n / QK4_1, x, y, 0); return;
    case GGML_TYPE_Q5_1: *s = quant_ref_dot_q45_1(n / QK5_1, x, y, 1); return;
    case GGML_TYPE_Q4_K: *s = quant_ref_dot_q45_K(n / QK_K, x, y, 0); return;
    case GGML_TYPE_Q5_K: *s = quant_ref_dot_q45_K(n / QK_K, x, y, 1); return;
    case GGML_TYPE_Q6_K: *s = quant_ref_dot_q6_K(n / QK_K, x, y); return;
    default: *s = 0.0f; return;
    }
}

void quant_ref_mul_mat_tile(uint32_t wtype, int64_t n, const void *w, size_t w_stride, int nw,
                            const void *a, size_t a_stride, int na, float *out, size_t out_stride) {
    for (int j = 0; j < na; j++)
        for (int i = 0; i < nw; i++)
            quant_ref_vec_dot(wtype, n, &out[(size_t)j * out_stride + (size_t)i],
                              (const char *)w + (size_t)i * w_stride,
                              (const char *)a + (size_t)j * a_stride);
}

/* ==== Weight quantization (for writing model files) ==== */
static void quant_write_q8_0(const float *x, block_q8_0 *y, int64_t nb) { quant_ref_act_q8_0(x, y, nb); }

/* Largest-magnitude value with its sign (the first on ties). */
static float quant_signed_absmax(const float *x, int n) {
    float amax = 0.0f, max = 0.0f;
    for (int j = 0; j < n; j++)
        if (fabsf(x[j]) > amax) { amax = fabsf(x[j]); max = x[j]; }
    return max;
}

static inline int quant_clampi(int v, int lo, int hi) { return v < lo ? lo : v > hi ? hi : v; }

/* Q4_0 / Q5_0: the extreme value maps to level 0 (-8 or -16), so the opposite
 * side gets one level less; nlev = 16 or 32. Levels stored as 0..nlev-1. */
static void quant_symmetric_levels(const float *x, int nlev, fp16_t *dout, uint8_t *L) {
    float max = quant_signed_absmax(x, 32);
    float d = max / (float)(-nlev / 2);
    *dout = f32_to_fp16(d);
    float dh = fp16_to_f32(*dout);
    float id = dh != 0.0f ? 1.0f / dh : 0.0f;
    for (int j = 0; j < 32; j++)
        L[j] = (uint8_t)quant_clampi((int)lrintf(x[j] * id) + nlev / 2, 0, nlev - 1);
}

static void quant_write_q4_0(const float *x, block_q4_0 *y, int64_t nb) {
    uint8_t L[32];
    for (int64_t i = 0; i < nb; i++, x += 32) {
        quant_symmetric_levels(x, 16, &y[i].d, L);
        for (int j = 0; j < 16; j++) y[i].qs[j] = (uint8_t)(L[j] | (L[j + 16] << 4));
    }
}

static void quant_write_q5_0(const float *x, block_q5_0 *y, int64_t nb) {
    uint8_t L[32];
    for (int64_t i = 0; i < nb; i++, x += 32) {
        quant_symmetric_levels(x, 32, &y[i].d, L);
        uint32_t qh = 0;
        for (int j = 0; j < 16; j++) {
            y[i].qs[j] = (uint8_t)((L[j] & 0xF) | ((L[j + 16] & 0xF) << 4));
            qh |= (uint32_t)(L[j] >> 4) << j;
            qh |= (uint32_t)(L[j + 16] >> 4) << (j + 16);
        }
        memcpy(y[i].qh, &qh, 4);
    }
}

/* Q4_1 / Q5_1 (ggml's reference quantizer): m = the block's min, d = range /
 * nmax, level = (x - m) / d + 0.5 truncated, at most nmax. */
static void quant_minmax_levels(const float *x, int nmax, fp16_t *dout, fp16_t *mout, uint8_t *L) {
    float min = x[0], max = x[0];
    for (int j = 1; j < 32; j++) { min = fminf(min, x[j]); max = fmaxf(max, x[j]); }
    float d = (max - min) / (float)nmax;
    float id = d != 0.0f ? 1.0f / d : 0.0f;
    *dout = f32_to_fp16(d);
    *mout = f32_to_fp16(min);
    for (int j = 0; j < 32; j++) {
        float v = (x[j] - min) * id + 0.5f;   /* NaN or out of range (non-finite input): level 0 */
        L[j] = (uint8_t)quant_clampi(v >= 0.0f && v < 256.0f ? (int)v : 0, 0, nmax);
    }
}

static void quant_write_q4_1(const float *x, block_q4_1 *y, int64_t nb) {
    uint8_t L[32];
    for (int64_t i = 0; i < nb; i++, x += 32) {
        quant_minmax_levels(x, 15, &y[i].d, &y[i].m, L);
        for (int j = 0; j < 16; j++) y[i].qs[j] = (uint8_t)(L[j] | (L[j + 16] << 4));
    }
}

static void quant_write_q5_1(const float *x, block_q5_1 *y, int64_t nb) {
    uint8_t L[32];
    for (int64_t i = 0; i < nb; i++, x += 32) {
        quant_minmax_levels(x, 31, &y[i].d, &y[i].m, L);
        uint32_t qh = 0;
        for (int j = 0; j < 16; j++) {
            y[i].qs[j] = (uint8_t)((L[j] & 0xF) | ((L[j + 16] & 0xF) << 4));
            qh |= (uint32_t)(L[j] >> 4) << j;
            qh |= (uint32_t)(L[j + 16] >> 4) << (j + 16);
        }
        memcpy(y[i].qh, &qh, 4);
    }
}

/* Fit x ~ scale * L - min with L in 0..nmax, min >= 0, for one sub-block of 32:
 * start from the min/max range, then a few least-squares refinements of
 * (scale, min) for the current levels. Deterministic. */
static void quant_fit_scale_min(const float *x, int nmax, float *scale, float *min) {
    float lo = x[0], hi = x[0];
    for (int j = 1; j < 32; j++) { lo = fminf(lo, x[j]); hi = fmaxf(hi, x[j]); }
    if (lo > 0.0f) lo = 0.0f;
    if (hi <= lo) { *scale = 0.0f; *min = -lo; return; }
    float s = (hi - lo) / (float)nmax, m = -lo;
    float best_err = INFINITY, best_s = s, best_m = m;
    for (int it = 0; it < 4; it++) {
        double sl = 0, sll = 0, sx = 0, slx = 0, err = 0;
        for (int j = 0; j < 32; j++) {
            int l = quant_clampi((int)lrintf((x[j] + m) / s), 0, nmax);
            double diff = s * l - m - x[j];
            err += diff * diff;
            sl += l; sll += (double)l * l; sx += x[j]; slx += (double)l * x[j];
        }
        if (err < best_err) { best_err = (float)err; best_s = s; best_m = m; }
        double det = 32.0 * sll - sl * sl;
        if (det <= 0) break;
        double ns = (32.0 * slx - sl * sx) / det;     /* least squares for x = s*l - m */
        double nm = -(sx - ns * sl) / 32.0;
        if (nm < 0) { nm = 0; ns = sll > 0 ? slx / sll : s; }
        if (!(ns > 0)) break;
        s = (float)ns; m = (float)nm;
    }
    *scale = best_s; *min = best_m;
}

/* Shared by Q4_K and Q5_K: 8 sub-blocks of 32, 6-bit scales and mins relative
 * to the fp16 super-block d and dmin. Writes levels L[256] in 0..nmax. */
static void quant_k_scales(const float *x, int nmax, fp16_t *d_out, fp16_t *dmin_out,
                           uint8_t *scales, uint8_t *L) {
    float sc[8], mn[8], max_sc = 0.0f, max_mn = 0.0f;
    for (int j = 0; j < 8; j++) {
        quant_fit_scale_min(x + 32 * j, nmax, &sc[j], &mn[j]);
        max_sc = fmaxf(max_sc, sc[j]);
        max_mn = fmaxf(max_mn, mn[j]);
    }
    /* 63: the largest 6-bit value */
    *d_out = f32_to_fp16(max_sc / 63.0f);
    *dmin_out = f32_to_fp16(max_mn / 63.0f);
    float d = fp16_to_f32(*d_out), dmin = fp16_to_f32(*dmin_out);
    uint8_t qs[8], qm[8];
    for (int j = 0; j < 8; j++) {
        qs[j] = (uint8_t)(d > 0 ? quant_clampi((int)lrintf(sc[j] / d), 0, 63) : 0);
        qm[j] = (uint8_t)(dmin > 0 ? quant_clampi((int)lrintf(mn[j] / dmin), 0, 63) : 0);
        float s = d * qs[j], m = dmin * qm[j];
        for (int l = 0; l < 32; l++)
            L[32 * j + l] = (uint8_t)(s > 0 ? quant_clampi((int)lrintf((x[32 * j + l] + m) / s), 0, nmax) : 0);
    }
    quant_put_scale_min_k4(scales, qs, qm);
}

static void quant_write_q4_K(const float *x, block_q4_K *y, int64_t nb) {
    uint8_t L[QK_K];
    for (int64_t i = 0; i < nb; i++, x += QK_K) {
        quant_k_scales(x, 15, &y[i].d, &y[i].dmin, y[i].scales, L);
        for (int c = 0; c < 4; c++)
            for (int l = 0; l < 32; l++)
                y[i].qs[32 * c + l] = (uint8_t)(L[64 * c + l] | (L[64 * c + 32 + l] << 4));
    }
}

static void quant_write_q5_K(const float *x, block_q5_K *y, int64_t nb) {
    uint8_t L[QK_K];
    for (int64_t i = 0; i < nb; i++, x += QK_K) {
        quant_k_scales(x, 31, &y[i].d, &y[i].dmin, y[i].scales, L);
        memset(y[i].qh, 0, sizeof y[i].qh);
        for (int c = 0; c < 4; c++)
            for (int l = 0; l < 32; l++) {
                int lo = L[64 * c + l], hi = L[64 * c + 32 + l];
                y[i].qs[32 * c + l] = (uint8_t)((lo & 0xF) | ((hi & 0xF) << 4));
                y[i].qh[l] |= (uint8_t)(((lo >> 4) << (2 * c)) | ((hi >> 4) << (2 * c + 1)));
            }
    }
}

static void quant_write_q6_K(const float *x, block_q6_K *y, int64_t nb) {
    uint8_t L[QK_K];
    for (int64_t i = 0; i < nb; i++, x += QK_K) {
        float sc[16], amax = 0.0f;
        for (int j = 0; j < 16; j++) {
            /* the extreme value maps to level -32, the most negative 6-bit level */
            sc[j] = quant_signed_absmax(x + 16 * j, 16) / -32.0f;
            amax = fmaxf(amax, fabsf(sc[j]));
        }
        y[i].d = f32_to_fp16(amax / 127.0f);  /* 127: the largest int8 scale */
        float d = fp16_to_f32(y[i].d);
        for (int j = 0; j < 16; j++) {
            int q = d > 0 ? quant_clampi((int)lrintf(sc[j] / d), -127, 127) : 0;
            y[i].scales[j] = (int8_t)q;
            float s = d * (float)q;
            for (int l = 0; l < 16; l++)
                L[16 * j + l] = (uint8_t)(s != 0 ? quant_clampi((int)lrintf(x[16 * j + l] / s), -32, 31) + 32 : 32);
        }
        for (int h = 0; h < 2; h++) {
            uint8_t *ql = y[i].ql + 64 * h, *qh = y[i].qh + 32 * h;
            const uint8_t *Lh = L + 128 * h;
            for (int l = 0; l < 32; l++) {
                ql[l] = (uint8_t)((Lh[l] & 0xF) | ((Lh[l + 64] & 0xF) << 4));
                ql[l + 32] = (uint8_t)((Lh[l + 32] & 0xF) | ((Lh[l + 96] & 0xF) << 4));
                qh[l] = (uint8_t)((Lh[l] >> 4) | ((Lh[l + 32] >> 4) << 2) |
                                  ((Lh[l + 64] >> 4) << 4) | ((Lh[l + 96] >> 4) << 6));
            }
        }
    }
}

/* Bytes per row for the writable types (0 if n does not fit the block size). */
static size_t quant_row_size(uint32_t type, int64_t n) {
    switch (type) {
    case GGML_TYPE_F32: return (size_t)n * 4;
    case GGML_TYPE_F16: case GGML_TYPE_BF16: return (size_t)n * 2;
    case GGML_TYPE_Q4_0: return n % QK4_0 ? 0 : (size_t)(n / QK4_0) * sizeof(block_q4_0);
    case GGML_TYPE_Q5_0: return n % QK5_0 ? 0 : (size_t)(n / QK5_0) * sizeof(block_q5_0);
    case GGML_TYPE_Q8_0: return n % QK8_0 ? 0 : (size_t)(n / QK8_0) * sizeof(block_q8_0);
    case GGML_TYPE_Q4_1: return n % QK4_1 ? 0 : (size_t)(n / QK4_1) * sizeof(block_q4_1);
    case GGML_TYPE_Q5_1: return n % QK5_1 ? 0 : (size_t)(n / QK5_1) * sizeof(block_q5_1);
    case GGML_TYPE_Q4_K: return n % QK_K ? 0 : (size_t)(n / QK_K) * sizeof(block_q4_K);
    case GGML_TYPE_Q5_K: return n % QK_K ? 0 : (size_t)(n / QK_K) * sizeof(block_q5_K);
    case GGML_TYPE_Q6_K: return n % QK_K ? 0 : (size_t)(n / QK_K) * sizeof(block_q6_K);
    default: return 0;
    }
}

int quant_quantize_weight_rows(uint32_t type, const float *x, void *y, int64_t nrows, int64_t n) {
    size_t rs = quant_row_size(type, n);
    if (n <= 0 || nrows < 0 || rs == 0) return -1;
    for (int64_t r = 0; r < nrows; r++) {
        const float *xr = x + r * n;
        void *yr = (char *)y + (size_t)r * rs;
        switch (type) {
        case GGML_TYPE_F32: memcpy(yr, xr, rs); break;
        case GGML_TYPE_F16: case GGML_TYPE_BF16: quant_ref_quantize_act_row(type, xr, yr, n); break;
        case GGML_TYPE_Q4_0: quant_write_q4_0(xr, yr, n / QK4_0); break;
        case GGML_TYPE_Q5_0: quant_write_q5_0(xr, yr, n / QK5_0); break;
        case GGML_TYPE_Q8_0: quant_write_q8_0(xr, yr, n / QK8_0); break;
        case GGML_TYPE_Q4_1: quant_write_q4_1(xr, yr, n / QK4_1); break;
        case GGML_TYPE_Q5_1: quant_write_q5_1(xr, yr, n / QK5_1); break;
        case GGML_TYPE_Q4_K: quant_write_q4_K(xr, yr, n / QK_K); break;
        case GGML_TYPE_Q5_K: quant_write_q5_K(xr, yr, n / QK_K); break;
        case GGML_TYPE_Q6_K: quant_write_q6_K(xr, yr, n / QK_K); break;
        default: return -1;
        }
    }
    return 0;
}

/* ==== CPU features ==== */
#if defined(__x86_64__) || defined(__i386__)
#include <cpuid.h>

/* XCR0: which register states the OS saves on a context switch. */
static uint64_t quant_xgetbv(void) {
    uint32_t lo, hi;
    __asm__ volatile("xgetbv" : "=a"(lo), "=d"(hi) : "c"(0));
    return ((uint64_t)hi << 32) | lo;
}

static unsigned quant_cpu_features(void) {
    unsigned a, b, c, d, f = 0;
    if (!__get_cpuid(1, &a, &b, &c, &d)) return 0;
    /* bits of cpuid 1 ecx: 12 FMA, 27 OSXSAVE, 28 AVX, 29 F16C */
    if (!(c & (1u << 27)) || !(c & (1u << 28))) return 0;
    int fma = (c >> 12) & 1, f16c = (c >> 29) & 1;
    uint64_t xcr0 = quant_xgetbv();
    if ((xcr0 & 0x6) != 0x6) return 0;                   /* xmm + ymm state */
    int zmm = (xcr0 & 0xe6) == 0xe6;                     /* + opmask, zmm0-15 upper, zmm16-31 */
    if (__get_cpuid_max(0, NULL) < 7) return 0;
    __cpuid_count(7, 0, a, b, c, d);
    /* leaf 7.0: ebx 5 AVX2, 16 AVX512F, 17 DQ, 30 BW, 31 VL; ecx 11 AVX512_VNNI */
    if (((b >> 5) & 1) && fma && f16c) f |= QK_CPU_AVX2;
    if (zmm && ((b >> 16) & 1) && ((b >> 17) & 1) && ((b >> 30) & 1) && ((b >> 31) & 1) && ((c >> 11) & 1))
        f |= QK_CPU_AVX512;
    unsigned eax1;
    __cpuid_count(7, 1, eax1, b, c, d);
    /* leaf 7.1: eax 4 AVX-VNNI, 5 AVX512_BF16 */
    if ((eax1 >> 4) & 1) f |= QK_CPU_AVXVNNI;
    if (zmm && ((eax1 >> 5) & 1)) f |= QK_CPU_AVX512BF16;
    return f;
}
#elif defined(__aarch64__) && defined(__linux__)
#include <sys/auxv.h>

/* The kernel's hwcaps (asm/hwcap.h): bit 20 of AT_HWCAP is HWCAP_ASIMDDP,
 * the dot-product instructions (sdot/udot); bit 13 of AT_HWCAP2 is
 * HWCAP2_I8MM, the int8 matrix multiplies (smmla). NEON itself is in every
 * arm64. */
static unsigned quant_cpu_features(void) {
    unsigned f = (getauxval(AT_HWCAP) >> 20 & 1) ? QK_CPU_DOTPROD : 0;
#ifdef AT_HWCAP2
    if (getauxval(AT_HWCAP2) >> 13 & 1) f |= QK_CPU_I8MM;
#endif
    return f;
}
#elif defined(__aarch64__) && defined(__APPLE__)
#include <sys/sysctl.h>

/* macOS names the features in sysctl (macOS 12 and later): every Apple
 * M-series core has the dot product, M2 and later the int8 matrix
 * multiplies. (Not compiled on this project's Linux machines: no macOS SDK
 * there.) */
static int quant_sysctl_flag(const char *name) {
    int v = 0;
    size_t n = sizeof v;
    return sysctlbyname(name, &v, &n, NULL, 0) == 0 && v != 0;
}

static unsigned quant_cpu_features(void) {
    unsigned f = quant_sysctl_flag("hw.optional.arm.FEAT_DotProd") ? QK_CPU_DOTPROD : 0;
    if (quant_sysctl_flag("hw.optional.arm.FEAT_I8MM")) f |= QK_CPU_I8MM;
    return f;
}
#else
static unsigned quant_cpu_features(void) { return 0; }
#endif

/* ==== Walk prefetch ====
 * Decoding one token, the AVX-512 walks of packed weights prefetch ahead in
 * software: the K-quant walks every line twice, about 12 KiB and 32 KiB
 * ahead (qa_kp_pf_q4k, qa_kp_far), the Q8_0 / Q4_0 / Q5_0 walk 2 KiB ahead
 * (QA_P16_PF), all into L1. Tuned on a Zen 5 (48 KiB L1D), where they pay;
 * on a Zen 4 (32 KiB L1D) the hardware prefetchers alone do better.
 * - Zen 5, decode tokens alternated in one process at the machine's ~47
 *   GB/s: Qwen3-0.6B Q4_K_M +8-11% with a second prefetch 64 KiB ahead (-2%
 *   to +1% at its ~80 GB/s), and 32 KiB another 3-4% above 64 (16, 24 and
 *   48 KiB within 1.2% of 32); at 32 KiB Q5_K_M +2-6%, the 30B-A3B shape
 *   (8 layers) +7-10%. A 512 MiB Q4_K matrix walked by both cores: 36-39
 *   GB/s with the near prefetch alone, 41-45 with both.
 * - Zen 4, decode tokens alternated in one process (three runs of 48-64
 *   tokens per variant, each switching one thing): without the far
 *   prefetch the 30B-A3B shape 48.9-52.5 -> 54.0-56.6 t/s and Qwen3-0.6B
 *   Q4_K_M 58.5-62.8 -> 69.3-73.3 (16 KiB ahead the same as none, 24 KiB
 *   less); then without the near one too, 52.9-58.0 -> 54.5-59.8 and
 *   69.4-75.8 -> 68.9-77.1; without the Q8_0 walk's, Qwen2.5-0.5B Q8_0
 *   46.3-60.3 -> 52.4-75.8 and Qwen3-0.6B Q8_0 43.5-47.6 -> 46.2-49.7
 *   (512 bytes and 8 KiB ahead no better than 2 KiB). A 512 MiB matrix
 *   walked by both cores: Q4_K 22.7 GB/s with both K-quant prefetches, 28.0
 *   with the near one, 32.7 with none; Q6_K 26.6, 33.2, 35.7.
 * The two cores differ in many ways; what this goes by is the L1D: on
 * where it holds 48 KiB or more, off where it is smaller or unknown. */
volatile int quant_walk_prefetch = 0;
#define QUANT_WALK_PREFETCH_L1D (48 << 10)

static size_t quant_cpu_l1d_bytes(void) {
#if defined(_SC_LEVEL1_DCACHE_SIZE)
    long v = sysconf(_SC_LEVEL1_DCACHE_SIZE);
    return v > 0 ? (size_t)v : 0;
#else
    return 0;
#endif
}

/* ==== Dispatch ==== */
/* Candidate sets, best last; a set is usable when it was built and the CPU
 * has what it needs. */
static const quant_kset *const quant_ksets[] = {
    &quant_kset_neon, &quant_kset_dotprod, &quant_kset_i8mm,
    &quant_kset_avx2, &quant_kset_avxvnni, &quant_kset_avx512,
};
#define QUANT_N_KSETS (int)(sizeof quant_ksets / sizeof quant_ksets[0])
static const quant_kset quant_kset_ref = { .name = "ref", .built = 1 };

/* The active set; NULL until the first use decides. */
static _Atomic(const quant_kset *) quant_active;

/* What this CPU has, read once: its instruction-set features (the return)
 * and whether the decode walks prefetch (quant_walk_prefetch). */
static unsigned quant_cpu_probe(void) {
    static atomic_int feats = -1;
    int f = atomic_load_explicit(&feats, memory_order_acquire);
    if (f < 0) {
        quant_walk_prefetch = quant_cpu_l1d_bytes() >= QUANT_WALK_PREFETCH_L1D;
        f = (int)quant_cpu_features();
        atomic_store_explicit(&feats, f, memory_order_release);
    }
    return (unsigned)f;
}

static int quant_kset_usable(const quant_kset *k) {
    return k->built && (k->needs & ~quant_cpu_probe()) == 0;
}

static const quant_kset *quant_kset_best(void) {
    for (int i = QUANT_N_KSETS - 1; i >= 0; i--)
        if (quant_kset_usable(quant_ksets[i])) return quant_ksets[i];
    return &quant_kset_ref;
}

static const quant_kset *quant_kset_find(const char *name) {
    if (!strcmp(name, "ref")) return &quant_kset_ref;
    for (int i = 0; i < QUANT_N_KSETS; i++)
        if (!strcmp(quant_ksets[i]->name, name) && quant_kset_usable(quant_ksets[i])) return quant_ksets[i];
    return NULL;
}

/* First use: TANDEM_KERNELS names a set, else the best this CPU runs. */
static const quant_kset *quant_kset_get(void) {
    const quant_kset *k = atomic_load_explicit(&quant_active, memory_order_acquire);
    if (k) return k;
    const char *e = getenv("TANDEM_KERNELS");
    k = e && *e ? quant_kset_find(e) : NULL;
    if (e && *e && !k)
        fprintf(stderr, "tandem: TANDEM_KERNELS=%s is not a kernel set this CPU runs; using %s\n", e,
                quant_kset_best()->name);
    if (!k) k = quant_kset_best();
    const quant_kset *expect = NULL;
    atomic_compare_exchange_strong(&quant_active, &expect, k);
    return atomic_load(&quant_active);
}

void quant_force_reference(int on) { atomic_store(&quant_active, on ? &quant_kset_ref : quant_kset_best()); }

int quant_use_kernels(const char *name) {
    const quant_kset *k = quant_kset_find(name);
    if (!k) return -1;
    atomic_store(&quant_active, k);
    return 0;
}

int quant_kernel_sets(const char **names, int cap) {
    int n = 0;
    if (n < cap) names[n] = "ref";
    n++;
    for (int i = 0; i < QUANT_N_KSETS; i++)
        if (quant_kset_usable(quant_ksets[i])) { if (n < cap) names[n] = quant_ksets[i]->name; n++; }
    return n;
}

const char *quant_kernel_name(void) { return quant_kset_get()->name; }

int quant_kernel_vec_ops(void) { return quant_kset_get()->vec_ops; }

void quant_quantize_act_row(uint32_t type, const float *x, void *y, int64_t n) {
    const quant_kset *k = quant_kset_get();
    if (k->quantize_act_row && k->quantize_act_row(type, x, y, n)) return;
    quant_ref_quantize_act_row(type, x, y, n);
}

void quant_mul_mat_tile(uint32_t wtype, int64_t n, const void *w, size_t w_stride, int nw,
                        const void *a, size_t a_stride, int na, float *out, size_t out_stride) {
    if (nw <= 0 || na <= 0) return;
    const quant_kset *k = quant_kset_get();
    if (k->mul_mat_tile && k->mul_mat_tile(wtype, n, w, w_stride, nw, a, a_stride, na, out, out_stride)) return;
    quant_ref_mul_mat_tile(wtype, n, w, w_stride, nw, a, a_stride, na, out, out_stride);
}

void quant_vec_dot(uint32_t wtype, int64_t n, float *s, const void *x, const void *y) {
    quant_mul_mat_tile(wtype, n, x, 0, 1, y, 0, 1, s, 0);
}

/* ==== Packed weights ====
 * Layouts (quant.h gives Q8_0's). A "run" is 64 bytes: 4 bytes of each of the
 * 16 rows in row order, so one zmm load gives each lane its row's bytes.
 * Q4_0, per block (288 bytes = 16 x 18): d x16 (fp16), then 4 runs of qs
 *   (run g: qs[4g .. 4g + 3]). Q5_0 (352 = 16 x 22): d x16, one run of the
 *   4 qh bytes, 4 runs of qs.
 * Q4_K, per super-block (2304 bytes = 16 x 144): d x16 (fp16), dmin x16,
 *   3 runs of the 12 scale bytes (run t: bytes 4t..4t+3), then 32 runs of qs
 *   (run 8c + g: qs[32c + 4g .. +3]; low nibbles are sub-block 2c, high 2c+1).
 * Q5_K (2816 = 16 x 176): Q4_K's d, dmin and scale runs, then 8 runs of qh
 *   (run g: qh[4g .. 4g + 3]; bit j is the fifth bit of sub-block j's
 *   element), then Q4_K's 32 runs of qs.
 * Q6_K, per super-block (3360 bytes = 16 x 210): d x16, 4 runs of the 16 int8
 *   scales, then 3 runs per sub-block s of 16 elements (run 3s + t, t < 3,
 *   byte k: level 16s + 4t + k in bits 2-7, and bits 2t, 2t + 1 of level
 *   16s + 12 + k in bits 0-1). Levels are 0..63 (value + 32). A kernel gets
 *   each level times 4 with one AND (0xFC) for the first three quads of a
 *   sub-block, and the fourth quad's from the three runs' low bit pairs:
 *   the nibble-and-high-bits layout of the file took about twice the
 *   instructions per level. */
#define QUANT_RUN (QUANT_PACK_ROWS * 4)

static size_t quant_pack_block_bytes(uint32_t wtype) {
    switch (wtype) {
    case GGML_TYPE_Q8_0: return sizeof(block_q8_0);
    case GGML_TYPE_Q4_0: return sizeof(block_q4_0);
    case GGML_TYPE_Q5_0: return sizeof(block_q5_0);
    case GGML_TYPE_Q4_K: return sizeof(block_q4_K);
    case GGML_TYPE_Q5_K: return sizeof(block_q5_K);
    case GGML_TYPE_Q6_K: return sizeof(block_q6_K);
    default: return 0;
    }
}

int quant_pack_pays(uint32_t wtype) {
    const quant_kset *k = quant_kset_get();
    return quant_pack_block_bytes(wtype) && k->mul_mat_tile_packed && wtype < 64 &&
           (k->packed_types >> wtype & 1);
}

static inline void quant_q6_K_set(block_q6_K *b, int e, int v) {
    int half = e / 128, g = (e % 128) / 32, l = e % 32;
    uint8_t *ql = b->ql + 64 * half + ((g & 1) ? 32 : 0), *qh = b->qh + 32 * half;
    ql[l] |= (uint8_t)((g & 2) ? (v & 0xF) << 4 : (v & 0xF));
    qh[l] |= (uint8_t)(((v >> 4) & 3) << (2 * g));
}

/* one block of row r (plain) <-> its place in the packed block p */
static void quant_pack_block(uint32_t wtype, const void *blk, int r, uint8_t *p) {
    if (wtype == GGML_TYPE_Q8_0) {
        const block_q8_0 *x = blk;
        memcpy(p + 2 * r, &x->d, 2);
        for (int k = 0; k < 8; k++) {
            uint32_t v;
            memcpy(&v, x->qs + 4 * k, 4);
            v ^= 0x80808080u;
            memcpy(p + 32 + QUANT_RUN * k + 4 * r, &v, 4);
        }
    } else if (wtype == GGML_TYPE_Q4_0) {
        const block_q4_0 *x = blk;
        memcpy(p + 2 * r, &x->d, 2);
        for (int g = 0; g < 4; g++) memcpy(p + 32 + QUANT_RUN * g + 4 * r, x->qs + 4 * g, 4);
    } else if (wtype == GGML_TYPE_Q5_0) {
        const block_q5_0 *x = blk;
        memcpy(p + 2 * r, &x->d, 2);
        memcpy(p + 32 + 4 * r, x->qh, 4);
        for (int g = 0; g < 4; g++) memcpy(p + 96 + QUANT_RUN * g + 4 * r, x->qs + 4 * g, 4);
    } else if (wtype == GGML_TYPE_Q4_K || wtype == GGML_TYPE_Q5_K) {
        /* both blocks start d, dmin, scales[12]; Q5_K's qh runs come before the qs runs */
        const uint8_t *x = blk;
        const int q5 = wtype == GGML_TYPE_Q5_K;
        const size_t qs = q5 ? offsetof(block_q5_K, qs) : offsetof(block_q4_K, qs);
        memcpy(p + 2 * r, x + offsetof(block_q4_K, d), 2);
        memcpy(p + 32 + 2 * r, x + offsetof(block_q4_K, dmin), 2);
        for (int t = 0; t < 3; t++) memcpy(p + 64 + QUANT_RUN * t + 4 * r, x + offsetof(block_q4_K, scales) + 4 * t, 4);
        for (int g = 0; q5 && g < 8; g++) memcpy(p + 256 + QUANT_RUN * g + 4 * r, x + offsetof(block_q5_K, qh) + 4 * g, 4);
        for (int k = 0; k < 32; k++) memcpy(p + (q5 ? 768 : 256) + QUANT_RUN * k + 4 * r, x + qs + 4 * k, 4);
    } else {
        const block_q6_K *x = blk;
        memcpy(p + 2 * r, &x->d, 2);
        for (int q = 0; q < 4; q++) memcpy(p + 32 + QUANT_RUN * q + 4 * r, x->scales + 4 * q, 4);
        /* one call per element made packing a Q6_K matrix 4-5 times slower
         * than the other types (0.45 GB/s a core) */
        uint8_t lv[QK_K];
        quant_q6_K_levels(x, lv);
        for (int sb = 0; sb < 16; sb++)
            for (int k = 0; k < 4; k++) {
                int d = lv[16 * sb + 12 + k];
                for (int t = 0; t < 3; t++)
                    p[288 + QUANT_RUN * (3 * sb + t) + 4 * r + k] =
                        (uint8_t)(lv[16 * sb + 4 * t + k] << 2 | (d >> (2 * t) & 3));
            }
    }
}

static void quant_unpack_block(uint32_t wtype, const uint8_t *p, int r, void *blk) {
    if (wtype == GGML_TYPE_Q8_0) {
        block_q8_0 *y = blk;
        memcpy(&y->d, p + 2 * r, 2);
        for (int k = 0; k < 8; k++)
            for (int e = 0; e < 4; e++) y->qs[4 * k + e] = (int8_t)(p[32 + QUANT_RUN * k + 4 * r + e] ^ 0x80u);
    } else if (wtype == GGML_TYPE_Q4_0) {
        block_q4_0 *y = blk;
        memcpy(&y->d, p + 2 * r, 2);
        for (int g = 0; g < 4; g++) memcpy(y->qs + 4 * g, p + 32 + QUANT_RUN * g + 4 * r, 4);
    } else if (wtype == GGML_TYPE_Q5_0) {
        block_q5_0 *y = blk;
        memcpy(&y->d, p + 2 * r, 2);
        memcpy(y->qh, p + 32 + 4 * r, 4);
        for (int g = 0; g < 4; g++) memcpy(y->qs + 4 * g, p + 96 + QUANT_RUN * g + 4 * r, 4);
    } else if (wtype == GGML_TYPE_Q4_K || wtype == GGML_TYPE_Q5_K) {
        uint8_t *y = blk;
        const int q5 = wtype == GGML_TYPE_Q5_K;
        const size_t qs = q5 ? offsetof(block_q5_K, qs) : offsetof(block_q4_K, qs);
        memcpy(y + offsetof(block_q4_K, d), p + 2 * r, 2);
        memcpy(y + offsetof(block_q4_K, dmin), p + 32 + 2 * r, 2);
        for (int t = 0; t < 3; t++) memcpy(y + offsetof(block_q4_K, scales) + 4 * t, p + 64 + QUANT_RUN * t + 4 * r, 4);
        for (int g = 0; q5 && g < 8; g++) memcpy(y + offsetof(block_q5_K, qh) + 4 * g, p + 256 + QUANT_RUN * g + 4 * r, 4);
        for (int k = 0; k < 32; k++) memcpy(y + qs + 4 * k, p + (q5 ? 768 : 256) + QUANT_RUN * k + 4 * r, 4);
    } else {
        block_q6_K *y = blk;
        memset(y, 0, sizeof *y);
        memcpy(&y->d, p + 2 * r, 2);
        for (int q = 0; q < 4; q++) memcpy(y->scales + 4 * q, p + 32 + QUANT_RUN * q + 4 * r, 4);
        for (int sb = 0; sb < 16; sb++)
            for (int k = 0; k < 4; k++) {
                int d = 0;
                for (int t = 0; t < 3; t++) {
                    int v = p[288 + QUANT_RUN * (3 * sb + t) + 4 * r + k];
                    quant_q6_K_set(y, 16 * sb + 4 * t + k, v >> 2);
                    d |= (v & 3) << (2 * t);
                }
                quant_q6_K_set(y, 16 * sb + 12 + k, d);
            }
    }
}

int quant_pack_rows(uint32_t wtype, const void *src, size_t row_bytes, int64_t n_rows, void *dst) {
    size_t bs = quant_pack_block_bytes(wtype);
    if (!bs || n_rows % QUANT_PACK_ROWS || row_bytes % bs) return -1;
    const size_t group = QUANT_PACK_ROWS * row_bytes, pb = QUANT_PACK_ROWS * bs;
    const int64_t nb = (int64_t)(row_bytes / bs);
    for (int64_t g = 0; g < n_rows / QUANT_PACK_ROWS; g++)
        for (int r = 0; r < QUANT_PACK_ROWS; r++)
            for (int64_t b = 0; b < nb; b++)
                quant_pack_block(wtype, (const uint8_t *)src + (size_t)g * group + (size_t)r * row_bytes + (size_t)b * bs, r,
                                 (uint8_t *)dst + (size_t)g * group + (size_t)b * pb);
    return 0;
}

void quant_unpack_row(uint32_t wtype, const void *group, size_t row_bytes, int lane, void *dst) {
    size_t bs = quant_pack_block_bytes(wtype);
    if (!bs) return;
    for (size_t b = 0; b < row_bytes / bs; b++)
        quant_unpack_block(wtype, (const uint8_t *)group + b * QUANT_PACK_ROWS * bs, lane, (uint8_t *)dst + b * bs);
}

/* The reference straight from the packed layout: each block unpacked and
 * dotted alone, the block terms summed in order as quant_ref_vec_dot does
 * (0 + t is t for every t the sum can meet, so the result is the same bits). */
static void quant_ref_mul_mat_packed(uint32_t wtype, int64_t n, const uint8_t *w, size_t w_stride, int nw,
                                     const void *a, size_t a_stride, int na, float *out, size_t out_stride) {
    const size_t bs = quant_pack_block_bytes(wtype);
    const uint32_t at = quant_vec_dot_type(wtype);
    const int64_t qk = at == GGML_TYPE_Q8_0 ? QK8_0 : QK_K, nb = n / qk;
    const size_t abs = at == GGML_TYPE_Q8_0 ? sizeof(block_q8_0) : sizeof(block_q8_K);
    _Alignas(8) uint8_t blk[sizeof(block_q6_K) > sizeof(block_q4_K) ? sizeof(block_q6_K) : sizeof(block_q4_K)];
    for (int j = 0; j < na; j++) {
        const uint8_t *y = (const uint8_t *)a + (size_t)j * a_stride;
        for (int i = 0; i < nw; i++) {
            const uint8_t *g = w + (size_t)(i / QUANT_PACK_ROWS) * QUANT_PACK_ROWS * w_stride;
            float sumf = 0.0f;
            for (int64_t b = 0; b < nb; b++) {
                float t;
                quant_unpack_block(wtype, g + (size_t)b * QUANT_PACK_ROWS * bs, i % QUANT_PACK_ROWS, blk);
                quant_ref_vec_dot(wtype, qk, &t, blk, y + (size_t)b * abs);
                sumf += t;
            }
            out[(size_t)j * out_stride + (size_t)i] = sumf;
        }
    }
}

void quant_mul_mat_tile_packed(uint32_t wtype, int64_t n, const void *w, size_t w_stride, int nw,
                               const void *a, size_t a_stride, int na, float *out, size_t out_stride) {
    if (nw <= 0 || na <= 0 || !quant_pack_block_bytes(wtype)) return;
    const quant_kset *k = quant_kset_get();
    if (k->mul_mat_tile_packed && k->mul_mat_tile_packed(wtype, n, w, w_stride, nw, a, a_stride, na, out, out_stride))
        return;
    quant_ref_mul_mat_packed(wtype, n, w, w_stride, nw, a, a_stride, na, out, out_stride);
}

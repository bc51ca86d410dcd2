/* quant.c - scalar conversions, block decoders and the reference kernels
 * (quant_write.c quantizes weights for model files, quant_dispatch.c picks
 * a kernel set, quant_pack.c holds the packed layouts; quant_internal.h
 * between them).
 *
 * Everything here is plain C and serves as the definition the SIMD kernels in
 * quant_avx2.c and quant_neon.c must reproduce: the same integer sums per
 * block, scaled the same way, so results differ only by float summation order.
 * Activation quantizers (Q8_0, Q8_K) follow llama.cpp's reference definitions
 * exactly, because the oracle's logits depend on them.
 */
#include "engine/quant.h"

#include <math.h>
#include <string.h>

#include "engine/quant_internal.h"

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

void quant_put_scale_min_k4(uint8_t *q, const uint8_t *sc, const uint8_t *m) {
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
void quant_q6_K_levels(const block_q6_K *b, uint8_t lv[QK_K]) {
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
void quant_ref_act_q8_0(const float *x, block_q8_0 *y, int64_t nb) {
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

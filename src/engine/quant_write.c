/* quant_write.c - weight quantization for writing model files (genmodel,
 * the tests' fixtures): each block's scale (and min) fitted, its levels
 * rounded and packed in the file's layout. */

#include "engine/quant.h"

#include <math.h>
#include <string.h>

#include "engine/quant_internal.h"

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

/* 32 five-bit levels into a Q5_0 / Q5_1 block: low nibbles in qs (element
 * j and j + 16 share a byte), fifth bits in qh (bit j: element j). */
static void quant_put_5bit(const uint8_t *L, uint8_t *qs, uint8_t *qh_out) {
    uint32_t qh = 0;
    for (int j = 0; j < 16; j++) {
        qs[j] = (uint8_t)((L[j] & 0xF) | ((L[j + 16] & 0xF) << 4));
        qh |= (uint32_t)(L[j] >> 4) << j;
        qh |= (uint32_t)(L[j + 16] >> 4) << (j + 16);
    }
    memcpy(qh_out, &qh, 4);
}

static void quant_write_q5_0(const float *x, block_q5_0 *y, int64_t nb) {
    uint8_t L[32];
    for (int64_t i = 0; i < nb; i++, x += 32) {
        quant_symmetric_levels(x, 32, &y[i].d, L);
        quant_put_5bit(L, y[i].qs, y[i].qh);
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
        quant_put_5bit(L, y[i].qs, y[i].qh);
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

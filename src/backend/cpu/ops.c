/* ops.c - see ops.h. */
#include "backend/cpu/ops.h"
#include "backend/cpu/ops_kernels.h"

#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "engine/quant.h"

/* The references are the numerical definition: no fused multiply-adds
 * (GCC's ISO C modes already do not contract; clang does by default). */
#if defined(__clang__)
#pragma STDC FP_CONTRACT OFF
#endif

/* ==== Reference versions ==== */

double ops_ref_exp_sum(const float *x, float sub, float *y, size_t n) {
    double sum = 0.0;
    for (size_t i = 0; i < n; i++) { float e = expf(x[i] - sub); y[i] = e; sum += e; }
    return sum;
}

void ops_ref_swiglu(const float *g, const float *u, float *y, size_t n) {
    for (size_t i = 0; i < n; i++) y[i] = g[i] / (1.0f + expf(-g[i])) * u[i];
}

void ops_ref_rms_norm_row(const float *x, const float *w, float *y, size_t n, float eps) {
    double sum = 0.0;   /* double accumulation, as ggml does */
    for (size_t i = 0; i < n; i++) sum += (double)(x[i] * x[i]);
    float scale = 1.0f / sqrtf((float)(sum / (double)n) + eps);
    for (size_t i = 0; i < n; i++) y[i] = x[i] * scale;
    if (w) for (size_t i = 0; i < n; i++) y[i] = y[i] * w[i];
}

/* out[g] = sum over p of pr[g][p] * V[p], one fmaf per term in position
 * order: the vector sets fuse the same products (ops_avx512.c says why). */
void ops_ref_attn_pv(uint32_t dt, const uint8_t *v, size_t v_stride, int npos, const float *pr, size_t pr_stride,
                     int grp, int hd, float *out, float *tmp) {
    for (size_t i = 0; i < (size_t)grp * (size_t)hd; i++) out[i] = 0.0f;
    for (int p = 0; p < npos; p++) {
        quant_dequantize_row(dt, v + (size_t)p * v_stride, tmp, hd);
        for (int g = 0; g < grp; g++) {
            float a = pr[(size_t)g * pr_stride + (size_t)p];
            float *o = out + (size_t)g * hd;
            for (int d = 0; d < hd; d++) o[d] = fmaf(a, tmp[d], o[d]);
        }
    }
}

/* ==== Dispatch ==== */

/* Which vector ops go with the active kernel set (quant_kernel_vec_ops):
 * the AVX2 ones with every x86 set, the AVX-512 ones too with avx512, the
 * NEON ones with the arm64 sets. */
static int ops_use_avx2(void) {
    const int v = quant_kernel_vec_ops();
    return v == QK_VEC_AVX2 || v == QK_VEC_AVX512;
}
static int ops_use_avx512(void) { return quant_kernel_vec_ops() == QK_VEC_AVX512; }
static int ops_use_neon(void) { return quant_kernel_vec_ops() == QK_VEC_NEON; }

/* The vector versions: ops_kernels.h. */

/* ==== Public entry points ==== */

void ops_attn_pv(uint32_t dt, const uint8_t *v, size_t v_stride, int npos, const float *pr, size_t pr_stride,
                 int grp, int hd, float *out, float *tmp) {
    if (ops_use_avx512() && ops_avx512_attn_pv(dt, v, v_stride, npos, pr, pr_stride, grp, hd, out, tmp))
        return;
    if (ops_use_avx2() && ops_avx2_attn_pv(dt, v, v_stride, npos, pr, pr_stride, grp, hd, out, tmp)) return;
    if (ops_use_neon() && ops_neon_attn_pv(dt, v, v_stride, npos, pr, pr_stride, grp, hd, out, tmp)) return;
    ops_ref_attn_pv(dt, v, v_stride, npos, pr, pr_stride, grp, hd, out, tmp);
}

/* the vector versions convert blocks of 128 keys (AVX-512, AVX2) or 64 V rows
 * (AVX-512, NEON) to f32 */
size_t ops_attn_tmp(int hd) { return (size_t)128 * (size_t)(hd > 0 ? hd : 1); }

#define OPS_ATT_KB 128

void ops_attn_scores(uint32_t dt, const uint8_t *k, size_t k_stride, int nk, const void *q, size_t q_stride,
                     int nq, int hd, float scale, float *s, size_t s_stride, float *tmp) {
    if (ops_use_avx512() && quant_vec_dot_type(dt) == GGML_TYPE_F32 &&
        ops_avx512_attn_scores(dt, k, k_stride, nk, q, q_stride, nq, hd, scale, s, s_stride, tmp))
        return;
    if (ops_use_avx2() && quant_vec_dot_type(dt) == GGML_TYPE_F32 &&
        ops_avx2_attn_scores(dt, k, k_stride, nk, q, q_stride, nq, hd, scale, s, s_stride, tmp))
        return;
    /* blocks of keys: 128 F16 K rows of a 128-wide head are 32 KiB, in L1
     * while every query row passes over them */
    for (int k0 = 0; k0 < nk; k0 += OPS_ATT_KB) {
        int kb = nk - k0 < OPS_ATT_KB ? nk - k0 : OPS_ATT_KB;
        quant_mul_mat_tile(dt, hd, k + (size_t)k0 * k_stride, k_stride, kb, q, q_stride, nq, s + k0, s_stride);
        for (int r = 0; r < nq; r++) ops_scale(s + (size_t)r * s_stride + k0, scale, (size_t)kb);
    }
}

int ops_vectorised(void) {
    double s;
    return (ops_use_avx2() && ops_avx2_exp_sum(NULL, 0.0f, NULL, 0, &s)) ||
           (ops_use_neon() && ops_neon_exp_sum(NULL, 0.0f, NULL, 0, &s));
}

double ops_exp_sum(const float *x, float sub, float *y, size_t n) {
    double sum;
    if (ops_use_avx512() && ops_avx512_exp_sum(x, sub, y, n, &sum)) return sum;
    if (ops_use_avx2() && ops_avx2_exp_sum(x, sub, y, n, &sum)) return sum;
    if (ops_use_neon() && ops_neon_exp_sum(x, sub, y, n, &sum)) return sum;
    return ops_ref_exp_sum(x, sub, y, n);
}

void ops_swiglu(const float *g, const float *u, float *y, size_t n) {
    if (ops_use_avx2() && ops_avx2_swiglu(g, u, y, n)) return;
    if (ops_use_neon() && ops_neon_swiglu(g, u, y, n)) return;
    ops_ref_swiglu(g, u, y, n);
}

void ops_rms_norm_row(const float *x, const float *w, float *y, size_t n, float eps) {
    if (ops_use_avx2() && ops_avx2_rms_norm_row(x, w, y, n, eps)) return;
    if (ops_use_neon() && ops_neon_rms_norm_row(x, w, y, n, eps)) return;
    ops_ref_rms_norm_row(x, w, y, n, eps);
}

/* The loops below vectorise as written (no reductions in float). */
void ops_add(float *x, const float *y, size_t n) {
    for (size_t i = 0; i < n; i++) x[i] += y[i];
}

void ops_axpy(float a, const float *x, float *y, size_t n) {
    if (ops_use_avx2() && ops_avx2_axpy(a, x, y, n)) return;
    if (ops_use_neon() && ops_neon_axpy(a, x, y, n)) return;
    for (size_t i = 0; i < n; i++) y[i] += a * x[i];
}

void ops_scale(float *x, float a, size_t n) {
    if (ops_use_avx512() && ops_avx512_scale(x, a, n)) return;
    if (ops_use_avx2() && ops_avx2_scale(x, a, n)) return;
    if (ops_use_neon() && ops_neon_scale(x, a, n)) return;
    for (size_t i = 0; i < n; i++) x[i] *= a;
}

float ops_max(const float *x, size_t n) {
    float m = x[0];
    if (ops_use_avx512() && ops_avx512_max(x, n, &m)) return m;
    if (ops_use_avx2() && ops_avx2_max(x, n, &m)) return m;
    if (ops_use_neon() && ops_neon_max(x, n, &m)) return m;
    for (size_t i = 1; i < n; i++) m = x[i] > m ? x[i] : m;
    return m;
}

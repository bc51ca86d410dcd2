/* ops.h - element-wise kernels of the CPU backend (exp, softmax pieces,
 * SiLU gating, RMS norm, vector add and axpy).
 *
 * Each has a plain C reference (ops_ref_*) and a dispatched version that uses
 * AVX2/FMA (src/backend/cpu/ops_avx2.c) when the active kernel set is an
 * x86 one (and so honours quant_force_reference and TANDEM_KERNELS, like
 * the matrix kernels). Softmax's exp is computed in double and rounds like
 * libm's expf (within 1 ulp; the quantised golden tests are sensitive to
 * it); SiLU's exp is a float polynomial within 2 ulp. tests/backend/test_ops.c
 * compares the vector and reference versions.
 */
#ifndef TANDEM_OPS_H
#define TANDEM_OPS_H

#include <stddef.h>
#include <stdint.h>

/* y[i] = expf(x[i] - sub); returns the sum of the y[i] accumulated in double. */
double ops_exp_sum(const float *x, float sub, float *y, size_t n);
double ops_ref_exp_sum(const float *x, float sub, float *y, size_t n);

/* y[i] = g[i] / (1 + expf(-g[i])) * u[i]  (y may alias g or u) */
void ops_swiglu(const float *g, const float *u, float *y, size_t n);
void ops_ref_swiglu(const float *g, const float *u, float *y, size_t n);

/* y = x / sqrt(mean(x^2) + eps) * w (w may be NULL); squares summed in double. */
void ops_rms_norm_row(const float *x, const float *w, float *y, size_t n, float eps);
void ops_ref_rms_norm_row(const float *x, const float *w, float *y, size_t n, float eps);

/* x[i] += y[i] */
void ops_add(float *x, const float *y, size_t n);
/* y[i] += a * x[i], the product rounded before the sum (the vector version too) */
void ops_axpy(float a, const float *x, float *y, size_t n);
/* max of x[0..n) (n >= 1) */
float ops_max(const float *x, size_t n);
/* x[i] *= a */
void ops_scale(float *x, float a, size_t n);

/* Attention's weighted sum of V rows for grp query heads at once:
 * out[g][d] = sum_p pr[g * pr_stride + p] * V_p[d] for p < npos, d < hd,
 * where V_p is the row of type dt (F16, BF16 or anything quant.h dequantises)
 * at v + p * v_stride. Positions are summed in order, one fused
 * multiply-add each. tmp: ops_attn_tmp(hd) floats of scratch. */
void ops_attn_pv(uint32_t dt, const uint8_t *v, size_t v_stride, int npos, const float *pr, size_t pr_stride,
                 int grp, int hd, float *out, float *tmp);
void ops_ref_attn_pv(uint32_t dt, const uint8_t *v, size_t v_stride, int npos, const float *pr, size_t pr_stride,
                     int grp, int hd, float *out, float *tmp);

/* Attention scores: s[r * s_stride + i] = (0 + dot(q_r, K_i)) * scale for
 * query rows r < nq (at q + r * q_stride, in quant_vec_dot_type(dt)) and
 * keys i < nk (rows of type dt at k + i * k_stride, hd values each), the dot
 * being exactly what quant_mul_mat_tile computes with the K rows as weight
 * rows (the AVX-512 and AVX2 versions reproduce the float tile bit for bit).
 * tmp: ops_attn_tmp(hd) floats of scratch. */
void ops_attn_scores(uint32_t dt, const uint8_t *k, size_t k_stride, int nk, const void *q, size_t q_stride,
                     int nq, int hd, float scale, float *s, size_t s_stride, float *tmp);
/* floats of scratch ops_attn_scores and ops_attn_pv need (>= hd) */
size_t ops_attn_tmp(int hd);

/* 1 if the vector versions are in use */
int ops_vectorised(void);

#endif

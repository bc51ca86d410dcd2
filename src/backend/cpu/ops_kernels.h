/* ops_kernels.h - the vector versions of ops.h's kernels (internal).
 *
 * Each set is one file of src/backend/cpu/ built with its own instruction-set
 * flags (ops_avx2.c: AVX2/FMA/F16C; ops_avx512.c: AVX-512 F/BW/VL/DQ, used
 * with the avx512 kernel set; ops_neon.c: arm64, used with the arm64 sets);
 * ops.c picks one per call. A function returns 1
 * when it handled the request and 0 when the caller must use the plain C
 * version (a file built without its flags returns 0 from every function).
 * Declared once here so that the compiler checks every definition against
 * the calls.
 */
#ifndef TANDEM_OPS_KERNELS_H
#define TANDEM_OPS_KERNELS_H

#include <stddef.h>
#include <stdint.h>

/* ==== AVX2 (ops_avx2.c) ==== */
int ops_avx2_exp_sum(const float *x, float sub, float *y, size_t n, double *sum);
int ops_avx2_swiglu(const float *g, const float *u, float *y, size_t n);
int ops_avx2_rms_norm_row(const float *x, const float *w, float *y, size_t n, float eps);
int ops_avx2_scale(float *x, float a, size_t n);
int ops_avx2_axpy(float a, const float *x, float *y, size_t n);
int ops_avx2_max(const float *x, size_t n, float *m);
int ops_avx2_attn_scores(uint32_t dt, const uint8_t *k, size_t k_stride, int nk, const float *q, size_t q_stride,
                         int nq, int hd, float scale, float *s, size_t s_stride, float *kf);
int ops_avx2_attn_pv(uint32_t dt, const uint8_t *v, size_t v_stride, int npos, const float *pr,
                     size_t pr_stride, int grp, int hd, float *out, float *vf);

/* ==== AVX-512 (ops_avx512.c) ==== */
int ops_avx512_attn_pv(uint32_t dt, const uint8_t *v, size_t v_stride, int npos, const float *pr,
                       size_t pr_stride, int grp, int hd, float *out, float *vf);
int ops_avx512_exp_sum(const float *x, float sub, float *y, size_t n, double *sum);
int ops_avx512_max(const float *x, size_t n, float *m);
int ops_avx512_scale(float *x, float a, size_t n);
int ops_avx512_attn_scores(uint32_t dt, const uint8_t *k, size_t k_stride, int nk, const float *q, size_t q_stride,
                           int nq, int hd, float scale, float *s, size_t s_stride, float *tmp);

/* ==== NEON (ops_neon.c) ==== */
int ops_neon_exp_sum(const float *x, float sub, float *y, size_t n, double *sum);
int ops_neon_swiglu(const float *g, const float *u, float *y, size_t n);
int ops_neon_rms_norm_row(const float *x, const float *w, float *y, size_t n, float eps);
int ops_neon_scale(float *x, float a, size_t n);
int ops_neon_axpy(float a, const float *x, float *y, size_t n);
int ops_neon_max(const float *x, size_t n, float *m);
int ops_neon_attn_pv(uint32_t dt, const uint8_t *v, size_t v_stride, int npos, const float *pr,
                     size_t pr_stride, int grp, int hd, float *out, float *vf);

#endif

/* ops_avx512.c - attention's weighted sum of V rows (ops_attn_pv) on zmm
 * registers: 32 columns of up to 4 query rows per walk over the positions,
 * twice the ymm version's width. Built with the avx512 kernel set's flags
 * and used with that set (quant_kernel_vec_ops() == 2). Each output element
 * is still one multiply then one add per position, in position order, so
 * the result is bit-identical to the reference and the AVX2 version. */
#include "ops.h"
#include "quant.h"

#include <stddef.h>
#include <stdint.h>

#if defined(__clang__)
#pragma STDC FP_CONTRACT OFF
#endif

int ops_avx512_attn_pv(uint32_t dt, const uint8_t *v, size_t v_stride, int npos, const float *pr,
                       size_t pr_stride, int grp, int hd, float *out);

#if defined(__AVX512F__) && defined(__AVX512BW__)
#include <immintrin.h>

/* 32 values of a V row (F16 or BF16) at element d, as two f32 vectors. */
static inline void ops_load_v32(uint32_t dt, const uint8_t *row, int d, __m512 *lo, __m512 *hi) {
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

static inline __attribute__((always_inline)) void ops_pv_block32(uint32_t dt, int G, const uint8_t *v,
        size_t v_stride, int npos, const float *pr, size_t pr_stride, int hd, int d, float *out) {
    __m512 acc[4][2];
    _Pragma("GCC unroll 4")
    for (int g = 0; g < G; g++) acc[g][0] = acc[g][1] = _mm512_setzero_ps();
    for (int p = 0; p < npos; p++) {
        __m512 lo, hi;
        ops_load_v32(dt, v + (size_t)p * v_stride, d, &lo, &hi);
        _Pragma("GCC unroll 4")
        for (int g = 0; g < G; g++) {
            __m512 a = _mm512_set1_ps(pr[(size_t)g * pr_stride + (size_t)p]);
            acc[g][0] = _mm512_add_ps(acc[g][0], _mm512_mul_ps(a, lo));
            acc[g][1] = _mm512_add_ps(acc[g][1], _mm512_mul_ps(a, hi));
        }
    }
    _Pragma("GCC unroll 4")
    for (int g = 0; g < G; g++) {
        _mm512_storeu_ps(out + (size_t)g * hd + d, acc[g][0]);
        _mm512_storeu_ps(out + (size_t)g * hd + d + 16, acc[g][1]);
    }
}

int ops_avx512_attn_pv(uint32_t dt, const uint8_t *v, size_t v_stride, int npos, const float *pr,
                       size_t pr_stride, int grp, int hd, float *out) {
    if ((dt != GGML_TYPE_F16 && dt != GGML_TYPE_BF16) || hd % 32) return 0;
    for (int g0 = 0; g0 < grp; g0 += 4) {
        int G = grp - g0 < 4 ? grp - g0 : 4;
        const float *pg = pr + (size_t)g0 * pr_stride;
        float *og = out + (size_t)g0 * hd;
        for (int d = 0; d < hd; d += 32) {
            switch (G) {
            case 1: ops_pv_block32(dt, 1, v, v_stride, npos, pg, pr_stride, hd, d, og); break;
            case 2: ops_pv_block32(dt, 2, v, v_stride, npos, pg, pr_stride, hd, d, og); break;
            case 3: ops_pv_block32(dt, 3, v, v_stride, npos, pg, pr_stride, hd, d, og); break;
            default: ops_pv_block32(dt, 4, v, v_stride, npos, pg, pr_stride, hd, d, og); break;
            }
        }
    }
    return 1;
}
#else
int ops_avx512_attn_pv(uint32_t dt, const uint8_t *v, size_t v_stride, int npos, const float *pr,
                       size_t pr_stride, int grp, int hd, float *out) { return 0; }
#endif

/* quant_avx2.c - AVX2/FMA/F16C kernels (x86-64), with VNNI when built for it.
 *
 * This file is one kernel set (quant_kernels.h) and the body of two more:
 * quant_avxvnni.c and quant_avx512.c include it with QA_SET renamed and are
 * compiled with wider instruction-set flags, so the same source gives the
 * avx2, avxvnni and avx512 sets and quant_dispatch.c picks one at run time.
 *
 * The tile kernels decode one weight block into registers once and multiply
 * it against up to four activation rows (two weight rows at a time for the
 * 32-element formats), so decoding cost is shared. Integer sums per block are
 * exactly those of the reference kernels in quant.c; only the order of the
 * float accumulation differs.
 */
#include "engine/quant.h"
#include "engine/quant_kernels.h"

/* multiply then add stay two roundings where written so (the 16-row Q8_0
 * kernel replays the reference's arithmetic); GCC's ISO modes never fuse */
#if defined(__clang__)
#pragma STDC FP_CONTRACT OFF
#endif

#ifndef QA_SET
#define QA_SET avx2
#define QA_SET_OK 1     /* the includers say whether the build has their extensions */
#define QA_PLAIN 1      /* AVX2 only, even if ARCH_FLAGS enable more (e.g. -march=native) */
#endif
#define QA_CAT2(a, b) a##_##b
#define QA_CAT(a, b) QA_CAT2(a, b)
#define QA_STR2(a) #a
#define QA_STR(a) QA_STR2(a)

#if defined(__AVX2__) && defined(__FMA__) && defined(__F16C__) && QA_SET_OK
#include <immintrin.h>
#include <string.h>

#define QA_INLINE static inline __attribute__((always_inline))
/* small loops over rows and sub-blocks must unroll so their vectors stay in registers */
#define QA_UNROLL _Pragma("GCC unroll 8")

/* Activation rows handled per pass: 4 keeps accumulators, weights and
 * temporaries inside the 16 ymm registers of AVX2. */
#define QA_ROWS 4
/* Blocks of 32 per K-chunk: bounds the stack copies of activation scales
 * (and, with VNNI, offset corrections: QA_ROWS * QA_CHUNK * 32 bytes). */
#define QA_CHUNK 128
/* The AVX-512 pair tile and r16 packing prefetch each row QA_PF bytes
 * ahead, once per 64-byte line (256 and 1024 were slower). */
#define QA_PF 512
/* Decode (one activation row) with the AVX2 / AVX-VNNI sets walks one
 * weight row at a time, a sequential stream per thread, each line
 * prefetched QA_PF_ROW bytes ahead (into the rows that follow). Measured
 * with 2 threads, avx2 set, on a Zen 4, alternated runs, tg64: the
 * 32-element tile walked four rows side by side, four streams 1088 bytes
 * apart (a 1024-wide Q8_0 row) that the hardware prefetcher followed badly:
 * Qwen3-0.6B Q8_0 21.5-23.1 t/s (512 bytes ahead in each row), 28-31
 * prefetching the next four rows, one row 4096 bytes ahead 40-50 (2048 to
 * 12288 ahead all within the machine's noise; a huge-page copy of the plain
 * rows changed nothing). The K-quant walk, one row already, had no
 * prefetch: Qwen3-0.6B Q4_K_M 57-67 t/s without, 67-74 at 4096 bytes
 * ahead (five pairs, each higher), 66-70 at 8192. */
#define QA_PF_ROW 4096


#if !defined(QA_PLAIN) && ((defined(__AVX512VNNI__) && defined(__AVX512VL__)) || defined(__AVXVNNI__))
/* dpbusd multiplies unsigned by signed bytes without int16 saturation, so a
 * signed weight w can enter as w + 128 with -128 * sum(y) preloaded in the
 * accumulator: one instruction per block pair instead of sign + dot. */
#define QA_VNNI 1
#endif
#if defined(QA_WANT_ZMM) && defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512DQ__) && \
    defined(__AVX512VNNI__)
/* the 32-element formats use the zmm tile below instead of the ymm one */
#define QA_ZMM 1
#endif

/* ==== Helpers ==== */
QA_INLINE float qa_hsum_ps(__m256 v) {
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    s = _mm_add_ss(s, _mm_movehdup_ps(s));
    return _mm_cvtss_f32(s);
}

QA_INLINE float qa_h2f(fp16_t h) { return _cvtsh_ss(h); }

/* acc + sums of four u8*s8 products per int32 lane (no saturation for our ranges:
 * |u| <= 127 or u <= 63, so maddubs' int16 pair sums stay below 32767). */
QA_INLINE __m256i qa_dot_u8s8(__m256i acc, __m256i u, __m256i s) {
#if defined(QA_VNNI) && defined(__AVX512VNNI__) && defined(__AVX512VL__)
    return _mm256_dpbusd_epi32(acc, u, s);
#elif defined(QA_VNNI) && defined(__AVXVNNI__)
    return _mm256_dpbusd_avx_epi32(acc, u, s);
#else
    __m256i p = _mm256_maddubs_epi16(u, s);
    return _mm256_add_epi32(acc, _mm256_madd_epi16(p, _mm256_set1_epi16(1)));
#endif
}

/* acc + int16 pair products (madd) */
QA_INLINE __m256i qa_madd_acc(__m256i acc, __m256i a, __m256i b) {
#if defined(QA_VNNI) && defined(__AVX512VNNI__) && defined(__AVX512VL__)
    return _mm256_dpwssd_epi32(acc, a, b);
#elif defined(QA_VNNI) && defined(__AVXVNNI__)
    return _mm256_dpwssd_avx_epi32(acc, a, b);
#else
    return _mm256_add_epi32(acc, _mm256_madd_epi16(a, b));
#endif
}

/* 32 bits -> 32 bytes, 0xFF where the bit is set (byte j <- bit j). */
QA_INLINE __m256i qa_bits_to_bytes(uint32_t bits) {
    const __m256i shuf = _mm256_set_epi64x(0x0303030303030303LL, 0x0202020202020202LL,
                                           0x0101010101010101LL, 0x0000000000000000LL);
    const __m256i mask = _mm256_set1_epi64x(0x8040201008040201LL);
    __m256i b = _mm256_shuffle_epi8(_mm256_set1_epi32((int)bits), shuf);
    return _mm256_cmpeq_epi8(_mm256_and_si256(b, mask), mask);
}

/* 16 bytes of nibbles -> 32 bytes: low nibbles first, then high nibbles. */
QA_INLINE __m256i qa_nibbles(const uint8_t *p) {
    __m128i t = _mm_loadu_si128((const __m128i *)p);
    __m256i v = _mm256_set_m128i(_mm_srli_epi16(t, 4), t);
    return _mm256_and_si256(v, _mm256_set1_epi8(0xF));
}

#if defined(QA_ZMM)
#include "quant_avx512_parts.h"
#endif

#if defined(QA_ONLY)
/* One of the avx512 set's other compile units (quant_avx512_parts.h):
 * the helpers above and its family's header alone */
#if defined(QA_ZMM)
#include QA_ONLY
#endif
#else

/* ==== 32-element formats (Q4_0, Q5_0, Q8_0) x Q8_0 ==== */
/* Signed int8 values of one weight block and its scale. */
QA_INLINE __m256i qa_decode_b32(uint32_t type, const uint8_t *blk, float *d) {
    if (type == GGML_TYPE_Q8_0) {
        const block_q8_0 *b = (const block_q8_0 *)blk;
        *d = qa_h2f(b->d);
        return _mm256_loadu_si256((const __m256i *)b->qs);
    }
    if (type == GGML_TYPE_Q4_0) {
        const block_q4_0 *b = (const block_q4_0 *)blk;
        *d = qa_h2f(b->d);
        return _mm256_sub_epi8(qa_nibbles(b->qs), _mm256_set1_epi8(8));
    }
    const block_q5_0 *b = (const block_q5_0 *)blk;
    uint32_t qh;
    memcpy(&qh, b->qh, 4);
    *d = qa_h2f(b->d);
    __m256i hi = _mm256_and_si256(qa_bits_to_bytes(qh), _mm256_set1_epi8(0x10));
    return _mm256_sub_epi8(_mm256_or_si256(qa_nibbles(b->qs), hi), _mm256_set1_epi8(16));
}

QA_INLINE size_t qa_bsize_b32(uint32_t type) {
    return type == GGML_TYPE_Q8_0 ? sizeof(block_q8_0)
         : type == GGML_TYPE_Q4_0 ? sizeof(block_q4_0) : sizeof(block_q5_0);
}

#if !defined(QA_ZMM)
/* RW weight rows x RA activation rows over nb blocks. da[r][b]: activation scales.
 * res[r * RW + i] receives the partial dot of weight row i with act row r. */
QA_INLINE void qa_tile_b32(uint32_t type, int RW, int RA, int64_t nb, const uint8_t *w, size_t w_stride,
                           const block_q8_0 *const *a, const float (*da)[QA_CHUNK],
                           const __m256i (*corr)[QA_CHUNK], float *res) {
    __m256 acc[4][QA_ROWS];
    QA_UNROLL
    for (int i = 0; i < RW; i++)
        QA_UNROLL
        for (int r = 0; r < RA; r++) acc[i][r] = _mm256_setzero_ps();
    const size_t bs = qa_bsize_b32(type);
    for (int64_t b = 0; b < nb; b++) {
        __m256i aq[4], q[4];
        __m256 dw[4];
        QA_UNROLL
        for (int i = 0; i < RW; i++) {
            float d;
            q[i] = qa_decode_b32(type, w + (size_t)i * w_stride + (size_t)b * bs, &d);
            if (RA == 1 && (b & 1) == 0)   /* see QA_PF_ROW */
                _mm_prefetch((const char *)w + (size_t)i * w_stride + (size_t)b * bs + QA_PF_ROW, _MM_HINT_T0);
#if defined(QA_VNNI)
            aq[i] = _mm256_xor_si256(q[i], _mm256_set1_epi8((char)0x80));  /* w + 128 as u8 */
#else
            aq[i] = _mm256_sign_epi8(q[i], q[i]);
#endif
            dw[i] = _mm256_set1_ps(d);
        }
        QA_UNROLL
        for (int r = 0; r < RA; r++) {
            __m256i y = _mm256_loadu_si256((const __m256i *)a[r][b].qs);
            __m256 dy = _mm256_broadcast_ss(&da[r][b]);
            QA_UNROLL
            for (int i = 0; i < RW; i++) {
#if defined(QA_VNNI)
                __m256i dot = qa_dot_u8s8(corr[r][b], aq[i], y);
#else
                __m256i dot = qa_dot_u8s8(_mm256_setzero_si256(), aq[i], _mm256_sign_epi8(y, q[i]));
#endif
                acc[i][r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(dot), _mm256_mul_ps(dw[i], dy), acc[i][r]);
            }
        }
    }
    QA_UNROLL
    for (int i = 0; i < RW; i++)
        QA_UNROLL
        for (int r = 0; r < RA; r++) res[r * RW + i] = qa_hsum_ps(acc[i][r]);
}

#endif

#if defined(QA_ZMM)
/* ==== AVX-512 VNNI: two blocks per zmm register ====
 * One vpdpbusd on zmm does 64 int8 products: blocks b and b + 1 of a row
 * sit in the low and high halves, with the per-block scales broadcast to the
 * matching halves. 32 registers hold a 4 x 4 tile of accumulators. */

QA_INLINE __m512i qa_pair_i(__m256i lo, __m256i hi) {
    return _mm512_inserti64x4(_mm512_castsi256_si512(lo), hi, 1);
}

QA_INLINE __m512 qa_pair_ps(float lo, float hi) {
    return _mm512_insertf32x8(_mm512_set1_ps(lo), _mm256_set1_ps(hi), 1);
}

QA_INLINE void qa_tile_b32_zmm(uint32_t type, int RW, int RA, int64_t nb, const uint8_t *w, size_t w_stride,
                               const block_q8_0 *const *a, const float (*da)[QA_CHUNK],
                               const __m256i (*corr)[QA_CHUNK], float *res) {
    __m512 acc[4][QA_ROWS];
    QA_UNROLL
    for (int i = 0; i < RW; i++)
        QA_UNROLL
        for (int r = 0; r < RA; r++) acc[i][r] = _mm512_setzero_ps();
    const size_t bs = qa_bsize_b32(type);
    const __m512i off = _mm512_set1_epi8((char)0x80);
    int64_t b = 0;
    for (; b + 2 <= nb; b += 2) {
        __m512i aq[4];
        __m512 dw[4];
        QA_UNROLL
        for (int i = 0; i < RW; i++) {
            float d0, d1;
            const uint8_t *wb = w + (size_t)i * w_stride + (size_t)b * bs;
            __m256i q0 = qa_decode_b32(type, wb, &d0), q1 = qa_decode_b32(type, wb + bs, &d1);
            if (RA == 1)   /* see QA_PF: once per block pair, about once per line */
                _mm_prefetch((const char *)wb + QA_PF, _MM_HINT_T0);
            aq[i] = _mm512_xor_si512(qa_pair_i(q0, q1), off);      /* w + 128 as u8 */
            dw[i] = qa_pair_ps(d0, d1);
        }
        QA_UNROLL
        for (int r = 0; r < RA; r++) {
            __m512i y = qa_pair_i(_mm256_loadu_si256((const __m256i *)a[r][b].qs),
                                  _mm256_loadu_si256((const __m256i *)a[r][b + 1].qs));
            __m512 dy = qa_pair_ps(da[r][b], da[r][b + 1]);
            __m512i c = qa_pair_i(corr[r][b], corr[r][b + 1]);
            QA_UNROLL
            for (int i = 0; i < RW; i++) {
                __m512i dot = _mm512_dpbusd_epi32(c, aq[i], y);
                acc[i][r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(dot), _mm512_mul_ps(dw[i], dy), acc[i][r]);
            }
        }
    }
    if (b < nb) {   /* an odd last block: the low halves only */
        QA_UNROLL
        for (int i = 0; i < RW; i++) {
            float d;
            __m256i q = qa_decode_b32(type, w + (size_t)i * w_stride + (size_t)b * bs, &d);
            __m256i aqi = _mm256_xor_si256(q, _mm256_set1_epi8((char)0x80));
            QA_UNROLL
            for (int r = 0; r < RA; r++) {
                __m256i y = _mm256_loadu_si256((const __m256i *)a[r][b].qs);
                __m256i dot = _mm256_dpbusd_epi32(corr[r][b], aqi, y);
                __m256 v = _mm256_mul_ps(_mm256_cvtepi32_ps(dot), _mm256_set1_ps(d * da[r][b]));
                acc[i][r] = _mm512_add_ps(acc[i][r], _mm512_insertf32x8(_mm512_setzero_ps(), v, 0));
            }
        }
    }
    QA_UNROLL
    for (int i = 0; i < RW; i++)
        QA_UNROLL
        for (int r = 0; r < RA; r++) res[r * RW + i] = _mm512_reduce_add_ps(acc[i][r]);
}

/* Every shape up to 4 x 4, instantiated so the loops fully unroll. */
#define QA_TILE_B32(T)                                                                             \
    static void qa_tile_b32_##T(int RW, int RA, int64_t nb, const uint8_t *w, size_t ws,           \
                                const block_q8_0 *const *a, const float (*da)[QA_CHUNK],          \
                                const __m256i (*corr)[QA_CHUNK], float *res) {                    \
        switch (RW * 8 + RA) {                                                                     \
        case 9: qa_tile_b32_zmm(GGML_TYPE_##T, 1, 1, nb, w, ws, a, da, corr, res); break;         \
        case 10: qa_tile_b32_zmm(GGML_TYPE_##T, 1, 2, nb, w, ws, a, da, corr, res); break;        \
        case 11: qa_tile_b32_zmm(GGML_TYPE_##T, 1, 3, nb, w, ws, a, da, corr, res); break;        \
        case 12: qa_tile_b32_zmm(GGML_TYPE_##T, 1, 4, nb, w, ws, a, da, corr, res); break;        \
        case 17: qa_tile_b32_zmm(GGML_TYPE_##T, 2, 1, nb, w, ws, a, da, corr, res); break;        \
        case 18: qa_tile_b32_zmm(GGML_TYPE_##T, 2, 2, nb, w, ws, a, da, corr, res); break;        \
        case 19: qa_tile_b32_zmm(GGML_TYPE_##T, 2, 3, nb, w, ws, a, da, corr, res); break;        \
        case 20: qa_tile_b32_zmm(GGML_TYPE_##T, 2, 4, nb, w, ws, a, da, corr, res); break;        \
        case 25: qa_tile_b32_zmm(GGML_TYPE_##T, 3, 1, nb, w, ws, a, da, corr, res); break;        \
        case 26: qa_tile_b32_zmm(GGML_TYPE_##T, 3, 2, nb, w, ws, a, da, corr, res); break;        \
        case 27: qa_tile_b32_zmm(GGML_TYPE_##T, 3, 3, nb, w, ws, a, da, corr, res); break;        \
        case 28: qa_tile_b32_zmm(GGML_TYPE_##T, 3, 4, nb, w, ws, a, da, corr, res); break;        \
        case 33: qa_tile_b32_zmm(GGML_TYPE_##T, 4, 1, nb, w, ws, a, da, corr, res); break;        \
        case 34: qa_tile_b32_zmm(GGML_TYPE_##T, 4, 2, nb, w, ws, a, da, corr, res); break;        \
        case 35: qa_tile_b32_zmm(GGML_TYPE_##T, 4, 3, nb, w, ws, a, da, corr, res); break;        \
        default: qa_tile_b32_zmm(GGML_TYPE_##T, 4, 4, nb, w, ws, a, da, corr, res); break;        \
        }                                                                                          \
    }
#else
/* Instantiate the tile for the shapes qa_mul_mat_b32 asks for (decode: 1 x 1;
 * prefill: 1-2 weight rows x 1-4 activation rows) so the loops fully unroll. */
#define QA_TILE_B32(T)                                                                             \
    static void qa_tile_b32_##T(int RW, int RA, int64_t nb, const uint8_t *w, size_t ws,           \
                                const block_q8_0 *const *a, const float (*da)[QA_CHUNK],          \
                                const __m256i (*corr)[QA_CHUNK], float *res) {                    \
        switch (RW * 8 + RA) {                                                                     \
        case 9: qa_tile_b32(GGML_TYPE_##T, 1, 1, nb, w, ws, a, da, corr, res); break;                    \
        case 10: qa_tile_b32(GGML_TYPE_##T, 1, 2, nb, w, ws, a, da, corr, res); break;                   \
        case 11: qa_tile_b32(GGML_TYPE_##T, 1, 3, nb, w, ws, a, da, corr, res); break;                   \
        case 12: qa_tile_b32(GGML_TYPE_##T, 1, 4, nb, w, ws, a, da, corr, res); break;                   \
        case 18: qa_tile_b32(GGML_TYPE_##T, 2, 2, nb, w, ws, a, da, corr, res); break;                   \
        case 19: qa_tile_b32(GGML_TYPE_##T, 2, 3, nb, w, ws, a, da, corr, res); break;                   \
        default: qa_tile_b32(GGML_TYPE_##T, 2, 4, nb, w, ws, a, da, corr, res); break;                   \
        }                                                                                          \
    }
#endif
QA_TILE_B32(Q8_0)
QA_TILE_B32(Q4_0)
QA_TILE_B32(Q5_0)

typedef void (*qa_b32_fn)(int, int, int64_t, const uint8_t *, size_t, const block_q8_0 *const *,
                          const float (*)[QA_CHUNK], const __m256i (*)[QA_CHUNK], float *);

static void qa_mul_mat_b32(uint32_t type, int64_t n, const void *w, size_t w_stride, int nw,
                           const void *a, size_t a_stride, int na, float *out, size_t out_stride) {
#if defined(QA_ZMM)
    if (type == GGML_TYPE_Q8_0 && nw >= 16 && w_stride <= (size_t)INT32_MAX / 16) {
        int nw16 = nw / 16 * 16;
        if (na >= QA_R16_MIN) quant_avx512_mul_r16(GGML_TYPE_Q8_0, n, (const uint8_t *)w, w_stride, nw16, a, a_stride, na, out, out_stride, 0);
        else quant_avx512_mul_r16_few(n, (const uint8_t *)w, w_stride, nw16, a, a_stride, na, out, out_stride);
        if (nw16 == nw) return;
        w = (const uint8_t *)w + (size_t)nw16 * w_stride;   /* the last rows: the pair tile */
        out += nw16;
        nw -= nw16;
    }
#endif
    qa_b32_fn fn = type == GGML_TYPE_Q8_0 ? qa_tile_b32_Q8_0
                 : type == GGML_TYPE_Q4_0 ? qa_tile_b32_Q4_0 : qa_tile_b32_Q5_0;
    const size_t bs = qa_bsize_b32(type);
    const int64_t nb = n / 32;
    float da[QA_ROWS][QA_CHUNK];
#if defined(QA_VNNI)
    __m256i corr[QA_ROWS][QA_CHUNK];
#else
    __m256i corr[1][QA_CHUNK];  /* unused without VNNI */
#endif
    float res[4 * QA_ROWS];
    for (int j0 = 0; j0 < na; j0 += QA_ROWS) {
        int RA = na - j0 < QA_ROWS ? na - j0 : QA_ROWS;
        for (int64_t k0 = 0; k0 < nb || k0 == 0; k0 += QA_CHUNK) {
            int64_t kn = nb - k0 < QA_CHUNK ? nb - k0 : QA_CHUNK;
            const block_q8_0 *ar[QA_ROWS];
            QA_UNROLL
            for (int r = 0; r < RA; r++) {
                ar[r] = (const block_q8_0 *)((const char *)a + (size_t)(j0 + r) * a_stride) + k0;
                for (int64_t b = 0; b < kn; b++) {
                    da[r][b] = qa_h2f(ar[r][b].d);
#if defined(QA_VNNI)
                    __m256i y = _mm256_loadu_si256((const __m256i *)ar[r][b].qs);
                    corr[r][b] = _mm256_sub_epi32(_mm256_setzero_si256(),
                                                  qa_dot_u8s8(_mm256_setzero_si256(), _mm256_set1_epi8((char)0x80), y));
#endif
                }
            }
            /* one activation row (decode): one weight row at a time, a
             * single stream (QA_PF_ROW); AVX-512's 32 registers hold 4 x 4
             * tiles (its decode rows are packed: this is only their tail) */
#if defined(QA_ZMM)
            const int rw_max = 4;
#else
            const int rw_max = RA == 1 ? 1 : 2;
#endif
            for (int i0 = 0; i0 < nw; i0 += rw_max) {
                int RW = nw - i0 < rw_max ? nw - i0 : rw_max;
                const uint8_t *wr = (const uint8_t *)w + (size_t)i0 * w_stride + (size_t)k0 * bs;
                fn(RW, RA, kn, wr, w_stride, ar, (const float (*)[QA_CHUNK])da, (const __m256i (*)[QA_CHUNK])corr, res);
                QA_UNROLL
                for (int r = 0; r < RA; r++)
                    QA_UNROLL
                    for (int i = 0; i < RW; i++) {
                        float *o = &out[(size_t)(j0 + r) * out_stride + (size_t)(i0 + i)];
                        *o = (k0 == 0 ? 0.0f : *o) + res[r * RW + i];
                    }
            }
            if (kn <= 0) break;
        }
    }
}

/* ==== Q4_1 / Q5_1 x Q8_1 ====
 * The levels are unsigned (0..15, 0..31), which is what maddubs / dpbusd
 * take as their first operand: no sign trick and no offset correction.
 * Weight rows lie across the lanes, 16 (avx512, quant_avx512_b32u.h) or 8
 * (avx2, avxvnni: quant_avx2_b32u.h), each lane replaying the reference's
 * per-block arithmetic bit for bit, the levels decoded once per block for
 * several activation rows: a verification step of 2-8 rows costs 1.1-2.2x
 * a one-row step (the one- and two-row tile before it: 1.5-4.3x). */

/* A pass's activation scales and sums as floats, d and s side by side
 * (ds[r * row + 2 b], ds[r * row + 2 b + 1]), converted once for every
 * weight row of the pass: one conversion of four halves per block. Both
 * walks below start their passes with it. */
static void qa_b32u_scales(const uint8_t *a0, size_t a_stride, int RA, int64_t b0, int64_t nb, float *ds, size_t row) {
    for (int r = 0; r < RA; r++) {
        const block_q8_1 *y = (const block_q8_1 *)(a0 + (size_t)r * a_stride) + b0;
        for (int64_t b = 0; b < nb; b++) {
            uint32_t v;
            memcpy(&v, &y[b], 4);
            _mm_storel_pi((__m64 *)&ds[(size_t)r * row + 2 * (size_t)b], _mm_cvtph_ps(_mm_cvtsi32_si128((int)v)));
        }
    }
}

#if defined(QA_ZMM)
#include "quant_avx512_b32u.h"
#else
#include "quant_avx2_b32u.h"
#endif

/* 0 where a row is too long for the gathers' 32-bit offsets: the reference */
static int qa_mul_mat_b32u(uint32_t type, int64_t n, const void *w, size_t w_stride, int nw,
                           const void *a, size_t a_stride, int na, float *out, size_t out_stride) {
#if defined(QA_ZMM)
    if (w_stride > (size_t)INT32_MAX / 16) return 0;
    qa_mul_mat_u16(type, n, (const uint8_t *)w, w_stride, nw, (const uint8_t *)a, a_stride, na, out, out_stride);
#else
    if (w_stride > (size_t)INT32_MAX / 8) return 0;
    qa_mul_mat_u8(type, n, (const uint8_t *)w, w_stride, nw, (const uint8_t *)a, a_stride, na, out, out_stride);
#endif
    return 1;
}

/* ==== K-quants (Q4_K, Q5_K, Q6_K) x Q8_K ==== */
/* Integer accumulators per activation row: with VNNI the multiply-add into an
 * accumulator is one instruction with several cycles of latency, so a row's
 * eight sub-blocks are spread over NACC independent chains. */
#define QA_NACC(RA) ((RA) == 1 ? 4 : 2)

/* Q4_K/Q5_K 6-bit scales and mins of the 8 sub-blocks, unpacked with 32-bit
 * word operations: sc in bytes 0-7 of *sc, mins in bytes 0-7 of *mn. */
QA_INLINE void qa_unpack_k4_scales(const uint8_t *q, uint64_t *sc, uint64_t *mn) {
    uint32_t a, b, c;
    memcpy(&a, q, 4); memcpy(&b, q + 4, 4); memcpy(&c, q + 8, 4);
    uint32_t sc_lo = a & 0x3f3f3f3fu, mn_lo = b & 0x3f3f3f3fu;
    /* top two bits of bytes 0-3 / 4-7 become bits 4-5 of scales / mins 4-7 */
    uint32_t sc_hi = (c & 0x0f0f0f0fu) | ((a >> 2) & 0x30303030u);
    uint32_t mn_hi = ((c >> 4) & 0x0f0f0f0fu) | ((b >> 2) & 0x30303030u);
    *sc = (uint64_t)sc_lo | ((uint64_t)sc_hi << 32);
    *mn = (uint64_t)mn_lo | ((uint64_t)mn_hi << 32);
}

/* Broadcast int16 lane k of a 128-bit vector to all 16 lanes of a ymm. */
QA_INLINE __m256i qa_bcast_w16(__m128i v, int k) {
    __m128i b = _mm_shuffle_epi8(v, _mm_set1_epi16((short)((2 * k) | ((2 * k + 1) << 8))));
    return _mm256_broadcastsi128_si256(b);
}

/* One super-block of one weight row x RA activation rows, accumulated into acc. */
QA_INLINE void qa_kblock(uint32_t type, int RA, const uint8_t *wb, const block_q8_K *const *a, int64_t b,
                         __m256 *acc) {
    enum { NA = 4 };
    __m256i isum[NA][QA_ROWS];
    const int nacc = QA_NACC(RA);
    QA_UNROLL
    for (int t = 0; t < 4; t++)
        QA_UNROLL
        for (int r = 0; r < RA; r++) isum[t][r] = _mm256_setzero_si256();
    const __m256i m4 = _mm256_set1_epi8(0xF);
    if (type == GGML_TYPE_Q6_K) {
        const block_q6_K *x = (const block_q6_K *)wb;
        const float d = qa_h2f(x->d);
        const __m256i m3 = _mm256_set1_epi8(3);
        const __m128i sc8 = _mm_loadu_si128((const __m128i *)x->scales);
        QA_UNROLL
        for (int h = 0; h < 2; h++) {
            __m256i ql0 = _mm256_loadu_si256((const __m256i *)(x->ql + 64 * h));
            __m256i ql1 = _mm256_loadu_si256((const __m256i *)(x->ql + 64 * h + 32));
            __m256i qh = _mm256_loadu_si256((const __m256i *)(x->qh + 32 * h));
            __m256i q[4];
            q[0] = _mm256_or_si256(_mm256_and_si256(ql0, m4), _mm256_slli_epi16(_mm256_and_si256(qh, m3), 4));
            q[1] = _mm256_or_si256(_mm256_and_si256(ql1, m4),
                                   _mm256_slli_epi16(_mm256_and_si256(_mm256_srli_epi16(qh, 2), m3), 4));
            q[2] = _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16(ql0, 4), m4),
                                   _mm256_slli_epi16(_mm256_and_si256(_mm256_srli_epi16(qh, 4), m3), 4));
            q[3] = _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16(ql1, 4), m4),
                                   _mm256_slli_epi16(_mm256_and_si256(_mm256_srli_epi16(qh, 6), m3), 4));
            QA_UNROLL
            for (int g = 0; g < 4; g++) {
                const int k = 4 * h + g;
                /* int16 lanes 0-7 get scale 2k (first 16 values), lanes 8-15 scale 2k+1 */
                __m128i pair = _mm_shuffle_epi8(sc8, _mm_setr_epi8(2 * k, -1, 2 * k, -1, 2 * k, -1, 2 * k, -1,
                                                                  2 * k, -1, 2 * k, -1, 2 * k, -1, 2 * k, -1));
                __m128i pair2 = _mm_shuffle_epi8(sc8, _mm_setr_epi8(2 * k + 1, -1, 2 * k + 1, -1, 2 * k + 1, -1,
                                                                   2 * k + 1, -1, 2 * k + 1, -1, 2 * k + 1, -1,
                                                                   2 * k + 1, -1, 2 * k + 1, -1));
                /* sign-extend the int8 scales: shift left 8 then arithmetic right 8 */
                __m256i sc = _mm256_srai_epi16(_mm256_slli_epi16(_mm256_set_m128i(pair2, pair), 8), 8);
                QA_UNROLL
                for (int r = 0; r < RA; r++) {
                    __m256i y = _mm256_loadu_si256((const __m256i *)(a[r][b].qs + 32 * k));
                    isum[k % nacc][r] = qa_madd_acc(isum[k % nacc][r], _mm256_maddubs_epi16(q[g], y), sc);
                }
            }
        }
        /* stored levels are value + 32: subtract 32 * sum_j sc_j * bsum_j */
        __m256i sc16 = _mm256_cvtepi8_epi16(sc8);
        QA_UNROLL
        for (int r = 0; r < RA; r++) {
            __m256i bs = _mm256_loadu_si256((const __m256i *)a[r][b].bsums);
            __m256i s = _mm256_sub_epi32(isum[0][r], _mm256_slli_epi32(_mm256_madd_epi16(bs, sc16), 5));
            QA_UNROLL
            for (int t = 1; t < 4; t++)
                if (t < nacc) s = _mm256_add_epi32(s, isum[t][r]);
            acc[r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(s), _mm256_set1_ps(d * a[r][b].d), acc[r]);
        }
        return;
    }
    /* Q4_K / Q5_K */
    const block_q4_K *x4 = (const block_q4_K *)wb;
    const block_q5_K *x5 = (const block_q5_K *)wb;
    const int five = type == GGML_TYPE_Q5_K;
    const uint8_t *qs = five ? x5->qs : x4->qs;
    const float d = qa_h2f(five ? x5->d : x4->d), dmin = qa_h2f(five ? x5->dmin : x4->dmin);
    uint64_t sc64, mn64;
    qa_unpack_k4_scales(five ? x5->scales : x4->scales, &sc64, &mn64);
    const __m128i sc16 = _mm_cvtepu8_epi16(_mm_cvtsi64_si128((long long)sc64));
    __m128i mn8 = _mm_cvtsi64_si128((long long)mn64);
    /* each min covers two bsums (16 values each) */
    const __m256i m16 = _mm256_cvtepu8_epi16(_mm_unpacklo_epi8(mn8, mn8));
    __m256i qh = _mm256_setzero_si256();
    if (five) qh = _mm256_loadu_si256((const __m256i *)x5->qh);
    const __m256i one = _mm256_set1_epi8(1);
    QA_UNROLL
    for (int c = 0; c < 4; c++) {
        __m256i raw = _mm256_loadu_si256((const __m256i *)(qs + 32 * c));
        __m256i q[2];
        q[0] = _mm256_and_si256(raw, m4);
        q[1] = _mm256_and_si256(_mm256_srli_epi16(raw, 4), m4);
        if (five) {
            q[0] = _mm256_or_si256(q[0], _mm256_slli_epi16(_mm256_and_si256(qh, one), 4));
            q[1] = _mm256_or_si256(q[1], _mm256_slli_epi16(_mm256_and_si256(_mm256_srli_epi16(qh, 1), one), 4));
            qh = _mm256_srli_epi16(qh, 2);
        }
        QA_UNROLL
        for (int s = 0; s < 2; s++) {
            const int k = 2 * c + s;
            __m256i scv = qa_bcast_w16(sc16, k);
            QA_UNROLL
            for (int r = 0; r < RA; r++) {
                __m256i y = _mm256_loadu_si256((const __m256i *)(a[r][b].qs + 32 * k));
                isum[k % nacc][r] = qa_madd_acc(isum[k % nacc][r], _mm256_maddubs_epi16(q[s], y), scv);
            }
        }
    }
    QA_UNROLL
    for (int r = 0; r < RA; r++) {
        __m256i bs = _mm256_loadu_si256((const __m256i *)a[r][b].bsums);
        __m256 mins = _mm256_cvtepi32_ps(_mm256_madd_epi16(bs, m16));
        __m256i s = isum[0][r];
        QA_UNROLL
        for (int t = 1; t < 4; t++)
            if (t < nacc) s = _mm256_add_epi32(s, isum[t][r]);
        acc[r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(s), _mm256_set1_ps(d * a[r][b].d), acc[r]);
        acc[r] = _mm256_fnmadd_ps(mins, _mm256_set1_ps(dmin * a[r][b].d), acc[r]);
    }
}

QA_INLINE void qa_tile_k(uint32_t type, int RA, int64_t nb, const uint8_t *w, size_t bsz,
                         const block_q8_K *const *a, float *res) {
    __m256 acc[QA_ROWS];
    QA_UNROLL
    for (int r = 0; r < RA; r++) acc[r] = _mm256_setzero_ps();
    for (int64_t b = 0; b < nb; b++) {
        if (RA == 1)   /* decode: see QA_PF_ROW */
            for (size_t l = 0; l < bsz; l += 64)
                _mm_prefetch((const char *)w + (size_t)b * bsz + l + QA_PF_ROW, _MM_HINT_T0);
        qa_kblock(type, RA, w + (size_t)b * bsz, a, b, acc);
    }
    QA_UNROLL
    for (int r = 0; r < RA; r++) res[r] = qa_hsum_ps(acc[r]);
}

#define QA_TILE_K(T, BT)                                                                            \
    static void qa_tile_k_##T(int RA, int64_t nb, const uint8_t *w, const block_q8_K *const *a,     \
                              float *res) {                                                        \
        const size_t bs = sizeof(BT);                                                               \
        switch (RA) {                                                                              \
        case 1: qa_tile_k(GGML_TYPE_##T, 1, nb, w, bs, a, res); break;                             \
        case 2: qa_tile_k(GGML_TYPE_##T, 2, nb, w, bs, a, res); break;                             \
        case 3: qa_tile_k(GGML_TYPE_##T, 3, nb, w, bs, a, res); break;                             \
        default: qa_tile_k(GGML_TYPE_##T, 4, nb, w, bs, a, res); break;                            \
        }                                                                                          \
    }
QA_TILE_K(Q4_K, block_q4_K)
QA_TILE_K(Q5_K, block_q5_K)
QA_TILE_K(Q6_K, block_q6_K)

static void qa_mul_mat_k(uint32_t type, int64_t n, const void *w, size_t w_stride, int nw,
                         const void *a, size_t a_stride, int na, float *out, size_t out_stride) {
    void (*fn)(int, int64_t, const uint8_t *, const block_q8_K *const *, float *) =
        type == GGML_TYPE_Q4_K ? qa_tile_k_Q4_K : type == GGML_TYPE_Q5_K ? qa_tile_k_Q5_K : qa_tile_k_Q6_K;
    const int64_t nb = n / QK_K;
    float res[QA_ROWS];
    for (int j0 = 0; j0 < na; j0 += QA_ROWS) {
        int RA = na - j0 < QA_ROWS ? na - j0 : QA_ROWS;
        const block_q8_K *ar[QA_ROWS];
        QA_UNROLL
        for (int r = 0; r < RA; r++) ar[r] = (const block_q8_K *)((const char *)a + (size_t)(j0 + r) * a_stride);
        for (int i = 0; i < nw; i++) {
            fn(RA, nb, (const uint8_t *)w + (size_t)i * w_stride, ar, res);
            QA_UNROLL
            for (int r = 0; r < RA; r++) out[(size_t)(j0 + r) * out_stride + (size_t)i] = res[r];
        }
    }
}

/* ==== Float formats (F32, F16, BF16) ==== */
/* Activation rows are converted to f32 once per K-chunk (QA_FCHUNK values)
 * into a stack buffer and reused by every weight row; weights are converted
 * as they stream. */
#define QA_FCHUNK 512
/* Activation rows per pass: 4 weight rows x 3 fill AVX2's 16 registers
 * (12 accumulators, 4 weights); with AVX-512's 32, 4 x 6 (24 and 4), each
 * converted weight vector used twice as often. Each output's sums are the
 * same whatever the tile: the same bits. Qwen3-0.6B F16 pp512, 2 threads,
 * Zen 4, five alternated pairs: 148-169 -> 153-179 t/s (4 of 5 higher,
 * mean +6%). */
#if defined(QA_ZMM)
#define QA_FROWS 6
#else
#define QA_FROWS 3
#endif

QA_INLINE __m256 qa_load8(uint32_t type, const void *p, int64_t k) {
    if (type == GGML_TYPE_F32) return _mm256_loadu_ps((const float *)p + k);
    __m128i h = _mm_loadu_si128((const __m128i *)((const uint16_t *)p + k));
    if (type == GGML_TYPE_F16) return _mm256_cvtph_ps(h);
    return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16));
}

QA_INLINE float qa_load1(uint32_t type, const void *p, int64_t k) {
    if (type == GGML_TYPE_F32) return ((const float *)p)[k];
    if (type == GGML_TYPE_F16) return fp16_to_f32(((const uint16_t *)p)[k]);
    return bf16_to_f32(((const uint16_t *)p)[k]);
}

/* RW weight rows (type) x RA f32 activation rows over n values; res[r * RW + i]. */
QA_INLINE void qa_tile_float(uint32_t type, int RW, int RA, int64_t n, const uint8_t *w, size_t ws,
                             const float *const *af, float *res) {
    __m256 acc[4][QA_FROWS];
    QA_UNROLL
    for (int i = 0; i < RW; i++)
        QA_UNROLL
        for (int r = 0; r < RA; r++) acc[i][r] = _mm256_setzero_ps();
    int64_t k = 0;
    for (; k + 8 <= n; k += 8) {
        __m256 x[4];
        QA_UNROLL
        for (int i = 0; i < RW; i++) x[i] = qa_load8(type, w + (size_t)i * ws, k);
        QA_UNROLL
        for (int r = 0; r < RA; r++) {
            __m256 y = _mm256_loadu_ps(af[r] + k);
            QA_UNROLL
            for (int i = 0; i < RW; i++) acc[i][r] = _mm256_fmadd_ps(x[i], y, acc[i][r]);
        }
    }
    for (int i = 0; i < RW; i++)
        for (int r = 0; r < RA; r++) {
            float s = qa_hsum_ps(acc[i][r]);
            for (int64_t t = k; t < n; t++) s += qa_load1(type, w + (size_t)i * ws, t) * af[r][t];
            res[r * RW + i] = s;
        }
}

#define QA_TF_CASE(T, RW, RA) \
    case RW * 8 + RA: qa_tile_float(GGML_TYPE_##T, RW, RA, n, w, ws, af, res); break;
#if QA_FROWS > 3
#define QA_TF_RW(T, RW) QA_TF_CASE(T, RW, 1) QA_TF_CASE(T, RW, 2) QA_TF_CASE(T, RW, 3) \
    QA_TF_CASE(T, RW, 4) QA_TF_CASE(T, RW, 5) QA_TF_CASE(T, RW, 6)
#else
#define QA_TF_RW(T, RW) QA_TF_CASE(T, RW, 1) QA_TF_CASE(T, RW, 2) QA_TF_CASE(T, RW, 3)
#endif
/* every shape up to 4 x QA_FROWS, instantiated so the loops fully unroll */
#define QA_TILE_F(T)                                                                               \
    static void qa_tile_f_##T(int RW, int RA, int64_t n, const uint8_t *w, size_t ws,              \
                              const float *const *af, float *res) {                                \
        switch (RW * 8 + RA) {                                                                     \
            QA_TF_RW(T, 1) QA_TF_RW(T, 2) QA_TF_RW(T, 3) QA_TF_RW(T, 4)                           \
        default: break;   /* no caller asks for more */                                            \
        }                                                                                          \
    }
QA_TILE_F(F32)
QA_TILE_F(F16)
QA_TILE_F(BF16)

/* Decode (one activation row, already f32): one weight row at a time, whole,
 * a single sequential stream per thread; each row's chunks are summed in
 * the same order as below, so the results are the same bits. Four rows side
 * by side, chunk by chunk (the loop below) made eight streams per thread
 * that the hardware prefetcher followed badly: Qwen3-0.6B F16 tg32, 2
 * threads on a Zen 4, alternated runs: 12.7-13.9 t/s; two rows at a time,
 * whole, 15.2-15.8; one row 23-26 (prefetching 2-8 KiB ahead: no better). */
static void qa_mul_mat_float_row(void (*fn)(int, int, int64_t, const uint8_t *, size_t, const float *const *, float *),
                                 size_t esz, int64_t n, const void *w, size_t w_stride, int nw, const void *a,
                                 float *out) {
    for (int i = 0; i < nw; i++) {
        const uint8_t *wr = (const uint8_t *)w + (size_t)i * w_stride;
        for (int64_t k0 = 0; k0 < n || k0 == 0; k0 += QA_FCHUNK) {
            int64_t kn = n - k0 < QA_FCHUNK ? n - k0 : QA_FCHUNK;
            const float *af[1] = { (const float *)a + k0 };
            float res;
            fn(1, 1, kn, wr + (size_t)k0 * esz, w_stride, af, &res);
            out[i] = (k0 == 0 ? 0.0f : out[i]) + res;
            if (kn <= 0) break;
        }
    }
}

static void qa_mul_mat_float(uint32_t type, int64_t n, const void *w, size_t w_stride, int nw,
                             const void *a, size_t a_stride, int na, float *out, size_t out_stride) {
    void (*fn)(int, int, int64_t, const uint8_t *, size_t, const float *const *, float *) =
        type == GGML_TYPE_F32 ? qa_tile_f_F32 : type == GGML_TYPE_F16 ? qa_tile_f_F16 : qa_tile_f_BF16;
    const size_t esz = type == GGML_TYPE_F32 ? 4 : 2;
    float res[4 * QA_FROWS];
    if (na == 1) {   /* decode */
        qa_mul_mat_float_row(fn, esz, n, w, w_stride, nw, a, out);
        return;
    }
    for (int j0 = 0; j0 < na; j0 += QA_FROWS) {
        int RA = na - j0 < QA_FROWS ? na - j0 : QA_FROWS;
        for (int64_t k0 = 0; k0 < n || k0 == 0; k0 += QA_FCHUNK) {
            int64_t kn = n - k0 < QA_FCHUNK ? n - k0 : QA_FCHUNK;
            const float *af[QA_FROWS];
            /* activations are f32 for every float weight type */
            for (int r = 0; r < RA; r++)
                af[r] = (const float *)((const uint8_t *)a + (size_t)(j0 + r) * a_stride) + k0;
            const int rw_max = 4;
            for (int i0 = 0; i0 < nw; i0 += rw_max) {
                int RW = nw - i0 < rw_max ? nw - i0 : rw_max;
                fn(RW, RA, kn, (const uint8_t *)w + (size_t)i0 * w_stride + (size_t)k0 * esz, w_stride, af, res);
                for (int r = 0; r < RA; r++)
                    for (int i = 0; i < RW; i++) {
                        float *o = &out[(size_t)(j0 + r) * out_stride + (size_t)(i0 + i)];
                        *o = (k0 == 0 ? 0.0f : *o) + res[r * RW + i];
                    }
            }
            if (kn <= 0) break;
        }
    }
}

static int qa_mul_mat_tile(uint32_t wtype, int64_t n, const void *w, size_t w_stride, int nw,
                            const void *a, size_t a_stride, int na, float *out, size_t out_stride) {
    switch (wtype) {
    case GGML_TYPE_Q4_0: case GGML_TYPE_Q5_0: case GGML_TYPE_Q8_0:
        qa_mul_mat_b32(wtype, n, w, w_stride, nw, a, a_stride, na, out, out_stride);
        return 1;
    case GGML_TYPE_Q4_1: case GGML_TYPE_Q5_1:
        return qa_mul_mat_b32u(wtype, n, w, w_stride, nw, a, a_stride, na, out, out_stride);
    case GGML_TYPE_Q4_K: case GGML_TYPE_Q5_K: case GGML_TYPE_Q6_K:
        qa_mul_mat_k(wtype, n, w, w_stride, nw, a, a_stride, na, out, out_stride);
        return 1;
    case GGML_TYPE_F32: case GGML_TYPE_F16: case GGML_TYPE_BF16:
        qa_mul_mat_float(wtype, n, w, w_stride, nw, a, a_stride, na, out, out_stride);
        return 1;
    default:
        return 0;
    }
}

/* ==== Activation quantization ==== */
QA_INLINE float qa_hmax_ps(__m256 v) {
    __m128 m = _mm_max_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    m = _mm_max_ps(m, _mm_movehl_ps(m, m));
    m = _mm_max_ss(m, _mm_movehdup_ps(m));
    return _mm_cvtss_f32(m);
}

/* roundf (ties away from zero), exactly: truncate, then step away if |frac| >= 0.5 */
QA_INLINE __m256i qa_round_away(__m256 v) {
    __m256 t = _mm256_round_ps(v, _MM_FROUND_TO_ZERO | _MM_FROUND_NO_EXC);
    const __m256 sgn = _mm256_set1_ps(-0.0f);
    __m256 frac = _mm256_andnot_ps(sgn, _mm256_sub_ps(v, t));
    __m256 step = _mm256_or_ps(_mm256_and_ps(v, sgn), _mm256_set1_ps(1.0f));
    __m256 ge = _mm256_cmp_ps(frac, _mm256_set1_ps(0.5f), _CMP_GE_OQ);
    return _mm256_cvttps_epi32(_mm256_add_ps(t, _mm256_and_ps(ge, step)));
}

/* four vectors of 8 int32 (values within int8) -> 32 int8 in order */
QA_INLINE __m256i qa_pack_i8(__m256i a, __m256i b, __m256i c, __m256i d) {
    __m256i ab = _mm256_packs_epi32(a, b), cd = _mm256_packs_epi32(c, d);
    __m256i x = _mm256_packs_epi16(ab, cd);
    /* packs work per 128-bit lane: restore the element order */
    return _mm256_permutevar8x32_epi32(x, _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7));
}

/* One block of 32 activations as Q8_0 levels: the scale into *dh (its f32
 * value returned, unrounded), the levels into qs and returned packed (Q8_0
 * and Q8_1 share it; Q8_1 also sums the levels). */
QA_INLINE __m256i qa_act_block_q8(const float *x, fp16_t *dh, int8_t *qs, float *d_out) {
    const __m256 sgn = _mm256_set1_ps(-0.0f);
    __m256 v[4], m = _mm256_setzero_ps();
    for (int k = 0; k < 4; k++) {
        v[k] = _mm256_loadu_ps(x + 8 * k);
        m = _mm256_max_ps(m, _mm256_andnot_ps(sgn, v[k]));
    }
    float amax = qa_hmax_ps(m);
    float d = amax / 127.0f;
    float id = d != 0.0f ? 1.0f / d : 0.0f;
    *dh = f32_to_fp16(d);
    *d_out = d;
    __m256 idv = _mm256_set1_ps(id);
    __m256i q[4];
    for (int k = 0; k < 4; k++) q[k] = qa_round_away(_mm256_mul_ps(v[k], idv));
    __m256i p = qa_pack_i8(q[0], q[1], q[2], q[3]);
    _mm256_storeu_si256((__m256i *)qs, p);
    return p;
}

static void qa_act_q8_0(const float *x, block_q8_0 *y, int64_t nb) {
    float d;
    for (int64_t i = 0; i < nb; i++, x += 32) qa_act_block_q8(x, &y[i].d, y[i].qs, &d);
}

/* Q8_1: Q8_0's levels and s = fp16(d * sum(q)), d unrounded (the reference's) */
static void qa_act_q8_1(const float *x, block_q8_1 *y, int64_t nb) {
    for (int64_t i = 0; i < nb; i++, x += 32) {
        float d;
        __m256i p = qa_act_block_q8(x, &y[i].d, y[i].qs, &d);
        /* the sum of the stored bytes */
        __m256i s16 = _mm256_maddubs_epi16(_mm256_set1_epi8(1), p);
        __m256i s32 = _mm256_madd_epi16(s16, _mm256_set1_epi16(1));
        __m128i s4 = _mm_add_epi32(_mm256_castsi256_si128(s32), _mm256_extracti128_si256(s32, 1));
        s4 = _mm_add_epi32(s4, _mm_shuffle_epi32(s4, 0x4E));
        s4 = _mm_add_epi32(s4, _mm_shuffle_epi32(s4, 0xB1));
        y[i].s = f32_to_fp16((float)_mm_cvtsi128_si32(s4) * d);
    }
}

static void qa_act_q8_K(const float *x, block_q8_K *y, int64_t nb) {
    const __m256 sgn = _mm256_set1_ps(-0.0f);
    for (int64_t i = 0; i < nb; i++, x += QK_K) {
        __m256 m = _mm256_setzero_ps();
        for (int k = 0; k < QK_K; k += 8) m = _mm256_max_ps(m, _mm256_andnot_ps(sgn, _mm256_loadu_ps(x + k)));
        float amax = qa_hmax_ps(m);
        if (!(amax > 0.0f)) {
            memset(&y[i], 0, sizeof y[i]);
            continue;
        }
        /* the first element of largest magnitude gives the sign (as the reference) */
        float max = 0.0f;
        for (int k = 0; k < QK_K; k += 8) {
            __m256 e = _mm256_cmp_ps(_mm256_andnot_ps(sgn, _mm256_loadu_ps(x + k)), _mm256_set1_ps(amax), _CMP_EQ_OQ);
            int bits = _mm256_movemask_ps(e);
            if (bits) { max = x[k + __builtin_ctz((unsigned)bits)]; break; }
        }
        float iscale = -127.0f / max;
        __m256 is = _mm256_set1_ps(iscale);
        const __m256i lim = _mm256_set1_epi32(127);
        for (int k = 0; k < QK_K; k += 32) {
            __m256i q[4];
            QA_UNROLL
            for (int t = 0; t < 4; t++)
                q[t] = _mm256_min_epi32(_mm256_cvtps_epi32(_mm256_mul_ps(is, _mm256_loadu_ps(x + k + 8 * t))), lim);
            __m256i p = qa_pack_i8(q[0], q[1], q[2], q[3]);
            _mm256_storeu_si256((__m256i *)(y[i].qs + k), p);
            /* sums of 16: byte pairs, then pairs of those, then pairs again */
            __m256i s16 = _mm256_maddubs_epi16(_mm256_set1_epi8(1), p);
            __m256i s32 = _mm256_madd_epi16(s16, _mm256_set1_epi16(1));        /* sums of 4 */
            __m256i s8 = _mm256_hadd_epi32(s32, s32);                          /* sums of 8 */
            __m256i s16b = _mm256_hadd_epi32(s8, s8);                          /* sums of 16 */
            y[i].bsums[k / 16] = (int16_t)_mm256_extract_epi32(s16b, 0);
            y[i].bsums[k / 16 + 1] = (int16_t)_mm256_extract_epi32(s16b, 4);
        }
        y[i].d = 1.0f / iscale;
    }
}

static void qa_act_f16(const float *x, fp16_t *y, int64_t n) {
    int64_t k = 0;
    for (; k + 8 <= n; k += 8)
        _mm_storeu_si128((__m128i *)(y + k), _mm256_cvtps_ph(_mm256_loadu_ps(x + k), _MM_FROUND_TO_NEAREST_INT));
    for (; k < n; k++) y[k] = f32_to_fp16(x[k]);
}

static int qa_quantize_act_row(uint32_t type, const float *x, void *y, int64_t n) {
    switch (type) {
    case GGML_TYPE_Q8_0: qa_act_q8_0(x, y, n / QK8_0); return 1;
    case GGML_TYPE_Q8_1: qa_act_q8_1(x, y, n / QK8_1); return 1;
    case GGML_TYPE_Q8_K: qa_act_q8_K(x, y, n / QK_K); return 1;
    case GGML_TYPE_F16: qa_act_f16(x, y, n); return 1;
    default: return 0;
    }
}

#endif /* QA_ONLY */
#define QA_BUILT 1
#else
#define QA_BUILT 0
#define qa_mul_mat_tile NULL
#define qa_quantize_act_row NULL
#endif

#if !defined(QA_ONLY)
#define QA_NEEDS_avx2 QK_CPU_AVX2
#define QA_NEEDS_avxvnni (QK_CPU_AVX2 | QK_CPU_AVXVNNI)
#define QA_NEEDS_avx512 (QK_CPU_AVX2 | QK_CPU_AVX512)
#if defined(QA_ZMM)
#define QA_VEC_OPS QK_VEC_AVX512    /* the AVX2 ops plus ops_avx512.c */
#else
#define QA_VEC_OPS QK_VEC_AVX2
#endif
const quant_kset QA_CAT(quant_kset, QA_SET) = {
    .name = QA_STR(QA_SET), .needs = QA_CAT(QA_NEEDS, QA_SET), .built = QA_BUILT, .vec_ops = QA_VEC_OPS,
    .mul_mat_tile = qa_mul_mat_tile, .quantize_act_row = qa_quantize_act_row,
#if defined(QA_ZMM)
    .packed_types = 1ull << GGML_TYPE_Q8_0 | 1ull << GGML_TYPE_Q4_0 | 1ull << GGML_TYPE_Q5_0 |
                    1ull << GGML_TYPE_Q4_K | 1ull << GGML_TYPE_Q5_K | 1ull << GGML_TYPE_Q6_K,
    .mul_mat_tile_packed = quant_avx512_mul_packed,
#endif
};
#endif

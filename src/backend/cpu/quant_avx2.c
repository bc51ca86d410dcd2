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

#if defined(QA_ZMM)
/* ==== AVX-512 VNNI: Q8_0 prefill, 16 weight rows across the lanes ====
 * For several activation rows, sixteen weight rows are first gathered into
 * lane order: per block, register g holds bytes 4g..4g+3 of the 16 rows
 * (plus 128, as u8). Eight vpdpbusd with the activation's 4-byte groups
 * broadcast then give each lane its row's whole integer block dot, so the
 * float scaling is one convert, multiply and add per 16 rows x 32 values
 * (the pair tile above spends that per 2 blocks of one row). Each lane
 * accumulates sumf += (float)sumi * (d_w * d_a) block after block, unfused:
 * the reference's arithmetic, bit for bit. The gathering is shared by all
 * the call's activation rows. */
#define QA_R16_MAXB 128   /* blocks per pass: 16 rows x 128 blocks packed are 68 KiB (stack) */
#define QA_R16_ACTS 8     /* activation rows per walk: 8 accumulators beside 8 weight registers */
/* Fewer activation rows do not repay the gathering: the few-row tile, two
 * rows a pass, against it on Q8_0 keys (scratch program, 28 x 8 heads,
 * one thread of an AMD EPYC; 128-wide rows, 4096 keys): 4 rows 16.3 against
 * 58-60 ms, 8 rows 25.2-25.5 against 57.2-57.7; 1024 keys: 16 rows 10.4
 * against 14.2, 20 rows 12.7 against 13.9, 24 rows 14.4 against 15.0, 28
 * rows 16.6 against 14.9, 32 rows 18.4 against 14.1; 1024-wide rows, 128
 * keys: 4 rows 3.9 against 10.0, 16 rows 9.6 against 11.2. */
#define QA_R16_MIN 17
#define QA_R16_JC 64      /* activation rows whose corrections are kept (32 KiB, stack) */
/* Decode reads a packed group as one sequential stream; a prefetch 2 KiB
 * (about four blocks) ahead keeps more lines in flight than the hardware
 * prefetcher alone, where quant_walk_prefetch is on (quant_dispatch.c). */
#define QA_P16_PF 2048

/* rows [0, 16) of w, blocks [b0, b0 + nb) -> the packed layout of quant.h
 * (544 bytes a block: 16 fp16 scales, then 8 runs of 16 rows x 4 bytes + 128) */
static void qa_r16_pack(const uint8_t *w, size_t w_stride, int64_t b0, int64_t nb, uint8_t *pk) {
    const __m512i idx = _mm512_mullo_epi32(_mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15),
                                           _mm512_set1_epi32((int)w_stride));
    const __m512i off = _mm512_set1_epi8((char)0x80);
    for (int64_t b = 0; b < nb; b++, pk += 544) {
        const uint8_t *base = w + (size_t)(b0 + b) * sizeof(block_q8_0);
        __m512i d = _mm512_i32gather_epi32(idx, base, 1);   /* the fp16 scale in the low half */
        _mm256_storeu_si256((__m256i *)pk, _mm512_cvtepi32_epi16(d));
        for (int g = 0; g < 8; g++)
            _mm512_storeu_si512(pk + 32 + 64 * g, _mm512_xor_si512(_mm512_i32gather_epi32(idx, base + 2 + 4 * g, 1), off));
    }
}

/* Four activation bytes to every lane, straight from memory (vpbroadcastd
 * m32): a memcpy to an int first made the compiler load 8 bytes, shift and
 * move each half from a general register (four instructions for one). */
QA_INLINE __m512i qa_bcast4(const int8_t *p) { return _mm512_broadcastd_epi32(_mm_loadu_si32(p)); }

/* Packed bytes per block of 16 rows (quant_pack.c's layouts) */
#define QA_P16_BSIZE(T) ((T) == GGML_TYPE_Q8_0 ? 544 : (T) == GGML_TYPE_Q4_0 ? 288 : 352)

/* Q4_0 / Q5_0: levels (value + 8, or value + 16) of nibble run g, part 0
 * (elements 4g..4g+3) or part 1 (16 + 4g..); Q5_0's fifth bits come from
 * the lane's qh word: bit e of it to bit 4 of byte e - 4g (the multiply
 * spreads four bits to the four bytes without carries). */
QA_INLINE __m512i qa_p16_levels(uint32_t T, __m512i v, __m512i qh, int g, int part) {
    const __m512i m4 = _mm512_set1_epi8(0xF);
    __m512i l = part ? _mm512_and_si512(_mm512_srli_epi16(v, 4), m4) : _mm512_and_si512(v, m4);
    if (T == GGML_TYPE_Q5_0) {
        __m512i x = _mm512_and_si512(_mm512_srli_epi32(qh, 16 * part + 4 * g), _mm512_set1_epi32(0xF));
        x = _mm512_and_si512(_mm512_mullo_epi32(x, _mm512_set1_epi32(0x00204081)), _mm512_set1_epi32(0x01010101));
        l = _mm512_or_si512(l, _mm512_slli_epi32(x, 4));
    }
    return l;
}

/* RA activation rows x 16 packed rows (type T) over nb blocks; acc carried
 * in out (row-major [act][row]) when `first` is 0. cs: -128 * the sum of
 * each activation block (Q8_0's offset; Q4_0 and Q5_0 take a 16th and an
 * 8th of it). With one or two activation rows each block's products are
 * split over two chains (integer sums: the same result) so that their
 * latency does not bound a decode step. */
QA_INLINE void qa_r16_walk(uint32_t T, int RA, int64_t nb, const uint8_t *pk, const uint8_t *a0, size_t as,
                           const int32_t *cs, int first, float *out, size_t out_stride, size_t gn) {
    const int bsz = QA_P16_BSIZE(T);
    __m512 acc[QA_R16_ACTS];
    QA_UNROLL
    for (int r = 0; r < RA; r++) acc[r] = first ? _mm512_setzero_ps() : _mm512_loadu_ps(out + (size_t)r * out_stride);
    const int pf = quant_walk_prefetch;
    for (int64_t b = 0; b < nb; b++, pk += bsz) {
        __m512i x[8];
        if (RA <= 2 && pf) _mm_prefetch((const char *)pk + QA_P16_PF, _MM_HINT_T0);
        if (RA > 2 && gn)   /* the next group's block (qa_mul_mat_r16); RA <= 2 prefetches ahead above */
            for (int l = 0; l < bsz; l += 64) _mm_prefetch((const char *)pk + gn + l, _MM_HINT_T0);
        if (T == GGML_TYPE_Q8_0) {
            QA_UNROLL
            for (int g = 0; g < 8; g++) x[g] = _mm512_loadu_si512(pk + 32 + 64 * g);
        } else {   /* x[g]: bytes 4g..4g+3 of the block's 32 levels, as Q8_0's runs */
            const uint8_t *q = pk + (T == GGML_TYPE_Q5_0 ? 96 : 32);
            __m512i qh = T == GGML_TYPE_Q5_0 ? _mm512_loadu_si512(pk + 32) : _mm512_setzero_si512();
            QA_UNROLL
            for (int g = 0; g < 4; g++) {
                __m512i v = _mm512_loadu_si512(q + 64 * g);
                x[g] = qa_p16_levels(T, v, qh, g, 0);
                x[4 + g] = qa_p16_levels(T, v, qh, g, 1);
            }
        }
        __m512 wd = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)pk));
        QA_UNROLL
        for (int r = 0; r < RA; r++) {
            /* rows and corrections at fixed strides: two pointers in all, not 2 x RA */
            const block_q8_0 *y = (const block_q8_0 *)(a0 + (size_t)r * as) + b;
            const int32_t cr = cs[(size_t)r * QA_R16_MAXB + (size_t)b];
            int32_t c = T == GGML_TYPE_Q8_0 ? cr : T == GGML_TYPE_Q4_0 ? cr / 16 : cr / 8;
            __m512i s = _mm512_set1_epi32(c);
            if (RA <= 2) {
                __m512i s1 = _mm512_dpbusd_epi32(_mm512_setzero_si512(), x[1], qa_bcast4(y->qs + 4));
                s = _mm512_dpbusd_epi32(s, x[0], qa_bcast4(y->qs));
                QA_UNROLL
                for (int g = 2; g < 8; g += 2) {
                    s = _mm512_dpbusd_epi32(s, x[g], qa_bcast4(y->qs + 4 * g));
                    s1 = _mm512_dpbusd_epi32(s1, x[g + 1], qa_bcast4(y->qs + 4 * g + 4));
                }
                s = _mm512_add_epi32(s, s1);
            } else {
                QA_UNROLL
                for (int g = 0; g < 8; g++) s = _mm512_dpbusd_epi32(s, x[g], qa_bcast4(y->qs + 4 * g));
            }
            __m512 sc = _mm512_mul_ps(wd, _mm512_set1_ps(qa_h2f(y->d)));
            acc[r] = _mm512_add_ps(acc[r], _mm512_mul_ps(_mm512_cvtepi32_ps(s), sc));
        }
    }
    QA_UNROLL
    for (int r = 0; r < RA; r++) _mm512_storeu_ps(out + (size_t)r * out_stride, acc[r]);
}

/* one walk per (type, activation rows), so the loops above fully unroll */
#define QA_R16_WALK(TN)                                                                            \
    static void qa_r16_walk_##TN(int RA, int64_t nb, const uint8_t *pk, const uint8_t *a0, size_t as, \
                                 const int32_t *cs, int first, float *out, size_t os, size_t gn) { \
        const uint32_t T = GGML_TYPE_##TN;                                                         \
        switch (RA) {                                                                              \
        case 1: qa_r16_walk(T, 1, nb, pk, a0, as, cs, first, out, os, gn); break;                  \
        case 2: qa_r16_walk(T, 2, nb, pk, a0, as, cs, first, out, os, gn); break;                  \
        case 3: qa_r16_walk(T, 3, nb, pk, a0, as, cs, first, out, os, gn); break;                  \
        case 4: qa_r16_walk(T, 4, nb, pk, a0, as, cs, first, out, os, gn); break;                  \
        case 5: qa_r16_walk(T, 5, nb, pk, a0, as, cs, first, out, os, gn); break;                  \
        case 6: qa_r16_walk(T, 6, nb, pk, a0, as, cs, first, out, os, gn); break;                  \
        case 7: qa_r16_walk(T, 7, nb, pk, a0, as, cs, first, out, os, gn); break;                  \
        default: qa_r16_walk(T, 8, nb, pk, a0, as, cs, first, out, os, gn); break;                 \
        }                                                                                          \
    }
QA_R16_WALK(Q8_0)
QA_R16_WALK(Q4_0)
QA_R16_WALK(Q5_0)

/* -128 * (sum of the block's activations): the u8 weights' offset */
QA_INLINE int32_t qa_r16_corr(const block_q8_0 *y) {
    __m256i v = _mm256_xor_si256(_mm256_loadu_si256((const __m256i *)y->qs), _mm256_set1_epi8((char)0x80));
    __m256i s = _mm256_sad_epu8(v, _mm256_setzero_si256());   /* four sums of 8 (a + 128) */
    __m128i t = _mm_add_epi64(_mm256_castsi256_si128(s), _mm256_extracti128_si256(s, 1));
    int64_t sum = _mm_cvtsi128_si64(t) + _mm_extract_epi64(t, 1) - 32 * 128;
    return (int32_t)(-128 * sum);
}

/* Decode (a few activation rows): the same per-lane arithmetic without the
 * gathering. Each of 16 rows' block dots is one ymm vpdpbusd straight from
 * the row, the 16 eight-lane sums are reduced to one register of 16 (lane =
 * row) by a tree of horizontal adds, then scaled and accumulated as above, so
 * a row's result does not depend on how many activation rows share the call
 * (continuous batching must not change a sequence's logits). The tree's
 * first level (h[i] = hadd(v[2i], v[2i+1])) is the dot helpers' below. */
QA_INLINE __m512i qa_r16_reduce_h(const __m256i *h) {
    __m256i q[4];
    QA_UNROLL
    for (int i = 0; i < 4; i++) q[i] = _mm256_hadd_epi32(h[2 * i], h[2 * i + 1]);
    /* q[i]: lanes 0-3 rows 4i..4i+3 (elements 0-3), lanes 4-7 the same rows (elements 4-7) */
    __m128i t[4];
    QA_UNROLL
    for (int i = 0; i < 4; i++) t[i] = _mm_add_epi32(_mm256_castsi256_si128(q[i]), _mm256_extracti128_si256(q[i], 1));
    __m512i r = _mm512_castsi128_si512(t[0]);
    r = _mm512_inserti32x4(r, t[1], 1);
    r = _mm512_inserti32x4(r, t[2], 2);
    return _mm512_inserti32x4(r, t[3], 3);
}

/* One activation row's dots with one block of 16 weight rows, the tree's
 * first level applied: the 16 dots first, then the horizontal adds (against
 * making them pairwise as below: 7.5 against 9.8 ms a pass of the scratch
 * program with one query row). */
QA_INLINE void qa_q8_few_dots1(const uint8_t *base, size_t w_stride, __m256i y, __m256i *h) {
    const __m256i off = _mm256_set1_epi8((char)0x80);
    __m256i v[16];
    QA_UNROLL
    for (int j = 0; j < 16; j++) {
        const uint8_t *wb = base + (size_t)j * w_stride;
        _mm_prefetch((const char *)wb + QA_PF, _MM_HINT_T0);
        v[j] = _mm256_dpbusd_epi32(_mm256_setzero_si256(),
                                   _mm256_xor_si256(_mm256_loadu_si256((const __m256i *)(wb + 2)), off), y);
    }
    QA_UNROLL
    for (int i = 0; i < 8; i++) h[i] = _mm256_hadd_epi32(v[2 * i], v[2 * i + 1]);
}

/* Two activation rows: each weight row loaded and offset once for both,
 * the first level of the tree taken pairwise (16 registers, not 32). */
QA_INLINE void qa_q8_few_dots2(const uint8_t *base, size_t w_stride, const __m256i *y, __m256i (*h)[8]) {
    const __m256i off = _mm256_set1_epi8((char)0x80);
    QA_UNROLL
    for (int i = 0; i < 8; i++) {
        const uint8_t *wa = base + (size_t)(2 * i) * w_stride, *wb = wa + w_stride;
        _mm_prefetch((const char *)wa + QA_PF, _MM_HINT_T0);
        _mm_prefetch((const char *)wb + QA_PF, _MM_HINT_T0);
        __m256i qa = _mm256_xor_si256(_mm256_loadu_si256((const __m256i *)(wa + 2)), off);
        __m256i qb = _mm256_xor_si256(_mm256_loadu_si256((const __m256i *)(wb + 2)), off);
        QA_UNROLL
        for (int r = 0; r < 2; r++)
            h[r][i] = _mm256_hadd_epi32(_mm256_dpbusd_epi32(_mm256_setzero_si256(), qa, y[r]),
                                        _mm256_dpbusd_epi32(_mm256_setzero_si256(), qb, y[r]));
    }
}

/* NA (1 or 2) activation rows x 16-row groups, blocks [b0, b0 + nb): each
 * weight block is loaded and offset once for the NA rows; the rows'
 * offset corrections (cs) and scales (da) come precomputed; acc continues
 * from out unless b0 == 0 (a float stored and loaded back is the same
 * float, so the result equals one pass over all blocks). */
QA_INLINE void qa_q8_few_rows(int NA, int64_t b0, int64_t nb, const uint8_t *w, size_t w_stride, int nw16,
                              const block_q8_0 *const *ar, const int32_t (*cs)[QA_R16_MAXB],
                              const float (*da)[QA_R16_MAXB], float *out, size_t out_stride) {
    const __m512i idx = _mm512_mullo_epi32(_mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15),
                                           _mm512_set1_epi32((int)w_stride));
    for (int i0 = 0; i0 < nw16; i0 += 16) {
        const uint8_t *w0 = w + (size_t)i0 * w_stride + (size_t)b0 * sizeof(block_q8_0);
        __m512 acc[2];
        QA_UNROLL
        for (int r = 0; r < NA; r++)
            acc[r] = b0 == 0 ? _mm512_setzero_ps() : _mm512_loadu_ps(out + (size_t)r * out_stride + (size_t)i0);
        for (int64_t b = 0; b < nb; b++) {
            const uint8_t *base = w0 + (size_t)b * sizeof(block_q8_0);
            __m256i y[2], h[2][8];
            QA_UNROLL
            for (int r = 0; r < NA; r++) y[r] = _mm256_loadu_si256((const __m256i *)ar[r][b0 + b].qs);
            if (NA == 1) qa_q8_few_dots1(base, w_stride, y[0], h[0]);
            else qa_q8_few_dots2(base, w_stride, y, h);
            __m512 wd = _mm512_cvtph_ps(_mm512_cvtepi32_epi16(_mm512_i32gather_epi32(idx, base, 1)));
            QA_UNROLL
            for (int r = 0; r < NA; r++) {
                __m512i s = _mm512_add_epi32(qa_r16_reduce_h(h[r]), _mm512_set1_epi32(cs[r][b]));
                __m512 sc = _mm512_mul_ps(wd, _mm512_set1_ps(da[r][b]));
                acc[r] = _mm512_add_ps(acc[r], _mm512_mul_ps(_mm512_cvtepi32_ps(s), sc));
            }
        }
        QA_UNROLL
        for (int r = 0; r < NA; r++) _mm512_storeu_ps(out + (size_t)r * out_stride + (size_t)i0, acc[r]);
    }
}

/* Rows [0, nw16) (a multiple of 16) x na (< QA_R16_MIN) activation rows,
 * two at a time (a decode step's query heads that share a KV head: one
 * pass over the keys for two of them); the corrections and scales of up to
 * QA_R16_MAXB blocks at a time, made once instead of once per 16 rows.
 * Q8_0 keys of the Qwen3-0.6B shape at depth 4096 (28 layers x 8 heads, one
 * thread of an AMD EPYC, scratch program), a pass: two query rows
 * 12.3-12.7 -> 11.1-11.4 ms, one row 8.1-8.6 -> 7.3-7.9 ms. */
static void qa_mul_mat_q8_r16_few(int64_t n, const uint8_t *w, size_t w_stride, int nw16, const void *a,
                                  size_t a_stride, int na, float *out, size_t out_stride) {
    const int64_t nbt = n / 32;
    int32_t cs[2][QA_R16_MAXB];
    float da[2][QA_R16_MAXB];
    for (int r0 = 0; r0 < na; r0 += 2) {
        const int NA = na - r0 < 2 ? na - r0 : 2;
        const block_q8_0 *ar[2];
        for (int r = 0; r < NA; r++) ar[r] = (const block_q8_0 *)((const uint8_t *)a + (size_t)(r0 + r) * a_stride);
        float *o = out + (size_t)r0 * out_stride;
        for (int64_t b0 = 0; b0 < nbt; b0 += QA_R16_MAXB) {
            const int64_t nb = nbt - b0 < QA_R16_MAXB ? nbt - b0 : QA_R16_MAXB;
            for (int r = 0; r < NA; r++)
                for (int64_t b = 0; b < nb; b++) {
                    cs[r][b] = qa_r16_corr(&ar[r][b0 + b]);
                    da[r][b] = qa_h2f(ar[r][b0 + b].d);
                }
            if (NA == 2) qa_q8_few_rows(2, b0, nb, w, w_stride, nw16, ar, cs, da, o, out_stride);
            else qa_q8_few_rows(1, b0, nb, w, w_stride, nw16, ar, cs, da, o, out_stride);
        }
    }
}

/* Rows [0, nw16) (a multiple of 16) x all na activation rows. Plain Q8_0
 * rows (packed == 0) are gathered into the packed layout on the stack, 128
 * blocks at a time; packed ones (Q8_0, Q4_0, Q5_0) are walked where they lie.
 * The first walk over each group (gn), if it has three or more activation
 * rows, prefetches the next group's blocks, each beside the same block of
 * its own, as the K-quant tiles do (qa_mul_mat_kpacked). 128 expert
 * matrices of 768 x 2048 Q8_0 from memory, both cores of a Zen 5, each
 * against its own rows (scratch program): 4 rows 216 -> 334 GFLOP/s, 8 rows
 * 355 -> 631 without and with; 16 rows 677 -> 963, 32 rows 637 -> 925
 * against the whole next group as a burst before the walks, which this
 * replaced (the burst: 16 rows 467 -> 647, 32 rows 475 -> 684, but 4 rows
 * 302-305 -> 247-257). */
static void qa_mul_mat_r16(uint32_t type, int64_t n, const uint8_t *w, size_t w_stride, int nw16, const void *a,
                           size_t a_stride, int na, float *out, size_t out_stride, int packed) {
    const int64_t nbt = n / 32;
    const size_t bsz = QA_P16_BSIZE(type);
    void (*walk)(int, int64_t, const uint8_t *, const uint8_t *, size_t, const int32_t *, int, float *,
                 size_t, size_t) = type == GGML_TYPE_Q8_0 ? qa_r16_walk_Q8_0
                         : type == GGML_TYPE_Q4_0 ? qa_r16_walk_Q4_0 : qa_r16_walk_Q5_0;
    _Alignas(64) uint8_t pbuf[QA_R16_MAXB * 544];   /* 68 KiB; unused when packed */
    int32_t cs[QA_R16_JC][QA_R16_MAXB];
    for (int64_t b0 = 0; b0 < nbt; b0 += QA_R16_MAXB) {
        int64_t nb = nbt - b0 < QA_R16_MAXB ? nbt - b0 : QA_R16_MAXB;
        for (int jc = 0; jc < na; jc += QA_R16_JC) {
            int nj = na - jc < QA_R16_JC ? na - jc : QA_R16_JC;
            /* the activations' offset corrections, once for all row groups */
            for (int r = 0; r < nj; r++) {
                const block_q8_0 *y = (const block_q8_0 *)((const uint8_t *)a + (size_t)(jc + r) * a_stride) + b0;
                for (int64_t b = 0; b < nb; b++) cs[r][b] = qa_r16_corr(&y[b]);
            }
            for (int i0 = 0; i0 < nw16; i0 += 16) {
                const uint8_t *pk = pbuf;
                if (packed) pk = w + (size_t)i0 * w_stride + (size_t)b0 * bsz;
                else qa_r16_pack(w + (size_t)i0 * w_stride, w_stride, b0, nb, pbuf);
                for (int j0 = 0; j0 < nj; j0 += QA_R16_ACTS) {
                    int RA = nj - j0 < QA_R16_ACTS ? nj - j0 : QA_R16_ACTS;
                    /* the first walk fetches the next group's blocks of this pass (see above) */
                    const size_t gn = packed && j0 == 0 ? 16 * w_stride : 0;
                    const uint8_t *a0 = (const uint8_t *)a + (size_t)(jc + j0) * a_stride + (size_t)b0 * sizeof(block_q8_0);
                    walk(RA, nb, pk, a0, a_stride, cs[j0], b0 == 0, out + (size_t)(jc + j0) * out_stride + (size_t)i0,
                         out_stride, gn);
                }
            }
        }
    }
}
#endif

typedef void (*qa_b32_fn)(int, int, int64_t, const uint8_t *, size_t, const block_q8_0 *const *,
                          const float (*)[QA_CHUNK], const __m256i (*)[QA_CHUNK], float *);

static void qa_mul_mat_b32(uint32_t type, int64_t n, const void *w, size_t w_stride, int nw,
                           const void *a, size_t a_stride, int na, float *out, size_t out_stride) {
#if defined(QA_ZMM)
    if (type == GGML_TYPE_Q8_0 && nw >= 16 && w_stride <= (size_t)INT32_MAX / 16) {
        int nw16 = nw / 16 * 16;
        if (na >= QA_R16_MIN) qa_mul_mat_r16(GGML_TYPE_Q8_0, n, (const uint8_t *)w, w_stride, nw16, a, a_stride, na, out, out_stride, 0);
        else qa_mul_mat_q8_r16_few(n, (const uint8_t *)w, w_stride, nw16, a, a_stride, na, out, out_stride);
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

#if defined(QA_ZMM)
/* ==== AVX-512 VNNI: packed K-quants, 16 rows across the lanes ====
 * Weights in the packed layouts of quant_pack.c: each 64-byte run gives lane i
 * four bytes of row i, so a vpdpbusd against four broadcast activation bytes
 * adds four products to each row's sub-block dot. Every lane keeps the
 * reference's integers (sub-block dots, scaled sums) exactly and then does
 * its float arithmetic in the reference's order, unfused: results equal
 * quant_ref_vec_dot's bit for bit, whatever the number of activation rows. */
/* Activation rows per walk: 8 share each decoded weight run (measured on
 * one Zen 5 core, cache-resident 16 x 64 x 1024 tiles: Q4_K 588 -> 610
 * GFLOP/s, Q6_K 392 -> 415 going from 4 to 8, though the accumulators no
 * longer all fit the 32 registers; 6 was slower than both). */
#define QA_KP_ACTS 8
#define QA_Q4KP_BLOCK 2304  /* 16 x sizeof(block_q4_K) */
#define QA_Q5KP_BLOCK 2816  /* 16 x sizeof(block_q5_K) */
#define QA_Q6KP_BLOCK 3360  /* 16 x sizeof(block_q6_K) */
/* Decode walks prefetch every line about 12 KiB ahead (Q4_K 12 KiB, Q6_K
 * four super-blocks, 13 KiB), each line's prefetch beside its own load.
 * The distance is read at run time (volatile): as a constant, GCC gathered
 * all 36-40 prefetches of a super-block at its start, and that burst of
 * misses held the demand loads back. One Zen 5 core, packed 1024-wide rows
 * from memory, one activation row, alternated runs: Q4_K two super-blocks
 * (4.5 KiB) ahead 31-33 GB/s gathered, 33-40 spread; 12 KiB 31-33
 * gathered, 42-48 spread (slower again from 18 KiB). Q6_K 33 -> 44-46.
 * The Q8_0 walk reads 42-44 at any distance. With both cores streaming
 * and the machine's bandwidth the limit (about 44 GB/s for the two), every
 * distance of this one prefetch gave the same (a second one does not:
 * quant_dispatch.c, "Walk prefetch"). */
static volatile const size_t qa_kp_pf_q4k = 12288, qa_kp_pf_q6k = 4 * QA_Q6KP_BLOCK;
/* A second prefetch of every line, 32 KiB ahead: see quant_dispatch.c,
 * "Walk prefetch" (where it is measured, and the CPUs it is off on). */
static volatile const size_t qa_kp_far = 32768;
/* a line's two prefetches, near and far ahead of p; none when near is 0
 * (quant_walk_prefetch off) */
#define QA_PF_2(p, near, far)                                           \
    do {                                                                \
        if (near) {                                                     \
            _mm_prefetch((const char *)(p) + (near), _MM_HINT_T0);      \
            _mm_prefetch((const char *)(p) + (far), _MM_HINT_T0);       \
        }                                                               \
    } while (0)

/* Q4_K's scales and mins, decoded once per block from the three scale runs
 * A, B, C (bytes 0-3, 4-7, 8-11 of each row's 12 scale bytes; for j < 4
 * scale j is byte j of A and min j byte j of B, 6 bits each; for j >= 4 a
 * nibble of C, low for the scale and high for the min, goes under the top
 * two bits of byte j - 4 of A or B). One select assembles the four high
 * scales (or mins) of a row at once, where decoding each apart took six
 * operations; the mins are paired (0, 2), (1, 3), (4, 6), (5, 7) as they
 * fall from the bytes, and the activations' sub-block sums are ordered to
 * meet them. One Zen 5 core, cache-resident rows, one activation row:
 * 74-75 -> 78-80 GB/s; decode tokens alternated in one process:
 * Qwen3-0.6B Q4_K_M +0.4-1.2% at ~47 GB/s, +4% at ~80, Q5_K_M and the
 * 30B-A3B shape -3% to +3% (7 of 10 runs above even). The same
 * integers: the same bits. */
typedef struct {
    __m512i A, S47;   /* scale j: byte j of A (j < 4) or j - 4 of S47, bits 6-7 to be masked */
    __m512i mp[4];    /* mins as int16 pairs (0, 2), (1, 3), (4, 6), (5, 7) */
} qa_q4k_scales;

QA_INLINE void qa_q4k_scales_get(__m512i A, __m512i B, __m512i C, qa_q4k_scales *s) {
    const __m512i lo4 = _mm512_set1_epi8(0x0F), pair = _mm512_set1_epi32(0x003F003F);
    s->A = A;
    /* 0xCA: lo4 ? second : third, bit by bit */
    s->S47 = _mm512_ternarylogic_epi32(lo4, C, _mm512_srli_epi32(A, 2), 0xCA);
    const __m512i M47 = _mm512_ternarylogic_epi32(lo4, _mm512_srli_epi32(C, 4), _mm512_srli_epi32(B, 2), 0xCA);
    s->mp[0] = _mm512_and_si512(B, pair);
    s->mp[1] = _mm512_and_si512(_mm512_srli_epi32(B, 8), pair);
    s->mp[2] = _mm512_and_si512(M47, pair);
    s->mp[3] = _mm512_and_si512(_mm512_srli_epi32(M47, 8), pair);
}

/* Scale j of every lane. */
QA_INLINE __m512i qa_q4k_scale(const qa_q4k_scales *s, int j) {
    return _mm512_and_si512(_mm512_srli_epi32(j < 4 ? s->A : s->S47, 8 * (j & 3)), _mm512_set1_epi32(63));
}

/* Q5_K's fifth bits for the 4 x 16 elements of run g of chunk c: bit 2c
 * (low nibbles, sel 0) or 2c + 1 (high, sel 1) of each qh byte moved to bit
 * 4 (16-bit shifts of at most 4 left or 3 right keep every byte's bit in
 * its byte), then merged into the nibbles q: (h & 0x10) | q. */
QA_INLINE __m512i qa_q5k_bit5(__m512i h, __m512i q, int c, int sel) {
    const int j = 2 * c + sel;
    __m512i t = j <= 4 ? _mm512_slli_epi16(h, 4 - j) : _mm512_srli_epi16(h, j - 4);
    return _mm512_ternarylogic_epi32(t, _mm512_set1_epi8(0x10), q, 0xEA);
}

/* Q4_K and (Q5 = 1) Q5_K: the same walk, Q5_K's nibbles widened to 5 bits
 * by its qh runs (two shifts and two merges per run). */
QA_INLINE void qa_q45k_walk(int Q5, int RA, int64_t nb, const uint8_t *pk, const block_q8_K *const *ar, float *out,
                            size_t out_stride, size_t gn) {
    const __m512i m4 = _mm512_set1_epi8(0xF);
    const int qs0 = Q5 ? 768 : 256;             /* the qs runs */
    __m512 acc[QA_KP_ACTS];
    QA_UNROLL
    for (int r = 0; r < RA; r++) acc[r] = _mm512_setzero_ps();
    const size_t pf = quant_walk_prefetch ? qa_kp_pf_q4k : 0, far = qa_kp_far;
    for (int64_t b = 0; b < nb; b++, pk += Q5 ? QA_Q5KP_BLOCK : QA_Q4KP_BLOCK) {
        if (RA <= 2)   /* the scales' lines (the runs' are fetched as they are read) */
            for (int l = 0; l < 256; l += 64) QA_PF_2(pk + l, pf, far);
        qa_q4k_scales sc;
        qa_q4k_scales_get(_mm512_loadu_si512(pk + 64), _mm512_loadu_si512(pk + 128), _mm512_loadu_si512(pk + 192), &sc);
        /* decode: Q5_K's 8 qh runs in registers before the qs runs, so the
         * block is read front to back (loaded at c = 0, the qh lines had
         * alternated with the qs lines). One Zen 5 core from memory: walk /
         * streaming read 0.76-0.88 -> 0.86-0.98, tg64 with -t 1 67.4-68.5 ->
         * 71.4-72.1 t/s (Qwen3-0.6B Q5_K_M); with both cores within the noise. */
        __m512i H[8];
        if (Q5 && RA <= 2)
            for (int g = 0; g < 8; g++) H[g] = _mm512_loadu_si512(pk + 256 + 64 * g);
        __m512i sumi[QA_KP_ACTS];
        QA_UNROLL
        for (int r = 0; r < RA; r++) sumi[r] = _mm512_setzero_si512();
        QA_UNROLL
        for (int c = 0; c < 4; c++) {
            __m512i dlo[QA_KP_ACTS], dhi[QA_KP_ACTS];
            QA_UNROLL
            for (int r = 0; r < RA; r++) dlo[r] = dhi[r] = _mm512_setzero_si512();
            /* one row: the odd runs' products in a second pair of sums, so
             * that four vpdpbusd chains of four are in flight instead of two
             * of eight (one Zen 5 core, cache-resident rows: 61 -> 75 GB/s) */
            __m512i dlo1 = _mm512_setzero_si512(), dhi1 = dlo1;
            QA_UNROLL
            for (int g = 0; g < 8; g++) {
                __m512i v = _mm512_loadu_si512(pk + qs0 + 64 * (8 * c + g));
                if (RA <= 2) QA_PF_2(pk + qs0 + 64 * (8 * c + g), pf, far);
                if (Q5 && RA <= 2 && c == 0) QA_PF_2(pk + 256 + 64 * g, pf, far);
                if (RA > 2 && gn) {   /* the same line of the next group (qa_mul_mat_kpacked) */
                    _mm_prefetch((const char *)pk + gn + qs0 + 64 * (8 * c + g), _MM_HINT_T0);
                    if (c == 0 && (g < 4 || Q5))   /* the scales' 4 lines (Q5_K: and its 8 qh lines) */
                        _mm_prefetch((const char *)pk + gn + 64 * g, _MM_HINT_T0);
                    if (Q5 && c == 1 && g < 4) _mm_prefetch((const char *)pk + gn + 512 + 64 * g, _MM_HINT_T0);
                }
                __m512i lo = _mm512_and_si512(v, m4), hi = _mm512_and_si512(_mm512_srli_epi16(v, 4), m4);
                if (Q5) {
                    const __m512i h = RA <= 2 ? H[g] : _mm512_loadu_si512(pk + 256 + 64 * g);
                    lo = qa_q5k_bit5(h, lo, c, 0);
                    hi = qa_q5k_bit5(h, hi, c, 1);
                }
                QA_UNROLL
                for (int r = 0; r < RA; r++) {
                    __m512i *sl = RA == 1 && (g & 1) ? &dlo1 : &dlo[r], *sh = RA == 1 && (g & 1) ? &dhi1 : &dhi[r];
                    *sl = _mm512_dpbusd_epi32(*sl, lo, qa_bcast4(ar[r][b].qs + 64 * c + 4 * g));
                    *sh = _mm512_dpbusd_epi32(*sh, hi, qa_bcast4(ar[r][b].qs + 64 * c + 32 + 4 * g));
                }
            }
            if (RA == 1) {
                dlo[0] = _mm512_add_epi32(dlo[0], dlo1);
                dhi[0] = _mm512_add_epi32(dhi[0], dhi1);
            }
            const __m512i s0 = qa_q4k_scale(&sc, 2 * c), s1 = qa_q4k_scale(&sc, 2 * c + 1);
            QA_UNROLL
            for (int r = 0; r < RA; r++)
                sumi[r] = _mm512_add_epi32(sumi[r], _mm512_add_epi32(_mm512_mullo_epi32(s0, dlo[r]),
                                                                     _mm512_mullo_epi32(s1, dhi[r])));
        }
        /* The mins' sum, once the sub-block dots are done: per lane the sum
         * over j of min j x (bsums 2j and 2j + 1 added), as 4 vpdpwssd of the mins'
         * int16 pairs (qa_q4k_scales) against the bsums' pair sums (at most
         * 2 x 16 x 127 in magnitude, so int16 holds them). It was 8 vpdpwssd
         * per row in prefill and 8 multiplies per row in decode (one Zen 5
         * core, cache-resident rows: the one-row walk Q4_K 69-74 -> 79-81
         * GB/s, Q5_K 54 -> 70; 8 rows the same). */
        const __m512 d = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)pk));
        const __m512 dmin = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)(pk + 32)));
        QA_UNROLL
        for (int r = 0; r < RA; r++) {
            const __m128i one = _mm_set1_epi16(1);
            const __m128i *bs = (const __m128i *)ar[r][b].bsums;
            int32_t ps[4];
            /* sub-block sums 0..7 as int16, in the mins' order 0 2 1 3 4 6 5 7 */
            const __m128i order = _mm_setr_epi8(0, 1, 4, 5, 2, 3, 6, 7, 8, 9, 12, 13, 10, 11, 14, 15);
            _mm_storeu_si128((__m128i *)ps,
                             _mm_shuffle_epi8(_mm_packs_epi32(_mm_madd_epi16(_mm_loadu_si128(bs), one),
                                                              _mm_madd_epi16(_mm_loadu_si128(bs + 1), one)),
                                              order));
            __m512i summ = _mm512_setzero_si512();
            QA_UNROLL
            for (int k = 0; k < 4; k++) summ = _mm512_dpwssd_epi32(summ, sc.mp[k], qa_bcast4((const int8_t *)&ps[k]));
            __m512 dy = _mm512_set1_ps(ar[r][b].d);
            __m512 t = _mm512_sub_ps(_mm512_mul_ps(_mm512_mul_ps(dy, d), _mm512_cvtepi32_ps(sumi[r])),
                                     _mm512_mul_ps(_mm512_mul_ps(dy, dmin), _mm512_cvtepi32_ps(summ)));
            acc[r] = _mm512_add_ps(acc[r], t);
        }
    }
    QA_UNROLL
    for (int r = 0; r < RA; r++) _mm512_storeu_ps(out + (size_t)r * out_stride, acc[r]);
}

/* Q6_K: the four quads of sub-block s, each level times 4, from its three
 * runs (quant_pack.c's layout): three ANDs, and the fourth quad's bit pairs
 * shifted into place (16-bit shifts carry the neighbour byte's bits in, so
 * two selects and a final AND keep only the pairs). */
QA_INLINE void qa_q6k_quads(const uint8_t *run, __m512i l[4]) {
    const __m512i mfc = _mm512_set1_epi8((char)0xFC);
    const __m512i a = _mm512_loadu_si512(run), b = _mm512_loadu_si512(run + 64), c = _mm512_loadu_si512(run + 128);
    l[0] = _mm512_and_si512(a, mfc);
    l[1] = _mm512_and_si512(b, mfc);
    l[2] = _mm512_and_si512(c, mfc);
    /* bits 2-3 from a << 2, 4-5 from b << 4, 6-7 from c << 6 (0xCA: A ? B : C) */
    __m512i u = _mm512_ternarylogic_epi32(_mm512_set1_epi8(0x30), _mm512_slli_epi16(b, 4), _mm512_slli_epi16(c, 6), 0xCA);
    u = _mm512_ternarylogic_epi32(_mm512_set1_epi8(0x0C), _mm512_slli_epi16(a, 2), u, 0xCA);
    l[3] = _mm512_and_si512(u, mfc);
}

/* The bsums half of the offset correction, sum over sub-blocks of
 * scale x bsum, for all 16 lanes at once (per activation row it replaces 16
 * broadcasts and subtractions; one Zen 5 core, cache-resident rows: 8
 * activation rows 428 -> 480 GFLOP/s, the one-row decode walk 60-61 -> 72-74
 * GB/s): the int8 scales of S (run c)
 * widened to int16 pairs (4c, 4c + 2) and (4c + 1, 4c + 3), vpdpwssd against
 * the matching bsums pairs, which P holds as dwords 2c and 2c + 1. */
QA_INLINE __m512i qa_q6k_bsum_dot(__m512i corr, __m512i S, __m512i P, int c) {
    const __m512i ev = _mm512_srai_epi16(_mm512_slli_epi16(S, 8), 8), od = _mm512_srai_epi16(S, 8);
    corr = _mm512_dpwssd_epi32(corr, ev, _mm512_permutexvar_epi32(_mm512_set1_epi32(2 * c), P));
    return _mm512_dpwssd_epi32(corr, od, _mm512_permutexvar_epi32(_mm512_set1_epi32(2 * c + 1), P));
}

QA_INLINE void qa_q6k_walk(int RA, int64_t nb, const uint8_t *pk, const block_q8_K *const *ar, float *out,
                           size_t out_stride, size_t gn) {
    /* bsums words reordered so that dword 2c is (4c, 4c + 2), 2c + 1 is (4c + 1, 4c + 3) */
    const __m256i bperm = _mm256_setr_epi16(0, 2, 1, 3, 4, 6, 5, 7, 8, 10, 9, 11, 12, 14, 13, 15);
    __m512 acc[QA_KP_ACTS];
    QA_UNROLL
    for (int r = 0; r < RA; r++) acc[r] = _mm512_setzero_ps();
    const size_t pf = quant_walk_prefetch ? qa_kp_pf_q6k : 0, far = qa_kp_far;
    for (int64_t b = 0; b < nb; b++, pk += QA_Q6KP_BLOCK) {
        __m512i sumi[QA_KP_ACTS], corr[QA_KP_ACTS], P[QA_KP_ACTS];
        if (RA <= 2)   /* the scales' lines (the runs' are fetched as they are read) */
            for (int l = 0; l < 288; l += 64) QA_PF_2(pk + l, pf, far);
        QA_UNROLL
        for (int r = 0; r < RA; r++) {
            sumi[r] = corr[r] = _mm512_setzero_si512();
            P[r] = _mm512_castsi256_si512(
                _mm256_permutexvar_epi16(bperm, _mm256_loadu_si256((const __m256i *)ar[r][b].bsums)));
        }
        QA_UNROLL
        for (int c = 0; c < 4; c++) {
            const __m512i S = _mm512_loadu_si512(pk + 32 + 64 * c);   /* scales 4c..4c+3 */
            QA_UNROLL
            for (int r = 0; r < RA; r++)
                corr[r] = qa_q6k_bsum_dot(corr[r], S, P[r], c);
            QA_UNROLL
            for (int j = 0; j < 4; j++) {
                const int sb = 4 * c + j;
                const uint8_t *run = pk + 288 + 192 * sb;
                if (RA <= 2)
                    for (int l = 0; l < 192; l += 64)
                        QA_PF_2(run + l, pf, far);
                if (RA > 2 && gn) {   /* the same lines of the next group (qa_mul_mat_kpacked) */
                    for (int l = 0; l < 192; l += 64) _mm_prefetch((const char *)run + gn + l, _MM_HINT_T0);
                    if (sb == 0)
                        for (int l = 0; l < 288; l += 64) _mm_prefetch((const char *)pk + gn + l, _MM_HINT_T0);
                }
                __m512i lv[4];
                qa_q6k_quads(run, lv);
                const __m512i sc = _mm512_srai_epi32(_mm512_slli_epi32(S, 24 - 8 * j), 24);   /* int8 scale sb */
                QA_UNROLL
                for (int r = 0; r < RA; r++) {
                    const int8_t *q = ar[r][b].qs + 16 * sb;
                    __m512i d = _mm512_dpbusd_epi32(_mm512_setzero_si512(), lv[0], qa_bcast4(q));
                    d = _mm512_dpbusd_epi32(d, lv[1], qa_bcast4(q + 4));
                    d = _mm512_dpbusd_epi32(d, lv[2], qa_bcast4(q + 8));
                    d = _mm512_dpbusd_epi32(d, lv[3], qa_bcast4(q + 12));
                    sumi[r] = _mm512_add_epi32(sumi[r], _mm512_mullo_epi32(sc, d));
                }
            }
        }
        const __m512 d = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)pk));
        QA_UNROLL
        for (int r = 0; r < RA; r++) {
            /* levels are 4 x (value + 32): the reference's sum is sumi / 4 - 32 x corr
             * (sumi is a multiple of 4, so the shift is exact) */
            __m512i t = _mm512_sub_epi32(_mm512_srai_epi32(sumi[r], 2), _mm512_slli_epi32(corr[r], 5));
            acc[r] = _mm512_add_ps(acc[r], _mm512_mul_ps(_mm512_mul_ps(_mm512_set1_ps(ar[r][b].d), d),
                                                         _mm512_cvtepi32_ps(t)));
        }
    }
    QA_UNROLL
    for (int r = 0; r < RA; r++) _mm512_storeu_ps(out + (size_t)r * out_stride, acc[r]);
}

/* Kept out of line (noinline): once qa_mul_mat_kpacked grew its tile, GCC
 * inlined the Q5_K and Q6_K walks into it, and decode ran 5-7% slower (the
 * 30B-A3B shape, whose 255 MB output layer is Q6_K: tg64 74.1-75.2 t/s
 * inlined, 78.7-80.1 out of line, alternated). */
#define QA_KP_WALK(T)                                                                              \
    static __attribute__((noinline)) void qa_##T##_walk_n(int RA, int64_t nb, const uint8_t *pk,   \
                                                          const block_q8_K *const *ar, float *out, size_t os, \
                                                          size_t gn) {                             \
        switch (RA) {                                                                              \
        case 1: qa_##T##_walk(1, nb, pk, ar, out, os, gn); break;                                  \
        case 2: qa_##T##_walk(2, nb, pk, ar, out, os, gn); break;                                  \
        case 3: qa_##T##_walk(3, nb, pk, ar, out, os, gn); break;                                  \
        case 4: qa_##T##_walk(4, nb, pk, ar, out, os, gn); break;                                  \
        case 5: qa_##T##_walk(5, nb, pk, ar, out, os, gn); break;                                  \
        case 6: qa_##T##_walk(6, nb, pk, ar, out, os, gn); break;                                  \
        case 7: qa_##T##_walk(7, nb, pk, ar, out, os, gn); break;                                  \
        default: qa_##T##_walk(8, nb, pk, ar, out, os, gn); break;                                 \
        }                                                                                          \
    }
QA_INLINE void qa_q4k_walk(int RA, int64_t nb, const uint8_t *pk, const block_q8_K *const *ar, float *out,
                           size_t out_stride, size_t gn) {
    qa_q45k_walk(0, RA, nb, pk, ar, out, out_stride, gn);
}
QA_INLINE void qa_q5k_walk(int RA, int64_t nb, const uint8_t *pk, const block_q8_K *const *ar, float *out,
                           size_t out_stride, size_t gn) {
    qa_q45k_walk(1, RA, nb, pk, ar, out, out_stride, gn);
}
QA_KP_WALK(q4k)
QA_KP_WALK(q5k)
QA_KP_WALK(q6k)

/* Rows and activation rows per buffered tile (16 KiB of results). */
#define QA_KP_TILE 64

/* Groups of 16 packed rows x every activation row, QA_KP_ACTS at a time: a
 * group's blocks stay in cache while the activation rows pass over them.
 * With several activation rows the results go to a tile on the stack, copied
 * out row by row at the end: each walk stores one 64-byte piece per
 * activation row, out_stride floats (the matrix's height) apart, and once out
 * outgrew the cache every piece was a store miss of its own. One Zen 5 core, a 3072 x
 * 1024 Q4_K matrix against 512 tokens in 64 x 64 tiles (out 6 MiB): 430-455
 * GFLOP/s storing in place, 560-595 through the tile (590-600 with a small
 * out); Qwen3-0.6B pp512, 2 threads, alternated: Q4_K_M 732-750 -> 827-864
 * t/s, Q5_K_M 692-716 -> 820-834. The Q8_0 / Q4_0 / Q5_0 walks stay as
 * they are: buffering all tiles (in the backend) left Qwen3-0.6B Q8_0's
 * pp512 1.5% slower.
 *
 * The first pass over each group (up to 8 activation rows), if it has
 * three or more, prefetches the next group, each line beside the same line
 * of its own group (gn: the distance; the walks test the row count). The walks prefetch ahead by
 * themselves only with one or two activation rows (decode, where a walk runs
 * at the memory's pace); with more, each group came from memory when its
 * first pass reached it: the hardware prefetchers did not fetch it ahead.
 * Measured on a 2-core Zen 5, 128 expert matrices of 768 x 2048 Q4_K (the
 * 30B-A3B shape's), each against its own activation rows, from memory
 * (scratch program). First the whole next group as a burst, a share per
 * pass: one core, 32 rows 370 -> 530 GFLOP/s (as from cache), 8 rows 189 ->
 * 378, 64 rows 487 -> 562; both cores, 32 rows 716 -> 1042, 4 rows 283 ->
 * 411, 8 rows 349 -> 650; Q6_K 2048 x 768, 32 rows, one core 257 -> 374.
 * But the burst stalled the core (perf: 5% of a batched decode step on the
 * prefetch loop), and line beside line was faster again: both cores, 4 rows
 * 431 -> 707, 8 rows 752 -> 794, 32 rows 982 -> 1148. With one or two rows
 * the burst was no faster (decode alternated in one process: 0.98-1.01).
 * Prefetches never fault, so the ones past a matrix's last group are
 * harmless. */
static void qa_mul_mat_kpacked(uint32_t type, int64_t n, const uint8_t *w, size_t w_stride, int nw, const void *a,
                               size_t a_stride, int na, float *out, size_t out_stride) {
    const int64_t nb = n / QK_K;
    float tile[QA_KP_TILE * QA_KP_TILE];   /* [activation row][weight row] */
    for (int c0 = 0; c0 < nw; c0 += QA_KP_TILE) {
        const int nc = nw - c0 < QA_KP_TILE ? nw - c0 : QA_KP_TILE;
        for (int a0 = 0; a0 < na; a0 += QA_KP_TILE) {
            const int nac = na - a0 < QA_KP_TILE ? na - a0 : QA_KP_TILE, buf = nac > 1;
            float *ot = buf ? tile : out + (size_t)a0 * out_stride + (size_t)c0;
            const size_t os = buf ? QA_KP_TILE : out_stride;
            for (int i0 = 0; i0 < nc; i0 += 16) {
                const uint8_t *pk = w + (size_t)(c0 + i0) * w_stride;
                for (int j0 = 0; j0 < nac; j0 += QA_KP_ACTS) {
                    int RA = nac - j0 < QA_KP_ACTS ? nac - j0 : QA_KP_ACTS;
                    const size_t gn = j0 == 0 ? 16 * w_stride : 0;   /* the first pass fetches the next group */
                    const block_q8_K *ar[QA_KP_ACTS];
                    for (int r = 0; r < RA; r++)
                        ar[r] = (const block_q8_K *)((const uint8_t *)a + (size_t)(a0 + j0 + r) * a_stride);
                    float *o = ot + (size_t)j0 * os + (size_t)i0;
                    if (type == GGML_TYPE_Q4_K) qa_q4k_walk_n(RA, nb, pk, ar, o, os, gn);
                    else if (type == GGML_TYPE_Q5_K) qa_q5k_walk_n(RA, nb, pk, ar, o, os, gn);
                    else qa_q6k_walk_n(RA, nb, pk, ar, o, os, gn);
                }
            }
            if (buf)
                for (int r = 0; r < nac; r++)
                    memcpy(out + (size_t)(a0 + r) * out_stride + (size_t)c0, tile + (size_t)r * QA_KP_TILE,
                           sizeof(float) * (size_t)nc);
        }
    }
}

static int qa_mul_mat_packed(uint32_t wtype, int64_t n, const void *w, size_t w_stride, int nw,
                             const void *a, size_t a_stride, int na, float *out, size_t out_stride) {
    if (nw % 16) return 0;
    switch (wtype) {
    case GGML_TYPE_Q8_0: case GGML_TYPE_Q4_0: case GGML_TYPE_Q5_0:
        qa_mul_mat_r16(wtype, n, w, w_stride, nw, a, a_stride, na, out, out_stride, 1);
        return 1;
    case GGML_TYPE_Q4_K: case GGML_TYPE_Q5_K: case GGML_TYPE_Q6_K:
        qa_mul_mat_kpacked(wtype, n, w, w_stride, nw, a, a_stride, na, out, out_stride);
        return 1;
    default: return 0;
    }
}
#endif

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

#define QA_BUILT 1
#else
#define QA_BUILT 0
#define qa_mul_mat_tile NULL
#define qa_quantize_act_row NULL
#endif

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
    .mul_mat_tile_packed = qa_mul_mat_packed,
#endif
};

/* quant_avx512_kp.h - part of quant_avx2.c where quant_avx512_kp.c builds
 * it (the avx512 set's unit of its own, quant_avx512_parts.h): the packed
 * K-quant products (Q4_K, Q5_K, Q6_K), 16 weight rows across the lanes, and
 * the packed entry point. Not a header of its own: it uses the file's
 * helpers and its includes. */

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

/* The walks for each activation-row count, as NAME (linkage LINK: static,
 * or none for the Q6_K walk, quant_avx512_kp6.c's). Kept out of line
 * (noinline): once qa_mul_mat_kpacked grew its tile, GCC
 * inlined the Q5_K and Q6_K walks into it, and decode ran 5-7% slower (the
 * 30B-A3B shape, whose 255 MB output layer is Q6_K: tg64 74.1-75.2 t/s
 * inlined, 78.7-80.1 out of line, alternated). */
#define QA_KP_WALK(LINK, NAME, T)                                                                  \
    LINK __attribute__((noinline)) void NAME(int RA, int64_t nb, const uint8_t *pk,                \
                                             const block_q8_K *const *ar, float *out, size_t os,   \
                                             size_t gn) {                                          \
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

#if defined(QA_KP6)
#include "quant_avx512_kp6.h"
#else

/* Q4_K's decode prefetch distance, 12 KiB (above; Q6_K's: quant_avx512_kp6.h) */
static volatile const size_t qa_kp_pf_q4k = 12288;

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

QA_INLINE void qa_q4k_walk(int RA, int64_t nb, const uint8_t *pk, const block_q8_K *const *ar, float *out,
                           size_t out_stride, size_t gn) {
    qa_q45k_walk(0, RA, nb, pk, ar, out, out_stride, gn);
}
QA_INLINE void qa_q5k_walk(int RA, int64_t nb, const uint8_t *pk, const block_q8_K *const *ar, float *out,
                           size_t out_stride, size_t gn) {
    qa_q45k_walk(1, RA, nb, pk, ar, out, out_stride, gn);
}
QA_KP_WALK(static, qa_q4k_walk_n, q4k)
QA_KP_WALK(static, qa_q5k_walk_n, q5k)

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
                    else quant_avx512_walk_q6k(RA, nb, pk, ar, o, os, gn);
                }
            }
            if (buf)
                for (int r = 0; r < nac; r++)
                    memcpy(out + (size_t)(a0 + r) * out_stride + (size_t)c0, tile + (size_t)r * QA_KP_TILE,
                           sizeof(float) * (size_t)nc);
        }
    }
}

int quant_avx512_mul_packed(uint32_t wtype, int64_t n, const void *w, size_t w_stride, int nw,
                            const void *a, size_t a_stride, int na, float *out, size_t out_stride) {
    if (nw % 16) return 0;
    switch (wtype) {
    case GGML_TYPE_Q8_0: case GGML_TYPE_Q4_0: case GGML_TYPE_Q5_0:
        quant_avx512_mul_r16(wtype, n, w, w_stride, nw, a, a_stride, na, out, out_stride, 1);
        return 1;
    case GGML_TYPE_Q4_K: case GGML_TYPE_Q5_K: case GGML_TYPE_Q6_K:
        qa_mul_mat_kpacked(wtype, n, w, w_stride, nw, a, a_stride, na, out, out_stride);
        return 1;
    default: return 0;
    }
}
#endif /* QA_KP6 */

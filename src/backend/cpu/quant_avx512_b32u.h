/* quant_avx512_b32u.h - part of quant_avx2.c (included where it builds the
 * avx512 set, QA_ZMM): the Q4_1 / Q5_1 x Q8_1 product with 16 weight rows
 * across the lanes of a zmm register. Not a header of its own: it uses the
 * file's helpers (QA_INLINE, QA_UNROLL, qa_h2f) and its includes. */

/* ==== AVX-512 VNNI: Q4_1 / Q5_1, 16 weight rows across the lanes ====
 * The Q8_0 few-row path's arithmetic (quant_avx512_mul_r16_few) for the
 * formats with a min: per block, each lane (weight row) gets its integer
 * dot whole, then sumf += (d_w d_a) * sumi + m_w * s_a, unfused: the
 * reference's arithmetic, bit for bit, so a row's result does not depend on
 * how many activation rows share the call (a verification step of the
 * speculative decoder gets the logits of the one-row decode). Per block,
 * zmm k holds the low nibbles of rows k, k + 4, k + 8, k + 12 (one 128-bit
 * lane each) and a second their high nibbles; the activation's two halves,
 * each broadcast to the four lanes, meet them with two vpdpbusd into one
 * accumulator, and two levels of unpacks and adds leave one register of the
 * 16 rows' dots in row order (8 vpdpbusd and 9 shuffles and adds per
 * activation row; two rows per zmm needed 21 for their eight-lane sums,
 * and cost 14.8 against 10.5 ms for 8 rows in the measure below). The
 * levels, scales (one gather of d and m) and mins are decoded once per
 * block for up to QA_U16_ACTS activation rows, whose d and s are converted
 * to f32 once per pass (the ymm tile this replaced, one or two weight rows
 * against up to four activation rows, converted them per weight row pair).
 * Each block step prefetches the next 16 rows' bytes, 16 blocks' worth: a
 * sequential stream one group ahead, without which the 16 rows read side by
 * side ran at half the rate (one decode step's Q4_1 matrices of SmolLM2,
 * one thread of a Zen 4, CPU time: 10.6 against 5.2 ms; 4096 bytes further
 * ahead no better). That scratch program (30 layers' q, k, v, o, gate, up,
 * down in their own memory, 64-row calls as backend_cpu.c makes them), CPU
 * ms per step at 1 / 2 / 4 / 8 activation rows, load 10-14: that ymm tile
 * 6.6-7.5 / 9.9-10.2 / 15.0-15.8 / 28.5-28.9, this walk 5.2-5.6 /
 * 5.7-6.2 / 7.1-8.5 / 10.5-10.7; with the weights in cache (one layer's)
 * 6.5 / 8.0 / 13.4 / 26.6 against 3.1 / 4.0 / 6.5 / 10.5. */
#define QA_U16_ACTS 8     /* activation rows per walk: 8 accumulators beside 8 weight registers */
#define QA_U16_MAXB 128   /* blocks per pass: the activations' f32 scales and sums, 8 KiB (stack) */

/* Levels of one block of rows k, k + 4, k + 8, k + 12 (128-bit lane L: row
 * 4L + k): lo[k] their elements 0..15, hi[k] 16..31. Q5_1's fifth bits come
 * from qh (lane j: row j's word): each lane's word to its row's lane, its
 * bytes 0-1 (2-3) spread to the sixteen bytes, and bit e % 8 of byte e tested. */
QA_INLINE void qa_u16_levels(uint32_t T, const uint8_t *const *rp, size_t off, __m512i qh, __m512i *lo, __m512i *hi) {
    const size_t qo = T == GGML_TYPE_Q4_1 ? offsetof(block_q4_1, qs) : offsetof(block_q5_1, qs);
    const __m512i m4 = _mm512_set1_epi8(0xF);
    QA_UNROLL
    for (int k = 0; k < 4; k++) {
        __m512i v = _mm512_castsi128_si512(_mm_loadu_si128((const __m128i *)(rp[k] + off + qo)));
        v = _mm512_inserti32x4(v, _mm_loadu_si128((const __m128i *)(rp[k + 4] + off + qo)), 1);
        v = _mm512_inserti32x4(v, _mm_loadu_si128((const __m128i *)(rp[k + 8] + off + qo)), 2);
        v = _mm512_inserti32x4(v, _mm_loadu_si128((const __m128i *)(rp[k + 12] + off + qo)), 3);
        lo[k] = _mm512_and_si512(v, m4);
        hi[k] = _mm512_and_si512(_mm512_srli_epi16(v, 4), m4);
        if (T == GGML_TYPE_Q5_1) {
            const __m512i bit = _mm512_set1_epi64(0x8040201008040201LL);
            const __m512i sel = _mm512_set_epi32(12 + k, 12 + k, 12 + k, 12 + k, 8 + k, 8 + k, 8 + k, 8 + k,
                                                 4 + k, 4 + k, 4 + k, 4 + k, k, k, k, k);
            __m512i q = _mm512_permutexvar_epi32(sel, qh);
            const __m512i s_lo = _mm512_broadcast_i32x4(_mm_set_epi64x(0x0101010101010101LL, 0));
            const __m512i s_hi = _mm512_broadcast_i32x4(_mm_set_epi64x(0x0303030303030303LL, 0x0202020202020202LL));
            __mmask64 kl = _mm512_test_epi8_mask(_mm512_shuffle_epi8(q, s_lo), bit);
            __mmask64 kh = _mm512_test_epi8_mask(_mm512_shuffle_epi8(q, s_hi), bit);
            lo[k] = _mm512_mask_add_epi8(lo[k], kl, lo[k], _mm512_set1_epi8(16));
            hi[k] = _mm512_mask_add_epi8(hi[k], kh, hi[k], _mm512_set1_epi8(16));
        }
    }
}

/* z[k]: 128-bit lane L holds four partial sums of row 4L + k -> lane i:
 * row i's whole sum. */
QA_INLINE __m512i qa_u16_reduce(const __m512i *z) {
    /* per 128-bit lane: [x0+x2, y0+y2, x1+x3, y1+y3] of the pairs' rows */
    __m512i a0 = _mm512_add_epi32(_mm512_unpacklo_epi32(z[0], z[1]), _mm512_unpackhi_epi32(z[0], z[1]));
    __m512i a1 = _mm512_add_epi32(_mm512_unpacklo_epi32(z[2], z[3]), _mm512_unpackhi_epi32(z[2], z[3]));
    /* per 128-bit lane L: rows 4L, 4L + 1, 4L + 2, 4L + 3 */
    return _mm512_add_epi32(_mm512_unpacklo_epi64(a0, a1), _mm512_unpackhi_epi64(a0, a1));
}

/* nt (1..16) rows from w (the tail's missing rows repeat the last; their
 * lanes are not stored) x RA activation rows (a0, stride as, blocks [b0,
 * b0 + nb)), ds[r]: the activations' f32 d and s, block after block. acc
 * continues from out unless first. Each block step prefetches 16 blocks'
 * bytes of the next 16 rows, a sequential stream one group ahead (pf). */
QA_INLINE void qa_u16_walk(uint32_t T, int RA, int nt, int64_t b0, int64_t nb, const uint8_t *w, size_t w_stride,
                           const uint8_t *a0, size_t as, const float (*ds)[2 * QA_U16_MAXB], int first, float *out,
                           size_t out_stride) {
    const size_t bs = T == GGML_TYPE_Q4_1 ? sizeof(block_q4_1) : sizeof(block_q5_1);
    const __mmask16 keep = (__mmask16)((1u << nt) - 1);
    const uint8_t *rp[16];
    QA_UNROLL
    for (int j = 0; j < 16; j++) rp[j] = w + (size_t)(j < nt ? j : nt - 1) * w_stride + (size_t)b0 * bs;
    const __m512i idx = _mm512_min_epi32(_mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15),
                                         _mm512_set1_epi32(nt - 1));
    const __m512i gidx = _mm512_mullo_epi32(idx, _mm512_set1_epi32((int)w_stride));
    __m512 acc[QA_U16_ACTS];
    QA_UNROLL
    for (int r = 0; r < RA; r++)
        acc[r] = first ? _mm512_setzero_ps() : _mm512_maskz_loadu_ps(keep, out + (size_t)r * out_stride);
    const uint8_t *pf = w + (size_t)16 * w_stride + (size_t)b0 * 16 * bs;
    for (int64_t b = 0; b < nb; b++) {
        const size_t off = (size_t)b * bs;
        QA_UNROLL
        for (size_t l = 0; l < 16 * bs; l += 64) _mm_prefetch((const char *)pf + 16 * off + l, _MM_HINT_T0);
        /* d and m of the 16 rows: one 32-bit word each (Q5_1: qh beside them) */
        __m512i dm = _mm512_i32gather_epi32(gidx, rp[0] + off, 1);
        __m512i qh = T == GGML_TYPE_Q5_1 ? _mm512_i32gather_epi32(gidx, rp[0] + off + offsetof(block_q5_1, qh), 1)
                                         : _mm512_setzero_si512();
        __m512i lo[4], hi[4];
        qa_u16_levels(T, rp, off, qh, lo, hi);
        __m512 wd = _mm512_cvtph_ps(_mm512_cvtepi32_epi16(dm));
        __m512 wm = _mm512_cvtph_ps(_mm512_cvtepi32_epi16(_mm512_srli_epi32(dm, 16)));
        QA_UNROLL
        for (int r = 0; r < RA; r++) {
            const block_q8_1 *y = (const block_q8_1 *)(a0 + (size_t)r * as) + b0 + b;
            __m512i ylo = _mm512_broadcast_i32x4(_mm_loadu_si128((const __m128i *)y->qs));
            __m512i yhi = _mm512_broadcast_i32x4(_mm_loadu_si128((const __m128i *)(y->qs + 16)));
            __m512i z[4];
            QA_UNROLL
            for (int k = 0; k < 4; k++)
                z[k] = _mm512_dpbusd_epi32(_mm512_dpbusd_epi32(_mm512_setzero_si512(), lo[k], ylo), hi[k], yhi);
            __m512 t = _mm512_mul_ps(_mm512_mul_ps(wd, _mm512_set1_ps(ds[r][2 * b])), _mm512_cvtepi32_ps(qa_u16_reduce(z)));
            __m512 u = _mm512_mul_ps(wm, _mm512_set1_ps(ds[r][2 * b + 1]));
            acc[r] = _mm512_add_ps(acc[r], _mm512_add_ps(t, u));
        }
    }
    QA_UNROLL
    for (int r = 0; r < RA; r++) _mm512_mask_storeu_ps(out + (size_t)r * out_stride, keep, acc[r]);
}

#define QA_U16_WALK(TN)                                                                            \
    static void qa_u16_walk_##TN(int RA, int nt, int64_t b0, int64_t nb, const uint8_t *w, size_t ws, \
                                 const uint8_t *a0, size_t as, const float (*ds)[2 * QA_U16_MAXB],   \
                                 int first, float *out, size_t os) {                              \
        const uint32_t T = GGML_TYPE_##TN;                                                         \
        switch (RA) {                                                                              \
        case 1: qa_u16_walk(T, 1, nt, b0, nb, w, ws, a0, as, ds, first, out, os); break;           \
        case 2: qa_u16_walk(T, 2, nt, b0, nb, w, ws, a0, as, ds, first, out, os); break;           \
        case 3: qa_u16_walk(T, 3, nt, b0, nb, w, ws, a0, as, ds, first, out, os); break;           \
        case 4: qa_u16_walk(T, 4, nt, b0, nb, w, ws, a0, as, ds, first, out, os); break;           \
        case 5: qa_u16_walk(T, 5, nt, b0, nb, w, ws, a0, as, ds, first, out, os); break;           \
        case 6: qa_u16_walk(T, 6, nt, b0, nb, w, ws, a0, as, ds, first, out, os); break;           \
        case 7: qa_u16_walk(T, 7, nt, b0, nb, w, ws, a0, as, ds, first, out, os); break;           \
        default: qa_u16_walk(T, 8, nt, b0, nb, w, ws, a0, as, ds, first, out, os); break;          \
        }                                                                                          \
    }
QA_U16_WALK(Q4_1)
QA_U16_WALK(Q5_1)

/* All nw rows (groups of 16, the last one masked) x na activation rows,
 * QA_U16_ACTS of them per walk and QA_U16_MAXB blocks per pass. */
static void qa_mul_mat_u16(uint32_t type, int64_t n, const uint8_t *w, size_t w_stride, int nw, const uint8_t *a,
                           size_t a_stride, int na, float *out, size_t out_stride) {
    void (*walk)(int, int, int64_t, int64_t, const uint8_t *, size_t, const uint8_t *, size_t,
                 const float (*)[2 * QA_U16_MAXB], int, float *, size_t) =
        type == GGML_TYPE_Q4_1 ? qa_u16_walk_Q4_1 : qa_u16_walk_Q5_1;
    const int64_t nbt = n / 32;
    float ds[QA_U16_ACTS][2 * QA_U16_MAXB];
    if (nbt == 0) {
        for (int j = 0; j < na; j++)
            for (int i = 0; i < nw; i++) out[(size_t)j * out_stride + (size_t)i] = 0.0f;
        return;
    }
    for (int j0 = 0; j0 < na; j0 += QA_U16_ACTS) {
        const int RA = na - j0 < QA_U16_ACTS ? na - j0 : QA_U16_ACTS;
        const uint8_t *a0 = a + (size_t)j0 * a_stride;
        for (int64_t b0 = 0; b0 < nbt; b0 += QA_U16_MAXB) {
            const int64_t nb = nbt - b0 < QA_U16_MAXB ? nbt - b0 : QA_U16_MAXB;
            qa_b32u_scales(a0, a_stride, RA, b0, nb, &ds[0][0], 2 * QA_U16_MAXB);
            for (int i0 = 0; i0 < nw; i0 += 16)
                walk(RA, nw - i0 < 16 ? nw - i0 : 16, b0, nb, w + (size_t)i0 * w_stride, w_stride, a0, a_stride,
                     (const float (*)[2 * QA_U16_MAXB])ds, b0 == 0, out + (size_t)j0 * out_stride + (size_t)i0,
                     out_stride);
        }
    }
}

/* quant_avx2_b32u.h - part of quant_avx2.c (included where it builds the
 * avx2 and avxvnni sets): the Q4_1 / Q5_1 x Q8_1 product with 8 weight rows
 * across the lanes of a ymm register. Not a header of its own: it uses the
 * file's helpers (QA_INLINE, QA_UNROLL, QA_VNNI) and its includes. */

/* ==== AVX2: Q4_1 / Q5_1, 8 weight rows across the lanes ====
 * quant_avx512_b32u.h's walk at half the width: per block, ymm k holds the
 * low nibbles of rows k and k + 4 (one 128-bit lane each) and a second their
 * high nibbles; the activation's halves, each broadcast to both lanes, meet
 * them in one accumulator (vpdpbusd with AVX-VNNI; else maddubs, the two
 * halves' int16 pair sums added, at most 2 x 2 x 31 x 127 < 32767, and one
 * madd), three hadds leave the 8 rows' dots in row order, and each lane
 * accumulates sumf += (d_w d_a) * sumi + m_w * s_a unfused: the reference's
 * arithmetic bit for bit, as on the avx512 set. It replaced a tile of one
 * or two weight rows (one per activation row and weight row: a dot, a
 * convert, an fma and a scalar min term per block): the scratch program of
 * docs/bench.md ("Q4_1 / Q5_1 few-row products"), avx2 set on a Zen 4,
 * CPU ms at 1 / 2 / 4 / 8 activation rows, load 11-13: Q4_1 7.0 / 10.9 /
 * 17.5 / 32.5 -> 4.6 / 5.9 / 8.7 / 16.8, Q5_1 8.6 / 12.9 / 18.8 / 36.2 ->
 * 7.6 / 8.6 / 11.4 / 22.1. */
#define QA_U8_ACTS 4      /* activation rows per walk (16 ymm registers) */
#define QA_U8_MAXB 128    /* blocks per pass: the activations' f32 scales and sums, 4 KiB (stack) */

/* Levels of one block of rows k and k + 4 (128-bit lanes 0, 1): lo[k] their
 * elements 0..15, hi[k] 16..31; Q5_1's fifth bits from qh (lane j: row j's
 * word), its bytes 0-1 (2-3) spread to the sixteen bytes, bit e % 8 of byte
 * e tested. */
QA_INLINE void qa_u8_levels(uint32_t T, const uint8_t *const *rp, size_t off, __m256i qh, __m256i *lo, __m256i *hi) {
    const size_t qo = T == GGML_TYPE_Q4_1 ? offsetof(block_q4_1, qs) : offsetof(block_q5_1, qs);
    const __m256i m4 = _mm256_set1_epi8(0xF);
    QA_UNROLL
    for (int k = 0; k < 4; k++) {
        __m256i v = _mm256_inserti128_si256(_mm256_castsi128_si256(_mm_loadu_si128((const __m128i *)(rp[k] + off + qo))),
                                            _mm_loadu_si128((const __m128i *)(rp[k + 4] + off + qo)), 1);
        lo[k] = _mm256_and_si256(v, m4);
        hi[k] = _mm256_and_si256(_mm256_srli_epi16(v, 4), m4);
        if (T == GGML_TYPE_Q5_1) {
            const __m256i bit = _mm256_set1_epi64x(0x8040201008040201LL), five = _mm256_set1_epi8(0x10);
            const __m256i s_lo = _mm256_setr_epi64x(0, 0x0101010101010101LL, 0, 0x0101010101010101LL);
            const __m256i s_hi = _mm256_setr_epi64x(0x0202020202020202LL, 0x0303030303030303LL,
                                                    0x0202020202020202LL, 0x0303030303030303LL);
            __m256i q = _mm256_permutevar8x32_epi32(qh, _mm256_setr_epi32(k, k, k, k, k + 4, k + 4, k + 4, k + 4));
            __m256i bl = _mm256_and_si256(_mm256_shuffle_epi8(q, s_lo), bit);
            __m256i bh = _mm256_and_si256(_mm256_shuffle_epi8(q, s_hi), bit);
            lo[k] = _mm256_or_si256(lo[k], _mm256_and_si256(_mm256_cmpeq_epi8(bl, bit), five));
            hi[k] = _mm256_or_si256(hi[k], _mm256_and_si256(_mm256_cmpeq_epi8(bh, bit), five));
        }
    }
}

/* four int32 partial sums per 128-bit lane of lo . ylo + hi . yhi */
QA_INLINE __m256i qa_u8_dot(__m256i lo, __m256i ylo, __m256i hi, __m256i yhi) {
#if defined(QA_VNNI)
    return qa_dot_u8s8(qa_dot_u8s8(_mm256_setzero_si256(), lo, ylo), hi, yhi);
#else
    __m256i p = _mm256_add_epi16(_mm256_maddubs_epi16(lo, ylo), _mm256_maddubs_epi16(hi, yhi));
    return _mm256_madd_epi16(p, _mm256_set1_epi16(1));
#endif
}

/* nt (1..8) rows from w (the tail's missing rows repeat the last; their
 * lanes are not stored) x RA activation rows (a0, stride as, blocks [b0,
 * b0 + nb)), ds[r]: the activations' f32 d and s, block after block. acc
 * continues from out unless first. Each block step prefetches the next 8
 * rows' bytes, 8 blocks' worth: a sequential stream one group ahead. */
QA_INLINE void qa_u8_walk(uint32_t T, int RA, int nt, int64_t b0, int64_t nb, const uint8_t *w, size_t w_stride,
                          const uint8_t *a0, size_t as, const float (*ds)[2 * QA_U8_MAXB], int first, float *out,
                          size_t out_stride) {
    const size_t bs = T == GGML_TYPE_Q4_1 ? sizeof(block_q4_1) : sizeof(block_q5_1);
    const __m256i lane = _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7);
    const __m256i keep = _mm256_cmpgt_epi32(_mm256_set1_epi32(nt), lane);
    const uint8_t *rp[8];
    QA_UNROLL
    for (int j = 0; j < 8; j++) rp[j] = w + (size_t)(j < nt ? j : nt - 1) * w_stride + (size_t)b0 * bs;
    const __m256i gidx = _mm256_mullo_epi32(_mm256_min_epi32(lane, _mm256_set1_epi32(nt - 1)),
                                            _mm256_set1_epi32((int)w_stride));
    /* d (bytes 0-1 of each word) to the low 128 bits, m (2-3) to the high */
    const __m256i dsel = _mm256_setr_epi8(0, 1, 4, 5, 8, 9, 12, 13, 2, 3, 6, 7, 10, 11, 14, 15,
                                          0, 1, 4, 5, 8, 9, 12, 13, 2, 3, 6, 7, 10, 11, 14, 15);
    __m256 acc[QA_U8_ACTS];
    QA_UNROLL
    for (int r = 0; r < RA; r++)
        acc[r] = first ? _mm256_setzero_ps() : _mm256_maskload_ps(out + (size_t)r * out_stride, keep);
    const uint8_t *pf = w + (size_t)8 * w_stride + (size_t)b0 * 8 * bs;
    for (int64_t b = 0; b < nb; b++) {
        const size_t off = (size_t)b * bs;
        QA_UNROLL
        for (size_t l = 0; l < 8 * bs; l += 64) _mm_prefetch((const char *)pf + 8 * off + l, _MM_HINT_T0);
        __m256i dm = _mm256_i32gather_epi32((const int *)(rp[0] + off), gidx, 1);
        __m256i qh = T == GGML_TYPE_Q5_1 ? _mm256_i32gather_epi32((const int *)(rp[0] + off + offsetof(block_q5_1, qh)), gidx, 1)
                                         : _mm256_setzero_si256();
        __m256i lo[4], hi[4];
        qa_u8_levels(T, rp, off, qh, lo, hi);
        __m256i h = _mm256_permute4x64_epi64(_mm256_shuffle_epi8(dm, dsel), _MM_SHUFFLE(3, 1, 2, 0));
        __m256 wd = _mm256_cvtph_ps(_mm256_castsi256_si128(h));
        __m256 wm = _mm256_cvtph_ps(_mm256_extracti128_si256(h, 1));
        QA_UNROLL
        for (int r = 0; r < RA; r++) {
            const block_q8_1 *y = (const block_q8_1 *)(a0 + (size_t)r * as) + b0 + b;
            __m256i ylo = _mm256_broadcastsi128_si256(_mm_loadu_si128((const __m128i *)y->qs));
            __m256i yhi = _mm256_broadcastsi128_si256(_mm_loadu_si128((const __m128i *)(y->qs + 16)));
            __m256i z[4];
            QA_UNROLL
            for (int k = 0; k < 4; k++) z[k] = qa_u8_dot(lo[k], ylo, hi[k], yhi);
            /* per 128-bit lane L: rows 4L .. 4L + 3 */
            __m256i s = _mm256_hadd_epi32(_mm256_hadd_epi32(z[0], z[1]), _mm256_hadd_epi32(z[2], z[3]));
            __m256 t = _mm256_mul_ps(_mm256_mul_ps(wd, _mm256_set1_ps(ds[r][2 * b])), _mm256_cvtepi32_ps(s));
            __m256 u = _mm256_mul_ps(wm, _mm256_set1_ps(ds[r][2 * b + 1]));
            acc[r] = _mm256_add_ps(acc[r], _mm256_add_ps(t, u));
        }
    }
    QA_UNROLL
    for (int r = 0; r < RA; r++) _mm256_maskstore_ps(out + (size_t)r * out_stride, keep, acc[r]);
}

#define QA_U8_WALK(TN)                                                                             \
    static void qa_u8_walk_##TN(int RA, int nt, int64_t b0, int64_t nb, const uint8_t *w, size_t ws, \
                                const uint8_t *a0, size_t as, const float (*ds)[2 * QA_U8_MAXB],    \
                                int first, float *out, size_t os) {                               \
        const uint32_t T = GGML_TYPE_##TN;                                                         \
        switch (RA) {                                                                              \
        case 1: qa_u8_walk(T, 1, nt, b0, nb, w, ws, a0, as, ds, first, out, os); break;            \
        case 2: qa_u8_walk(T, 2, nt, b0, nb, w, ws, a0, as, ds, first, out, os); break;            \
        case 3: qa_u8_walk(T, 3, nt, b0, nb, w, ws, a0, as, ds, first, out, os); break;            \
        default: qa_u8_walk(T, 4, nt, b0, nb, w, ws, a0, as, ds, first, out, os); break;           \
        }                                                                                          \
    }
QA_U8_WALK(Q4_1)
QA_U8_WALK(Q5_1)

/* All nw rows (groups of 8, the last one masked) x na activation rows,
 * QA_U8_ACTS of them per walk and QA_U8_MAXB blocks per pass. */
static void qa_mul_mat_u8(uint32_t type, int64_t n, const uint8_t *w, size_t w_stride, int nw, const uint8_t *a,
                          size_t a_stride, int na, float *out, size_t out_stride) {
    void (*walk)(int, int, int64_t, int64_t, const uint8_t *, size_t, const uint8_t *, size_t,
                 const float (*)[2 * QA_U8_MAXB], int, float *, size_t) =
        type == GGML_TYPE_Q4_1 ? qa_u8_walk_Q4_1 : qa_u8_walk_Q5_1;
    const int64_t nbt = n / 32;
    float ds[QA_U8_ACTS][2 * QA_U8_MAXB];
    if (nbt == 0) {
        for (int j = 0; j < na; j++)
            for (int i = 0; i < nw; i++) out[(size_t)j * out_stride + (size_t)i] = 0.0f;
        return;
    }
    for (int j0 = 0; j0 < na; j0 += QA_U8_ACTS) {
        const int RA = na - j0 < QA_U8_ACTS ? na - j0 : QA_U8_ACTS;
        const uint8_t *a0 = a + (size_t)j0 * a_stride;
        for (int64_t b0 = 0; b0 < nbt; b0 += QA_U8_MAXB) {
            const int64_t nb = nbt - b0 < QA_U8_MAXB ? nbt - b0 : QA_U8_MAXB;
            qa_b32u_scales(a0, a_stride, RA, b0, nb, &ds[0][0], 2 * QA_U8_MAXB);
            for (int i0 = 0; i0 < nw; i0 += 8)
                walk(RA, nw - i0 < 8 ? nw - i0 : 8, b0, nb, w + (size_t)i0 * w_stride, w_stride, a0, a_stride,
                     (const float (*)[2 * QA_U8_MAXB])ds, b0 == 0, out + (size_t)j0 * out_stride + (size_t)i0,
                     out_stride);
        }
    }
}

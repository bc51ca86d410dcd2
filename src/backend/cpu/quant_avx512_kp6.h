/* quant_avx512_kp6.h - part of quant_avx2.c where quant_avx512_kp6.c builds
 * it (through quant_avx512_kp.h, QA_KP6; quant_avx512_parts.h): the packed
 * Q6_K walk, 16 weight rows across the lanes, for quant_avx512_kp.c's tiles.
 * A unit of its own: with the Q4_K / Q5_K walks, the one unit of packed
 * K-quants was most of the avx512 set's compile time under ASan+UBSan. */

/* Q6_K's decode prefetch distance: four super-blocks, 13 KiB (quant_avx512_kp.h) */
static volatile const size_t qa_kp_pf_q6k = 4 * QA_Q6KP_BLOCK;

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

QA_KP_WALK(, quant_avx512_walk_q6k, q6k)

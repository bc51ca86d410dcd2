/* quant_avx512_r16.h - part of quant_avx2.c where quant_avx512_r16.c
 * builds it (the avx512 set's unit of its own, quant_avx512_parts.h): the Q8_0 / Q4_0 / Q5_0 products with 16 weight rows
 * across the lanes of a zmm register, from rows gathered per call or from
 * the packed layout (quant_pack.c). Not a header of its own: it uses the
 * file's helpers (QA_INLINE, QA_UNROLL, qa_h2f, ...) and its includes. */

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
/* QA_R16_MIN: quant_avx512_parts.h */
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
        if (RA > 2 && gn)   /* the next group's block (quant_avx512_mul_r16); RA <= 2 prefetches ahead above */
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
void quant_avx512_mul_r16_few(int64_t n, const uint8_t *w, size_t w_stride, int nw16, const void *a,
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
void quant_avx512_mul_r16(uint32_t type, int64_t n, const uint8_t *w, size_t w_stride, int nw16, const void *a,
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

/* quant_pack.c - packed weights (quant.h): 16 rows interleaved per block so
 * that one vector load gives each lane its row's bytes, packing and
 * unpacking, and the packed product (the active set's, else the reference
 * from the packed layout). */

#include "engine/quant.h"
#include "engine/quant_kernels.h"

#include <stddef.h>
#include <string.h>

#include "engine/quant_internal.h"

/* ==== Packed weights ====
 * Layouts (quant.h gives Q8_0's). A "run" is 64 bytes: 4 bytes of each of the
 * 16 rows in row order, so one zmm load gives each lane its row's bytes.
 * Q4_0, per block (288 bytes = 16 x 18): d x16 (fp16), then 4 runs of qs
 *   (run g: qs[4g .. 4g + 3]). Q5_0 (352 = 16 x 22): d x16, one run of the
 *   4 qh bytes, 4 runs of qs.
 * Q4_K, per super-block (2304 bytes = 16 x 144): d x16 (fp16), dmin x16,
 *   3 runs of the 12 scale bytes (run t: bytes 4t..4t+3), then 32 runs of qs
 *   (run 8c + g: qs[32c + 4g .. +3]; low nibbles are sub-block 2c, high 2c+1).
 * Q5_K (2816 = 16 x 176): Q4_K's d, dmin and scale runs, then 8 runs of qh
 *   (run g: qh[4g .. 4g + 3]; bit j is the fifth bit of sub-block j's
 *   element), then Q4_K's 32 runs of qs.
 * Q6_K, per super-block (3360 bytes = 16 x 210): d x16, 4 runs of the 16 int8
 *   scales, then 3 runs per sub-block s of 16 elements (run 3s + t, t < 3,
 *   byte k: level 16s + 4t + k in bits 2-7, and bits 2t, 2t + 1 of level
 *   16s + 12 + k in bits 0-1). Levels are 0..63 (value + 32). A kernel gets
 *   each level times 4 with one AND (0xFC) for the first three quads of a
 *   sub-block, and the fourth quad's from the three runs' low bit pairs:
 *   the nibble-and-high-bits layout of the file took about twice the
 *   instructions per level. */
#define QUANT_RUN (QUANT_PACK_ROWS * 4)

static size_t quant_pack_block_bytes(uint32_t wtype) {
    switch (wtype) {
    case GGML_TYPE_Q8_0: return sizeof(block_q8_0);
    case GGML_TYPE_Q4_0: return sizeof(block_q4_0);
    case GGML_TYPE_Q5_0: return sizeof(block_q5_0);
    case GGML_TYPE_Q4_K: return sizeof(block_q4_K);
    case GGML_TYPE_Q5_K: return sizeof(block_q5_K);
    case GGML_TYPE_Q6_K: return sizeof(block_q6_K);
    default: return 0;
    }
}

int quant_pack_pays(uint32_t wtype) {
    const quant_kset *k = quant_kset_get();
    return quant_pack_block_bytes(wtype) && k->mul_mat_tile_packed && wtype < 64 &&
           (k->packed_types >> wtype & 1);
}

static inline void quant_q6_K_set(block_q6_K *b, int e, int v) {
    int half = e / 128, g = (e % 128) / 32, l = e % 32;
    uint8_t *ql = b->ql + 64 * half + ((g & 1) ? 32 : 0), *qh = b->qh + 32 * half;
    ql[l] |= (uint8_t)((g & 2) ? (v & 0xF) << 4 : (v & 0xF));
    qh[l] |= (uint8_t)(((v >> 4) & 3) << (2 * g));
}

/* one block of row r (plain) <-> its place in the packed block p */
static void quant_pack_block(uint32_t wtype, const void *blk, int r, uint8_t *p) {
    if (wtype == GGML_TYPE_Q8_0) {
        const block_q8_0 *x = blk;
        memcpy(p + 2 * r, &x->d, 2);
        for (int k = 0; k < 8; k++) {
            uint32_t v;
            memcpy(&v, x->qs + 4 * k, 4);
            v ^= 0x80808080u;
            memcpy(p + 32 + QUANT_RUN * k + 4 * r, &v, 4);
        }
    } else if (wtype == GGML_TYPE_Q4_0) {
        const block_q4_0 *x = blk;
        memcpy(p + 2 * r, &x->d, 2);
        for (int g = 0; g < 4; g++) memcpy(p + 32 + QUANT_RUN * g + 4 * r, x->qs + 4 * g, 4);
    } else if (wtype == GGML_TYPE_Q5_0) {
        const block_q5_0 *x = blk;
        memcpy(p + 2 * r, &x->d, 2);
        memcpy(p + 32 + 4 * r, x->qh, 4);
        for (int g = 0; g < 4; g++) memcpy(p + 96 + QUANT_RUN * g + 4 * r, x->qs + 4 * g, 4);
    } else if (wtype == GGML_TYPE_Q4_K || wtype == GGML_TYPE_Q5_K) {
        /* both blocks start d, dmin, scales[12]; Q5_K's qh runs come before the qs runs */
        const uint8_t *x = blk;
        const int q5 = wtype == GGML_TYPE_Q5_K;
        const size_t qs = q5 ? offsetof(block_q5_K, qs) : offsetof(block_q4_K, qs);
        memcpy(p + 2 * r, x + offsetof(block_q4_K, d), 2);
        memcpy(p + 32 + 2 * r, x + offsetof(block_q4_K, dmin), 2);
        for (int t = 0; t < 3; t++) memcpy(p + 64 + QUANT_RUN * t + 4 * r, x + offsetof(block_q4_K, scales) + 4 * t, 4);
        for (int g = 0; q5 && g < 8; g++) memcpy(p + 256 + QUANT_RUN * g + 4 * r, x + offsetof(block_q5_K, qh) + 4 * g, 4);
        for (int k = 0; k < 32; k++) memcpy(p + (q5 ? 768 : 256) + QUANT_RUN * k + 4 * r, x + qs + 4 * k, 4);
    } else {
        const block_q6_K *x = blk;
        memcpy(p + 2 * r, &x->d, 2);
        for (int q = 0; q < 4; q++) memcpy(p + 32 + QUANT_RUN * q + 4 * r, x->scales + 4 * q, 4);
        /* one call per element made packing a Q6_K matrix 4-5 times slower
         * than the other types (0.45 GB/s a core) */
        uint8_t lv[QK_K];
        quant_q6_K_levels(x, lv);
        for (int sb = 0; sb < 16; sb++)
            for (int k = 0; k < 4; k++) {
                int d = lv[16 * sb + 12 + k];
                for (int t = 0; t < 3; t++)
                    p[288 + QUANT_RUN * (3 * sb + t) + 4 * r + k] =
                        (uint8_t)(lv[16 * sb + 4 * t + k] << 2 | (d >> (2 * t) & 3));
            }
    }
}

static void quant_unpack_block(uint32_t wtype, const uint8_t *p, int r, void *blk) {
    if (wtype == GGML_TYPE_Q8_0) {
        block_q8_0 *y = blk;
        memcpy(&y->d, p + 2 * r, 2);
        for (int k = 0; k < 8; k++)
            for (int e = 0; e < 4; e++) y->qs[4 * k + e] = (int8_t)(p[32 + QUANT_RUN * k + 4 * r + e] ^ 0x80u);
    } else if (wtype == GGML_TYPE_Q4_0) {
        block_q4_0 *y = blk;
        memcpy(&y->d, p + 2 * r, 2);
        for (int g = 0; g < 4; g++) memcpy(y->qs + 4 * g, p + 32 + QUANT_RUN * g + 4 * r, 4);
    } else if (wtype == GGML_TYPE_Q5_0) {
        block_q5_0 *y = blk;
        memcpy(&y->d, p + 2 * r, 2);
        memcpy(y->qh, p + 32 + 4 * r, 4);
        for (int g = 0; g < 4; g++) memcpy(y->qs + 4 * g, p + 96 + QUANT_RUN * g + 4 * r, 4);
    } else if (wtype == GGML_TYPE_Q4_K || wtype == GGML_TYPE_Q5_K) {
        uint8_t *y = blk;
        const int q5 = wtype == GGML_TYPE_Q5_K;
        const size_t qs = q5 ? offsetof(block_q5_K, qs) : offsetof(block_q4_K, qs);
        memcpy(y + offsetof(block_q4_K, d), p + 2 * r, 2);
        memcpy(y + offsetof(block_q4_K, dmin), p + 32 + 2 * r, 2);
        for (int t = 0; t < 3; t++) memcpy(y + offsetof(block_q4_K, scales) + 4 * t, p + 64 + QUANT_RUN * t + 4 * r, 4);
        for (int g = 0; q5 && g < 8; g++) memcpy(y + offsetof(block_q5_K, qh) + 4 * g, p + 256 + QUANT_RUN * g + 4 * r, 4);
        for (int k = 0; k < 32; k++) memcpy(y + qs + 4 * k, p + (q5 ? 768 : 256) + QUANT_RUN * k + 4 * r, 4);
    } else {
        block_q6_K *y = blk;
        memset(y, 0, sizeof *y);
        memcpy(&y->d, p + 2 * r, 2);
        for (int q = 0; q < 4; q++) memcpy(y->scales + 4 * q, p + 32 + QUANT_RUN * q + 4 * r, 4);
        for (int sb = 0; sb < 16; sb++)
            for (int k = 0; k < 4; k++) {
                int d = 0;
                for (int t = 0; t < 3; t++) {
                    int v = p[288 + QUANT_RUN * (3 * sb + t) + 4 * r + k];
                    quant_q6_K_set(y, 16 * sb + 4 * t + k, v >> 2);
                    d |= (v & 3) << (2 * t);
                }
                quant_q6_K_set(y, 16 * sb + 12 + k, d);
            }
    }
}

int quant_pack_rows(uint32_t wtype, const void *src, size_t row_bytes, int64_t n_rows, void *dst) {
    size_t bs = quant_pack_block_bytes(wtype);
    if (!bs || n_rows % QUANT_PACK_ROWS || row_bytes % bs) return -1;
    const size_t group = QUANT_PACK_ROWS * row_bytes, pb = QUANT_PACK_ROWS * bs;
    const int64_t nb = (int64_t)(row_bytes / bs);
    for (int64_t g = 0; g < n_rows / QUANT_PACK_ROWS; g++)
        for (int r = 0; r < QUANT_PACK_ROWS; r++)
            for (int64_t b = 0; b < nb; b++)
                quant_pack_block(wtype, (const uint8_t *)src + (size_t)g * group + (size_t)r * row_bytes + (size_t)b * bs, r,
                                 (uint8_t *)dst + (size_t)g * group + (size_t)b * pb);
    return 0;
}

void quant_unpack_row(uint32_t wtype, const void *group, size_t row_bytes, int lane, void *dst) {
    size_t bs = quant_pack_block_bytes(wtype);
    if (!bs) return;
    for (size_t b = 0; b < row_bytes / bs; b++)
        quant_unpack_block(wtype, (const uint8_t *)group + b * QUANT_PACK_ROWS * bs, lane, (uint8_t *)dst + b * bs);
}

/* The reference straight from the packed layout: each block unpacked and
 * dotted alone, the block terms summed in order as quant_ref_vec_dot does
 * (0 + t is t for every t the sum can meet, so the result is the same bits). */
static void quant_ref_mul_mat_packed(uint32_t wtype, int64_t n, const uint8_t *w, size_t w_stride, int nw,
                                     const void *a, size_t a_stride, int na, float *out, size_t out_stride) {
    const size_t bs = quant_pack_block_bytes(wtype);
    const uint32_t at = quant_vec_dot_type(wtype);
    const int64_t qk = at == GGML_TYPE_Q8_0 ? QK8_0 : QK_K, nb = n / qk;
    const size_t abs = at == GGML_TYPE_Q8_0 ? sizeof(block_q8_0) : sizeof(block_q8_K);
    _Alignas(8) uint8_t blk[sizeof(block_q6_K) > sizeof(block_q4_K) ? sizeof(block_q6_K) : sizeof(block_q4_K)];
    for (int j = 0; j < na; j++) {
        const uint8_t *y = (const uint8_t *)a + (size_t)j * a_stride;
        for (int i = 0; i < nw; i++) {
            const uint8_t *g = w + (size_t)(i / QUANT_PACK_ROWS) * QUANT_PACK_ROWS * w_stride;
            float sumf = 0.0f;
            for (int64_t b = 0; b < nb; b++) {
                float t;
                quant_unpack_block(wtype, g + (size_t)b * QUANT_PACK_ROWS * bs, i % QUANT_PACK_ROWS, blk);
                quant_ref_vec_dot(wtype, qk, &t, blk, y + (size_t)b * abs);
                sumf += t;
            }
            out[(size_t)j * out_stride + (size_t)i] = sumf;
        }
    }
}

void quant_mul_mat_tile_packed(uint32_t wtype, int64_t n, const void *w, size_t w_stride, int nw,
                               const void *a, size_t a_stride, int na, float *out, size_t out_stride) {
    if (nw <= 0 || na <= 0 || !quant_pack_block_bytes(wtype)) return;
    const quant_kset *k = quant_kset_get();
    if (k->mul_mat_tile_packed && k->mul_mat_tile_packed(wtype, n, w, w_stride, nw, a, a_stride, na, out, out_stride))
        return;
    quant_ref_mul_mat_packed(wtype, n, w, w_stride, nw, a, a_stride, na, out, out_stride);
}

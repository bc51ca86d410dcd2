/* cuda_attention.cu - causal GQA attention over the device KV mirrors.
 *
 * Flash-attention style: keys are visited in tiles with an online softmax
 * (running max m, running sum l, output rescaled when m grows), so memory is
 * O(tile), never O(positions^2), and a long prompt needs no score buffer.
 *
 * A block serves one KV head, R consecutive query rows of one sequence and
 * up to CU_ATT_GCHUNK of the query heads that share that KV head; each warp
 * owns one (row, query head). The block decodes a tile of KT cache rows of
 * K and V (F16, BF16 or Q8_0) into shared memory once for all its warps;
 * rows are padded to hd + 1 floats so that lane j reading key j and lanes
 * reading consecutive dims of one V row are both free of bank conflicts.
 * Lane j computes the score of key j of the tile; the warp then takes the
 * tile's max and sum with shuffles, and each lane accumulates the dims
 * lane, lane + 32, ... of the output.
 *
 * Scores are dot * scale in f32 against the dequantized cache, as the CPU
 * backend computes them for F16/BF16 caches (for a Q8_0 cache the CPU
 * backend quantizes q to Q8_0 first; this kernel does not).
 *
 * Not yet done (docs/architecture.md): tensor-core tiles (mma) for long
 * prompts, and splitting long contexts over several blocks for decode.
 */
#include <stdlib.h>

#include "cuda_internal.h"

#define CU_ATT_MAX_HD 512          /* model.c refuses larger heads */
#define CU_ATT_GCHUNK 16           /* query heads of one group per block */
#define CU_ATT_WARPS 8             /* target (row, head) pairs per block */
#define CU_ATT_SMEM (48 * 1024)    /* dynamic shared memory without opting in */

typedef struct { int seq, r0; } cu_attn_blk;

template <uint32_t DT>
__global__ void k_attn(const float *q, const cu_attn_seq *seqs, const cu_attn_blk *blks, int R, int gchunk,
                       int n_head, int n_head_kv, int hd, size_t rb, float scale, int KT, float *out) {
    extern __shared__ float sm[];
    const int grp = n_head / n_head_kv, kvh = blockIdx.y, stride = hd + 1;
    const cu_attn_blk bk = blks[blockIdx.x];
    const cu_attn_seq sq = seqs[bk.seq];
    const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
    const int r = bk.r0 + warp / gchunk, g = blockIdx.z * gchunk + warp % gchunk;
    const bool active = r < sq.n && g < grp;
    const int qpos = sq.pos0 + r, h = kvh * grp + g;
    const size_t row = (size_t)(sq.t0 + r);
    float *Ks = sm, *Vs = Ks + KT * stride, *Qs = Vs + KT * stride + warp * hd;
    if (active)
        for (int d = lane; d < hd; d += 32) Qs[d] = q[(row * n_head + h) * hd + d];
    const int rlast = (bk.r0 + R < sq.n ? bk.r0 + R : sq.n) - 1;
    const int npos = sq.pos0 + rlast + 1;   /* the block's last row sees the most keys */
    float m = -INFINITY, l = 0.0f, acc[CU_ATT_MAX_HD / 32];
#pragma unroll
    for (int i = 0; i < CU_ATT_MAX_HD / 32; i++) acc[i] = 0.0f;
    for (int p0 = 0; p0 < npos; p0 += KT) {
        const int kt = npos - p0 < KT ? npos - p0 : KT;
        __syncthreads();   /* everyone is done with the previous tile */
        for (int i = threadIdx.x; i < kt * hd; i += blockDim.x) {
            int j = i / hd, d = i - j * hd;
            size_t ro = (size_t)(p0 + j) * rb;
            Ks[j * stride + d] = cu_kv_get<DT>(sq.k + ro, kvh * hd + d);
            Vs[j * stride + d] = cu_kv_get<DT>(sq.v + ro, kvh * hd + d);
        }
        __syncthreads();
        if (!active || p0 > qpos) continue;   /* warp-uniform */
        float s = -INFINITY;
        if (lane < kt && p0 + lane <= qpos) {
            const float *kr = Ks + lane * stride;
            float dot = 0.0f;
            for (int d = 0; d < hd; d++) dot += Qs[d] * kr[d];
            s = dot * scale;
        }
        float mt = s;
        for (int o = 16; o > 0; o >>= 1) mt = fmaxf(mt, __shfl_xor_sync(0xffffffffu, mt, o));
        const float mnew = fmaxf(m, mt);           /* finite: key p0 <= qpos is in this tile */
        const float p = s == -INFINITY ? 0.0f : expf(s - mnew);
        const float corr = m == -INFINITY ? 0.0f : expf(m - mnew);
        float ps = p;
        for (int o = 16; o > 0; o >>= 1) ps += __shfl_xor_sync(0xffffffffu, ps, o);
        l = l * corr + ps;
#pragma unroll
        for (int i = 0; i < CU_ATT_MAX_HD / 32; i++) acc[i] *= corr;
        for (int j = 0; j < kt; j++) {
            const float pj = __shfl_sync(0xffffffffu, p, j);
            const float *vr = Vs + j * stride;
#pragma unroll
            for (int i = 0; i < CU_ATT_MAX_HD / 32; i++) {
                int d = lane + 32 * i;
                if (d < hd) acc[i] += pj * vr[d];
            }
        }
        m = mnew;
    }
    if (active) {
        float il = 1.0f / l;
#pragma unroll
        for (int i = 0; i < CU_ATT_MAX_HD / 32; i++) {
            int d = lane + 32 * i;
            if (d < hd) out[(row * n_head + h) * hd + d] = acc[i] * il;
        }
    }
}

int cu_launch_attention(cu_impl *c, uint32_t dt, const float *q, const cu_attn_seq *seqs, int n_seq, int n_head,
                        int n_head_kv, int hd, size_t rb, float scale, float *out) {
    if (hd < 1 || hd > CU_ATT_MAX_HD) return cu_check(c, cudaErrorInvalidValue, "attention (head size above 512)");
    const int grp = n_head / n_head_kv;
    const int gchunk = grp < CU_ATT_GCHUNK ? grp : CU_ATT_GCHUNK;
    const int R = gchunk >= CU_ATT_WARPS ? 1 : CU_ATT_WARPS / gchunk;
    const int nw = R * gchunk;
    int KT = (int)((CU_ATT_SMEM / sizeof(float) - (size_t)nw * hd) / (2 * (size_t)(hd + 1)));
    if (KT > 32) KT = 32;
    if (KT < 1) return cu_check(c, cudaErrorInvalidValue, "attention (no shared memory for a key tile)");
    int n_blk = 0;
    for (int s = 0; s < n_seq; s++) n_blk += (seqs[s].n + R - 1) / R;
    if (n_blk == 0) return 0;
    cu_attn_blk *blk = (cu_attn_blk *)malloc(sizeof *blk * (size_t)n_blk);
    if (!blk) return cu_check(c, cudaErrorMemoryAllocation, "attention tables");
    for (int s = 0, b = 0; s < n_seq; s++)
        for (int r0 = 0; r0 < seqs[s].n; r0 += R) blk[b++] = (cu_attn_blk){ s, r0 };
    size_t sb = (sizeof *seqs * (size_t)n_seq + 15) & ~(size_t)15, bb = sizeof *blk * (size_t)n_blk;
    int rc = -1;
    if (cu_buf_need(c, &c->stage, sb + bb) == 0) {
        char *st = (char *)c->stage.p;
        if (!cu_check(c, cudaMemcpyAsync(st, seqs, sizeof *seqs * (size_t)n_seq, cudaMemcpyHostToDevice, c->cs), "upload") &&
            !cu_check(c, cudaMemcpyAsync(st + sb, blk, bb, cudaMemcpyHostToDevice, c->cs), "upload")) {
            dim3 grid((unsigned)n_blk, (unsigned)n_head_kv, (unsigned)((grp + gchunk - 1) / gchunk));
            size_t smem = sizeof(float) * (2 * (size_t)KT * (hd + 1) + (size_t)nw * hd);
            const cu_attn_seq *ds = (const cu_attn_seq *)st;
            const cu_attn_blk *db = (const cu_attn_blk *)(st + sb);
            if (dt == GGML_TYPE_Q8_0)
                k_attn<GGML_TYPE_Q8_0><<<grid, 32 * nw, smem, c->cs>>>(q, ds, db, R, gchunk, n_head, n_head_kv, hd, rb, scale, KT, out);
            else if (dt == GGML_TYPE_BF16)
                k_attn<GGML_TYPE_BF16><<<grid, 32 * nw, smem, c->cs>>>(q, ds, db, R, gchunk, n_head, n_head_kv, hd, rb, scale, KT, out);
            else
                k_attn<GGML_TYPE_F16><<<grid, 32 * nw, smem, c->cs>>>(q, ds, db, R, gchunk, n_head, n_head_kv, hd, rb, scale, KT, out);
            rc = cu_check(c, cudaGetLastError(), "attention");
        }
    }
    free(blk);
    return rc;
}

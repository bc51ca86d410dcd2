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
 * Launches with a span of 64 rows or more (the default since its first GPU
 * run: 3.2x at pp4096, 3.9x at pp16384 of the Qwen3-0.6B shape on an H200,
 * and with its shared rows padded against bank conflicts 1.3-1.5x and 3x
 * more; TANDEM_CUDA_ATTN=cores keeps them on k_attn): k_attn_tc, the same
 * online softmax with the two products of each key tile on tensor cores
 * (WMMA 16x16x16, f16 inputs, f32 accumulation). K and V are the cache's
 * values as f16 (exact for an F16 cache). q goes in as hi + lo halves (two
 * products, about 22 bits, as the GEMMs' activations do); the
 * probabilities go in as one f16 half, as llama.cpp's own KQ x V product
 * rounds them to the F16 cache's type. Measured on an H200: without q's lo
 * half an F16 golden fails (07_long_gpl3 step 14, a top-10 logit off by
 * 0.038, tol 0.03); without the probabilities' lo half every golden passes
 * (the worst qwen3-mini-F16 step 0.0020 against 0.0010 with it) and the
 * kernel takes 5% less time (Qwen3-30B-A3B shape, 4096 rows: 2.05 against
 * 2.16 ms a layer call). TANDEM_CUDA_ATTN_SPLIT=3 splits both, =0 neither
 * (2.11 -> 1.58 ms against both split, but that golden fails).
 *
 * Not yet done: splitting long contexts over several blocks for decode.
 */
#include <mma.h>
#include <stdlib.h>

#include "backend/cuda/cuda_internal.h"

using namespace nvcuda;

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

/* The launch's tables on the device (the stage buffer, in stream order):
 * the sequences, and one block entry (sequence, first row) per `rows` query
 * rows of each. The number of blocks (0: nothing to do), or -1 with the
 * failure recorded. */
static int cu_attn_tables(cu_impl *c, const cu_attn_seq *seqs, int n_seq, int rows, const cu_attn_seq **ds,
                          const cu_attn_blk **db) {
    int n_blk = 0;
    for (int s = 0; s < n_seq; s++) n_blk += (seqs[s].n + rows - 1) / rows;
    if (n_blk == 0) return 0;
    cu_attn_blk *blk = (cu_attn_blk *)malloc(sizeof *blk * (size_t)n_blk);
    if (!blk) return cu_check(c, cudaErrorMemoryAllocation, "attention tables");
    for (int s = 0, b = 0; s < n_seq; s++)
        for (int r0 = 0; r0 < seqs[s].n; r0 += rows) blk[b++] = (cu_attn_blk){ s, r0 };
    size_t sb = (sizeof *seqs * (size_t)n_seq + 15) & ~(size_t)15, bb = sizeof *blk * (size_t)n_blk;
    int rc = -1;
    if (cu_buf_need(c, &c->stage, sb + bb) == 0) {
        char *st = (char *)c->stage.p;
        /* pageable sources: each copy has taken its bytes when it returns */
        if (!cu_check(c, cudaMemcpyAsync(st, seqs, sizeof *seqs * (size_t)n_seq, cudaMemcpyHostToDevice, c->cs), "upload") &&
            !cu_check(c, cudaMemcpyAsync(st + sb, blk, bb, cudaMemcpyHostToDevice, c->cs), "upload")) {
            *ds = (const cu_attn_seq *)st;
            *db = (const cu_attn_blk *)(st + sb);
            rc = n_blk;
        }
    }
    free(blk);
    return rc;
}

/* ==== Tensor-core tiles (long prompts) ==== */

#define CU_TC_ROWS 64              /* query rows per block: 4 warps x 16 */
#define CU_TC_KEYS 64              /* keys per tile */
/* Row padding of the shared tiles. Unpadded, every row was 256 bytes from
 * the next, so the 8 rows a WMMA load or store touches at once, and the 16
 * score rows the softmax lanes read, all fell on the same banks: ncu on an
 * H200 (Qwen3-0.6B shape, 4096 rows) showed the L1/shared pipe 94% busy,
 * 73% of stalls waiting on it, the SM issuing 6% of its slots. 8 halves
 * (Q, K, V rows) and 4 floats (score rows) move consecutive rows by 4 banks. */
#define CU_TC_PADH 8
#define CU_TC_PADS 4

/* Shared memory of k_attn_tc<HDIM> (bytes): q hi (and lo) and the K and V
 * tiles (f16, rows padded), the scores (f32; each row's probabilities
 * overwrite it as f16 hi, and lo), and one 16 x 16 f32 tile per warp for
 * the row factors. 89 KiB at 128 with q split: under the 99 KiB a block
 * may have on sm_120/121, two blocks per SM on sm_90 (72 KiB, three, with
 * q unsplit). */
static size_t cu_tc_smem(int hd, int split) {
    const size_t ld = (size_t)hd + CU_TC_PADH;
    return (size_t)CU_TC_ROWS * ld * 2 * (split & 1 ? 2 : 1) + (size_t)CU_TC_KEYS * ld * 2 * 2 +
           (size_t)CU_TC_ROWS * (CU_TC_KEYS + CU_TC_PADS) * 4 + (size_t)(CU_TC_ROWS / 16) * 256 * 4;
}

typedef wmma::fragment<wmma::accumulator, 16, 16, 16, float> cu_tc_acc;

/* o[t] *= the factor of its row, for the warp's HDIM / 16 output tiles: F
 * holds the 16 factors as a 16 x 16 tile (row i: factor i), loaded as an
 * accumulator fragment, whose elements sit where o's do. */
template <int HDIM> __device__ __forceinline__ void cu_tc_scale_rows(cu_tc_acc *o, const float *F) {
    cu_tc_acc f;
    wmma::load_matrix_sync(f, F, 16, wmma::mem_row_major);
#pragma unroll
    for (int t = 0; t < HDIM / 16; t++)
#pragma unroll
        for (int e = 0; e < f.num_elements; e++) o[t].x[e] *= f.x[e];
}

typedef wmma::fragment<wmma::matrix_a, 16, 16, 16, __half, wmma::row_major> cu_tc_a;

/* One 16-deep step of a warp's product: acc[t] += a B_t for the NT tiles
 * B_t at b + t * step (layout BL, leading dimension ld), and with LO the lo
 * half's product al B_t too. Both of the kernel's products are this step:
 * q K^T (K tiles column-major, one per 16 keys) and P V (V tiles
 * row-major, one per 16 output dims). */
template <typename BL, int NT, bool LO>
__device__ __forceinline__ void cu_tc_mma_step(cu_tc_acc *acc, const cu_tc_a &ah, const cu_tc_a &al,
                                               const __half *b, int step, int ld) {
#pragma unroll
    for (int t = 0; t < NT; t++) {
        wmma::fragment<wmma::matrix_b, 16, 16, 16, __half, BL> f;
        wmma::load_matrix_sync(f, b + t * step, ld);
        wmma::mma_sync(acc[t], ah, f, acc[t]);
        if (LO) wmma::mma_sync(acc[t], al, f, acc[t]);
    }
}

/* A block: query head blockIdx.y, rows [r0, r0 + 64) of one sequence (the
 * table entry blockIdx.x); warp w owns rows r0 + 16 w .. + 16 and keeps
 * their output in registers (HDIM / 16 accumulator tiles); lanes 2i and
 * 2i + 1 keep row i's running max and sum. SPLIT: bit 0, q as hi + lo
 * halves; bit 1, the probabilities too. Blocks an SM should hold (the
 * registers are capped to fit): 3 with q unsplit, whose shared memory
 * allows three (cu_tc_smem), else 2. */
template <uint32_t DT, int HDIM, int SPLIT>
__global__ void __launch_bounds__(128, SPLIT & 1 ? 2 : 3) k_attn_tc(const float *q, const cu_attn_seq *seqs, const cu_attn_blk *blks,
                                                 int n_head, int n_head_kv, size_t rb, float scale, float *out) {
    extern __shared__ __align__(128) unsigned char smraw[];
    const int h = blockIdx.y, kvh = h / (n_head / n_head_kv), warp = threadIdx.x / 32, lane = threadIdx.x % 32;
    const cu_attn_blk bk = blks[blockIdx.x];
    const cu_attn_seq sq = seqs[bk.seq];
    constexpr int LD = HDIM + CU_TC_PADH, LS = CU_TC_KEYS + CU_TC_PADS;   /* row strides (halves, floats) */
    __half *Qh = (__half *)smraw, *Ql = Qh + CU_TC_ROWS * LD;            /* [64][LD] (Ql with SPLIT) */
    constexpr bool QL = SPLIT & 1, PL = SPLIT & 2;
    __half *Kt = Qh + CU_TC_ROWS * LD * (QL ? 2 : 1), *Vt = Kt + CU_TC_KEYS * LD;   /* [64 keys][LD] */
    float *S = (float *)(Vt + CU_TC_KEYS * LD);                          /* [64][LS]; P: [64][hi 64 | lo 64 | pad] f16 */
    float *F = S + CU_TC_ROWS * LS + warp * 256;                         /* this warp's factor tile */
    const int nrow = sq.n - bk.r0 < CU_TC_ROWS ? sq.n - bk.r0 : CU_TC_ROWS;
    for (int i = threadIdx.x; i < CU_TC_ROWS * HDIM; i += blockDim.x) {
        int r = i / HDIM, d = i - r * HDIM;
        float x = r < nrow ? q[((size_t)(sq.t0 + bk.r0 + r) * n_head + h) * HDIM + d] : 0.0f;
        __half hi = __float2half_rn(x);
        Qh[r * LD + d] = hi;
        if (QL) Ql[r * LD + d] = __float2half_rn(x - __half2float(hi));
    }
    const int w16 = 16 * warp, r = w16 + lane / 2, half = lane & 1, qpos = sq.pos0 + bk.r0 + r;
    float m = -INFINITY, l = 0.0f;   /* row r's, in both of its lanes */
    cu_tc_acc o[HDIM / 16];
#pragma unroll
    for (int t = 0; t < HDIM / 16; t++) wmma::fill_fragment(o[t], 0.0f);
    const int npos = sq.pos0 + bk.r0 + nrow;   /* the block's last row sees the most keys */
    for (int p0 = 0; p0 < npos; p0 += CU_TC_KEYS) {
        __syncthreads();   /* everyone is done with the previous tile (and q is in place) */
        if (DT == GGML_TYPE_F16 && rb % 16 == 0) {
            /* the cache's own f16 values, 16 bytes at a time */
            const int per_row = HDIM / 8;
            for (int i = threadIdx.x; i < CU_TC_KEYS * per_row; i += blockDim.x) {
                int j = i / per_row, c8 = i - j * per_row;
                uint4 kx = make_uint4(0, 0, 0, 0), vx = kx;
                if (p0 + j < npos) {
                    size_t ro = (size_t)(p0 + j) * rb + (size_t)kvh * HDIM * 2 + (size_t)c8 * 16;
                    kx = *(const uint4 *)(sq.k + ro);
                    vx = *(const uint4 *)(sq.v + ro);
                }
                *(uint4 *)(Kt + j * LD + 8 * c8) = kx;
                *(uint4 *)(Vt + j * LD + 8 * c8) = vx;
            }
        } else {
            for (int i = threadIdx.x; i < CU_TC_KEYS * HDIM; i += blockDim.x) {
                int j = i / HDIM, d = i - j * HDIM;
                float kx = 0.0f, vx = 0.0f;
                if (p0 + j < npos) {
                    size_t ro = (size_t)(p0 + j) * rb;
                    kx = cu_kv_get<DT>(sq.k + ro, kvh * HDIM + d);
                    vx = cu_kv_get<DT>(sq.v + ro, kvh * HDIM + d);
                }
                Kt[j * LD + d] = __float2half_rn(kx);
                Vt[j * LD + d] = __float2half_rn(vx);
            }
        }
        __syncthreads();
        /* S = q K^T for the warp's 16 rows, hi and lo products into one f32
         * accumulator per 16 keys; each q fragment loaded once a tile */
        {
            cu_tc_acc acc[CU_TC_KEYS / 16];
#pragma unroll
            for (int t = 0; t < CU_TC_KEYS / 16; t++) wmma::fill_fragment(acc[t], 0.0f);
#pragma unroll
            for (int ks = 0; ks < HDIM / 16; ks++) {
                cu_tc_a ah, al;
                wmma::load_matrix_sync(ah, Qh + w16 * LD + ks * 16, LD);
                if (QL) wmma::load_matrix_sync(al, Ql + w16 * LD + ks * 16, LD);
                cu_tc_mma_step<wmma::col_major, CU_TC_KEYS / 16, QL>(acc, ah, al, Kt + ks * 16, 16 * LD, LD);
            }
#pragma unroll
            for (int t = 0; t < CU_TC_KEYS / 16; t++)
                wmma::store_matrix_sync(S + w16 * LS + t * 16, acc[t], LS, wmma::mem_row_major);
        }
        __syncwarp();
        /* online softmax of row r: this lane's 32 keys, visited from key
         * lane on (v[j] is key (j + lane) % 32 of the lane's half), so
         * that the 32 lanes read 32 banks at each step */
        float v[32], mt = -INFINITY;
#pragma unroll
        for (int j = 0; j < 32; j++) {
            const int jj = (j + lane) & 31, p = p0 + 32 * half + jj;
            v[j] = r < nrow && p <= qpos ? S[r * LS + 32 * half + jj] * scale : -INFINITY;
            mt = fmaxf(mt, v[j]);
        }
        mt = fmaxf(mt, __shfl_xor_sync(0xffffffffu, mt, 1));
        const float mnew = fmaxf(m, mt);
        float corr = 1.0f, sum = 0.0f;
        if (mnew != -INFINITY) {   /* else no key of this row yet: all zero */
            corr = m == -INFINITY ? 0.0f : expf(m - mnew);
#pragma unroll
            for (int j = 0; j < 32; j++) {
                v[j] = v[j] == -INFINITY ? 0.0f : expf(v[j] - mnew);
                sum += v[j];
            }
        } else {
#pragma unroll
            for (int j = 0; j < 32; j++) v[j] = 0.0f;
        }
        sum += __shfl_xor_sync(0xffffffffu, sum, 1);
        m = mnew;
        l = l * corr + sum;
        __syncwarp();   /* the warp's scores are all read: the probabilities take their place */
        __half *P = (__half *)(S + r * LS);
#pragma unroll
        for (int j = 0; j < 32; j++) {
            const int jj = (j + lane) & 31;
            __half hi = __float2half_rn(v[j]);
            P[32 * half + jj] = hi;
            if (PL) P[CU_TC_KEYS + 32 * half + jj] = __float2half_rn(v[j] - __half2float(hi));
        }
#pragma unroll
        for (int j = 0; j < 8; j++) F[(r - w16) * 16 + 8 * half + ((j + (lane >> 2)) & 7)] = corr;
        __syncwarp();
        cu_tc_scale_rows<HDIM>(o, F);
        /* O += P V: hi and lo probabilities */
        const __half *Pw = (const __half *)(S + w16 * LS);
#pragma unroll
        for (int ks = 0; ks < CU_TC_KEYS / 16; ks++) {
            cu_tc_a ah, al;
            wmma::load_matrix_sync(ah, Pw + ks * 16, 2 * LS);
            if (PL) wmma::load_matrix_sync(al, Pw + CU_TC_KEYS + ks * 16, 2 * LS);
            cu_tc_mma_step<wmma::row_major, HDIM / 16, PL>(o, ah, al, Vt + ks * 16 * LD, 16, LD);
        }
    }
    /* out = O / l, through the K/V tiles' memory (64 x (HDIM + 4) f32 fits in it) */
    __syncwarp();   /* the last correction tile is read */
#pragma unroll
    for (int j = 0; j < 8; j++) F[(r - w16) * 16 + 8 * half + ((j + (lane >> 2)) & 7)] = l > 0.0f ? 1.0f / l : 0.0f;
    __syncwarp();
    cu_tc_scale_rows<HDIM>(o, F);
    __syncthreads();   /* every warp is done with the K/V tiles */
    constexpr int LO = HDIM + 4;   /* staged output rows, floats */
    static_assert(CU_TC_ROWS * LO * 4 <= 2 * CU_TC_KEYS * LD * 2, "the staged output fits the K/V tiles");
    float *stage = (float *)Kt + w16 * LO;
#pragma unroll
    for (int t = 0; t < HDIM / 16; t++) wmma::store_matrix_sync(stage + t * 16, o[t], LO, wmma::mem_row_major);
    __syncwarp();
    for (int i = lane; i < 16 * HDIM; i += 32) {
        int rr = w16 + i / HDIM, d = i % HDIM;
        if (rr < nrow) out[((size_t)(sq.t0 + bk.r0 + rr) * n_head + h) * HDIM + d] = stage[(i / HDIM) * LO + d];
    }
}

/* The tensor-core path for this launch: opted in, a head size it takes,
 * and a sequence long enough to fill its 64-row blocks. 1 if it ran (rc
 * set), 0 to use the CUDA-core kernel. */
static int cu_attn_tc(cu_impl *c, uint32_t dt, const float *q, const cu_attn_seq *seqs, int n_seq, int n_head,
                      int n_head_kv, int hd, size_t rb, float scale, float *out, int *rc) {
    int longest = 0;
    for (int s = 0; s < n_seq; s++) longest = seqs[s].n > longest ? seqs[s].n : longest;
    /* head sizes 64 and 128 (Qwen2.5, Qwen3, Llama 3): the output tiles
     * live in registers, so the size is a template parameter */
    const int split = c->attn_split;
    if (!c->attn_tc || (hd != 64 && hd != 128) || longest < CU_TC_ROWS || cu_tc_smem(hd, split) > c->smem_optin)
        return 0;
    const cu_attn_seq *ds;
    const cu_attn_blk *db;
    const int n_blk = cu_attn_tables(c, seqs, n_seq, CU_TC_ROWS, &ds, &db);
    if (n_blk < 0) { *rc = -1; return 1; }
    const size_t smem = cu_tc_smem(hd, split);
    const dim3 grid((unsigned)n_blk, (unsigned)n_head);
    cudaError_t e;
#define CU_TC_LAUNCH(T, D, S)                                                                               \
    e = cudaFuncSetAttribute(k_attn_tc<T, D, S>, cudaFuncAttributeMaxDynamicSharedMemorySize, (int)smem);   \
    if (e == cudaSuccess)                                                                                   \
        k_attn_tc<T, D, S><<<grid, 32 * (CU_TC_ROWS / 16), smem, c->cs>>>(q, ds, db, n_head, n_head_kv, rb, scale, out)
#define CU_TC_SPLIT(T, D)                                                                                   \
    do {                                                                                                    \
        if (split == 3) { CU_TC_LAUNCH(T, D, 3); }                                                          \
        else if (split == 0) { CU_TC_LAUNCH(T, D, 0); }                                                     \
        else { CU_TC_LAUNCH(T, D, 1); }                                                                     \
    } while (0)
#define CU_TC_HD(T) do { if (hd == 64) CU_TC_SPLIT(T, 64); else CU_TC_SPLIT(T, 128); } while (0)
    if (dt == GGML_TYPE_Q8_0) CU_TC_HD(GGML_TYPE_Q8_0);
    else if (dt == GGML_TYPE_BF16) CU_TC_HD(GGML_TYPE_BF16);
    else CU_TC_HD(GGML_TYPE_F16);
#undef CU_TC_HD
#undef CU_TC_SPLIT
#undef CU_TC_LAUNCH
    *rc = cu_check(c, e != cudaSuccess ? e : cudaGetLastError(), "attention (tensor cores)");
    return 1;
}

int cu_launch_attention(cu_impl *c, uint32_t dt, const float *q, const cu_attn_seq *seqs, int n_seq, int n_head,
                        int n_head_kv, int hd, size_t rb, float scale, float *out) {
    if (hd < 1 || hd > CU_ATT_MAX_HD) return cu_check(c, cudaErrorInvalidValue, "attention (head size above 512)");
    int tc_rc;
    if (cu_attn_tc(c, dt, q, seqs, n_seq, n_head, n_head_kv, hd, rb, scale, out, &tc_rc)) return tc_rc;
    const int grp = n_head / n_head_kv;
    const int gchunk = grp < CU_ATT_GCHUNK ? grp : CU_ATT_GCHUNK;
    const int R = gchunk >= CU_ATT_WARPS ? 1 : CU_ATT_WARPS / gchunk;
    const int nw = R * gchunk;
    int KT = (int)((CU_ATT_SMEM / sizeof(float) - (size_t)nw * hd) / (2 * (size_t)(hd + 1)));
    if (KT > 32) KT = 32;
    if (KT < 1) return cu_check(c, cudaErrorInvalidValue, "attention (no shared memory for a key tile)");
    const cu_attn_seq *ds;
    const cu_attn_blk *db;
    const int n_blk = cu_attn_tables(c, seqs, n_seq, R, &ds, &db);
    if (n_blk <= 0) return n_blk;
    dim3 grid((unsigned)n_blk, (unsigned)n_head_kv, (unsigned)((grp + gchunk - 1) / gchunk));
    size_t smem = sizeof(float) * (2 * (size_t)KT * (hd + 1) + (size_t)nw * hd);
    if (dt == GGML_TYPE_Q8_0)
        k_attn<GGML_TYPE_Q8_0><<<grid, 32 * nw, smem, c->cs>>>(q, ds, db, R, gchunk, n_head, n_head_kv, hd, rb, scale, KT, out);
    else if (dt == GGML_TYPE_BF16)
        k_attn<GGML_TYPE_BF16><<<grid, 32 * nw, smem, c->cs>>>(q, ds, db, R, gchunk, n_head, n_head_kv, hd, rb, scale, KT, out);
    else
        k_attn<GGML_TYPE_F16><<<grid, 32 * nw, smem, c->cs>>>(q, ds, db, R, gchunk, n_head, n_head_kv, hd, rb, scale, KT, out);
    return cu_check(c, cudaGetLastError(), "attention");
}

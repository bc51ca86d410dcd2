/* cuda_moe.cu - the qwen3moe feed-forward block on the device.
 *
 *   1. router logits = W_gate_inp x                       (cu_matmul)
 *   2. per token: softmax, top-k, renormalise            (k_moe_route, the
 *      arithmetic of moe_select_experts, ties to the lower index)
 *   3. each expert's row count (k_moe_count), back to the host: the one
 *      wait of the block (cuBLAS takes its shapes from the host, and the
 *      counts choose the layout, cu_moe_stride)
 *   4. rows grouped by expert, in token order (k_moe_place, one block per
 *      expert), gathered: packed (k_moe_gather, f32), or padded (every
 *      group as long as the largest, zero rows after its own; k_moe_gather_half
 *      writes them straight in the halves the products take)
 *   5. gathered rows through gate, up, SwiGLU and down: padded, one batched
 *      GEMM per matrix (cu_matmul_experts_padded); packed, one grouped GEMM
 *      per matrix (cu_matmul_experts). Gate and up read the same converted
 *      rows.
 *   6. each token's k outputs summed with their weights, in expert order
 *      as the CPU backend adds them                        (k_moe_combine)
 */
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <stdlib.h>

#include "backend/cuda/cuda_internal.h"

#define CU_MOE_MAX_EXPERTS 256      /* model.c refuses more */

/* One thread per token. */
__global__ void k_moe_route(const float *logits, int n_tok, int ne, int k, int norm, int *sel, float *selw) {
    int t = blockIdx.x * blockDim.x + threadIdx.x;
    if (t >= n_tok) return;
    const float *lg = logits + (size_t)t * ne;
    float p[CU_MOE_MAX_EXPERTS], mx = -INFINITY;
    uint32_t taken[CU_MOE_MAX_EXPERTS / 32] = { 0 };
    for (int i = 0; i < ne; i++) mx = fmaxf(mx, lg[i]);
    double sum = 0.0;
    for (int i = 0; i < ne; i++) { p[i] = expf(lg[i] - mx); sum += p[i]; }
    for (int i = 0; i < ne; i++) p[i] = (float)(p[i] / sum);
    int *ids = sel + (size_t)t * k;
    float *w = selw + (size_t)t * k, tot = 0.0f;
    for (int s = 0; s < k; s++) {
        int best = -1;
        for (int i = 0; i < ne; i++)
            if (!(taken[i / 32] >> (i % 32) & 1) && (best < 0 || p[i] > p[best])) best = i;
        taken[best / 32] |= 1u << (best % 32);
        ids[s] = best;
        w[s] = p[best];
    }
    if (norm) {
        for (int s = 0; s < k; s++) tot += w[s];
        for (int s = 0; s < k; s++) w[s] /= tot;
    }
}

/* The sum of v over the block (every thread gets it); part holds 32 ints. */
__device__ int cu_block_sum(int v, int *part) {
    const int lane = threadIdx.x % 32, warp = threadIdx.x / 32, nw = (blockDim.x + 31) / 32;
    for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
    __syncthreads();                            /* part may still be read */
    if (lane == 0) part[warp] = v;
    __syncthreads();
    v = lane < nw ? part[lane] : 0;
    for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
    return v;
}

/* Block e counts the selections of expert e. */
__global__ void k_moe_count(const int *sel, int n_sel, int *counts) {
    __shared__ int part[32];
    const int e = blockIdx.x;
    int n = 0;
    for (int i = threadIdx.x; i < n_sel; i += blockDim.x) n += sel[i] == e;
    n = cu_block_sum(n, part);
    if (threadIdx.x == 0) counts[e] = n;
}

/* Block e gives the rows routed to e consecutive places (token order)
 * after those of experts < e: the selections are scanned a block-width at
 * a time, each hit placed by the hits before it (ballot counts within a
 * warp, the warps' totals across). With stride > 0 every expert that has
 * rows starts a stride-row group of its own (the padded layout). */
__global__ void k_moe_place(const int *sel, int n_sel, int k, const int *counts, int stride, int *slot_row,
                            int *src_tok) {
    __shared__ int part[32];
    const int e = blockIdx.x, lane = threadIdx.x % 32, warp = threadIdx.x / 32, nw = blockDim.x / 32;
    int before = 0;
    for (int i = threadIdx.x; i < e; i += blockDim.x) before += stride > 0 ? (counts[i] > 0) * stride : counts[i];
    int j = cu_block_sum(before, part);         /* this expert's first row */
    for (int base = 0; base < n_sel; base += blockDim.x) {
        const int i = base + threadIdx.x;
        const bool hit = i < n_sel && sel[i] == e;
        const unsigned m = __ballot_sync(0xffffffffu, hit);
        __syncthreads();                        /* the last round's part is read */
        if (lane == 0) part[warp] = __popc(m);
        __syncthreads();
        int pre = 0, tot = 0;
        for (int w = 0; w < nw; w++) { int p = part[w]; pre += w < warp ? p : 0; tot += p; }
        if (hit) {
            const int r = j + pre + __popc(m & ((1u << lane) - 1u));
            slot_row[i] = r;
            src_tok[r] = i / k;
        }
        j += tot;
    }
}

/* Row r of xg = row src_tok[r] of x; a padding row (src_tok -1) = zeros. */
__global__ void k_moe_gather(const float *x, const int *src_tok, int rows, int dim, float *xg) {
    size_t n = (size_t)rows * dim;
    for (size_t i = blockIdx.x * (size_t)blockDim.x + threadIdx.x; i < n; i += (size_t)gridDim.x * blockDim.x) {
        const int t = src_tok[i / dim];
        xg[i] = t < 0 ? 0.0f : x[(size_t)t * dim + i % dim];
    }
}

/* The same into hi (and lo) halves, as cu_matmul_act converts rows. */
template <typename H>
__global__ void k_moe_gather_half(const float *x, const int *src_tok, int rows, int dim, H *hi, H *lo) {
    size_t n = (size_t)rows * dim;
    for (size_t i = blockIdx.x * (size_t)blockDim.x + threadIdx.x; i < n; i += (size_t)gridDim.x * blockDim.x) {
        const int t = src_tok[i / dim];
        const float v = t < 0 ? 0.0f : x[(size_t)t * dim + i % dim];
        const H h = (H)v;
        hi[i] = h;
        if (lo) lo[i] = (H)(v - (float)h);
    }
}

__global__ void k_moe_combine(const float *down, const int *sel, const float *selw, const int *slot_row, int n_tok,
                              int k, int dim, float *y) {
    size_t n = (size_t)n_tok * dim;
    for (size_t i = blockIdx.x * (size_t)blockDim.x + threadIdx.x; i < n; i += (size_t)gridDim.x * blockDim.x) {
        int t = (int)(i / dim), d = (int)(i % dim);
        const int *ids = sel + (size_t)t * k;
        float acc = 0.0f;
        int last = -1;
        for (int s = 0; s < k; s++) {           /* experts in ascending order */
            int pick = -1;
            for (int q = 0; q < k; q++)
                if (ids[q] > last && (pick < 0 || ids[q] < ids[pick])) pick = q;
            last = ids[pick];
            acc += selw[(size_t)t * k + pick] * down[(size_t)slot_row[(size_t)t * k + pick] * dim + d];
        }
        y[i] = acc;
    }
}

static unsigned cu_moe_blocks(size_t n) {
    size_t b = (n + 255) / 256;
    return (unsigned)(b < 1 ? 1 : b > 65535 ? 65535 : b);
}

/* The padded layout's stride for these counts, or 0 for the packed one.
 * Padding every group to the largest pays while the groups are long and
 * even: a uniform batch runs as one kernel over all experts (see
 * cu_matmul_experts_padded), while the padding's rows are multiplied for
 * nothing. Measured on an H200 (Qwen3-30B-A3B shape, 16 layers, grouped
 * call against padded, two rounds): pp512 (32 rows an expert on average)
 * 0.86-0.99x, pp1024 (64) 1.26-1.36x, pp2048 1.50-1.62x, pp4096
 * 1.37-1.47x, pp16384 1.37-1.38x. Hence CU_MOE_PAD_MIN_MEAN, and padded
 * rows at most 3/2 of the routed ones (CU_MOE_PAD_WASTE: in the 48-layer
 * file's pp4096 passes 234 of 240 blocks padded under it, multiplying 27%
 * more rows than were routed; the other 6 took the grouped call). */
#define CU_MOE_PAD_MIN_MEAN 64
#define CU_MOE_PAD_WASTE_NUM 3
#define CU_MOE_PAD_WASTE_DEN 2
static int cu_moe_stride(const cu_impl *c, const cu_weight *const w[3], int rows, int n_group, int max_cnt) {
    if (c->moe_pad <= 0) return 0;
    for (int i = 0; i < 3; i++)
        if (!cu_matmul_pads(w[i])) return 0;
    if (c->moe_pad >= 2) return max_cnt;
    if ((int64_t)rows < (int64_t)CU_MOE_PAD_MIN_MEAN * n_group) return 0;
    if ((int64_t)n_group * max_cnt * CU_MOE_PAD_WASTE_DEN > (int64_t)rows * CU_MOE_PAD_WASTE_NUM) return 0;
    return max_cnt;
}

/* The routed rows' products: gate, up, SwiGLU, down, packed (xg: the
 * gathered rows in f32) or padded (xa: the gathered rows already in the
 * halves gate's products take). Gate and up share one conversion when
 * their weights take the same type. */
static void cu_moe_experts(cu_impl *c, const cu_weight *const w[3], int ng, const int *ge, const int *goff,
                           const int *gcnt, int stride, size_t prows, int dim, int nff, const float *xg,
                           const cu_act *xa, float *gate, float *up, float *down) {
    double t0 = cu_prof_begin(c);
    cu_act a;
    if (stride > 0) {
        cu_matmul_experts_padded(c, w[0], ng, ge, stride, xa, gate);
        if (cu_matmul_act_type(w[1]) == xa->type) a = *xa;
        else if (cu_matmul_act(c, cu_matmul_act_type(w[1]), xg, prows * (size_t)dim, &a)) return;
        cu_matmul_experts_padded(c, w[1], ng, ge, stride, &a, up);
    } else {
        const cudaDataType_t at = cu_matmul_act_type(w[0]);
        const int shared = at == cu_matmul_act_type(w[1]) && !cu_matmul_uses_mmv((int)(prows / (size_t)ng));
        if (shared && cu_matmul_act(c, at, xg, prows * (size_t)dim, &a)) return;
        cu_matmul_experts(c, w[0], ng, ge, goff, gcnt, xg, shared ? &a : NULL, gate);
        cu_matmul_experts(c, w[1], ng, ge, goff, gcnt, xg, shared ? &a : NULL, up);
    }
    cu_launch_swiglu(c, gate, up, gate, prows * (size_t)nff);
    cu_prof_end(c, CU_P_MOE_GATE_UP, t0);
    t0 = cu_prof_begin(c);
    if (stride > 0) {
        if (cu_matmul_act(c, cu_matmul_act_type(w[2]), gate, prows * (size_t)nff, &a)) return;
        cu_matmul_experts_padded(c, w[2], ng, ge, stride, &a, down);
    } else {
        cu_matmul_experts(c, w[2], ng, ge, goff, gcnt, gate, NULL, down);
    }
    cu_prof_end(c, CU_P_MOE_DOWN, t0);
}

/* Bytes of n floats (or ints) rounded up to 256: every region of the
 * scratch starts aligned, as cuBLAS's batched kernels assume of the
 * pointers they are given (they cannot check them). */
static size_t cu_moe_region(size_t n) { return (n * 4 + 255) & ~(size_t)255; }

/* The next region of n floats (or ints) of a scratch layout: its offset,
 * with *end moved past it. Each region's size is stated once, where it is
 * taken, and the buffer's size is *end. */
static size_t cu_moe_take(size_t *end, size_t n) {
    size_t at = *end;
    *end += cu_moe_region(n);
    return at;
}

int cu_moe_ffn(cu_impl *c, const be_moe *m, const float *x, int n_tok, float *y) {
    const int ne = m->n_expert, k = m->n_expert_used;
    if (ne > CU_MOE_MAX_EXPERTS || k > ne || k < 1 || n_tok < 1) return -1;
    cu_weight *gi = cu_weight_of(c, m->gate_inp), *wg = cu_weight_of(c, m->gate_exps);
    cu_weight *wu = cu_weight_of(c, m->up_exps), *wd = cu_weight_of(c, m->down_exps);
    if (!gi || !wg || !wu || !wd) return -1;
    const cu_weight *const w3[3] = { wg, wu, wd };
    const int dim = (int)m->gate_inp->ne[0], nff = (int)m->gate_exps->ne[1], rows = n_tok * k;
    /* routing scratch: logits, selw | sel, slot_row, counts */
    size_t fl = (size_t)n_tok * ne + (size_t)rows, ints = (size_t)rows * 2 + (size_t)ne;
    if (cu_buf_need(c, &c->moe, sizeof(float) * (fl + ints + 64))) return -1;
    float *logits = (float *)c->moe.p, *selw = logits + (size_t)n_tok * ne;
    int *sel = (int *)(selw + rows), *slot_row = sel + rows, *counts = slot_row + rows;

    double t0 = cu_prof_begin(c);
    cu_matmul(c, gi, 0, x, n_tok, logits);
    cu_prof_end(c, CU_P_MOE_LOGITS, t0);
    t0 = cu_prof_begin(c);
    k_moe_route<<<(n_tok + 63) / 64, 64, 0, c->cs>>>(logits, n_tok, ne, k, m->norm_topk, sel, selw);
    cu_prof_end(c, CU_P_MOE_TOPK, t0);
    t0 = cu_prof_begin(c);
    k_moe_count<<<ne, 256, 0, c->cs>>>(sel, rows, counts);
    if (cu_check(c, cudaGetLastError(), "MoE routing")) return -1;
    /* the counts come back first: they choose the layout, and cuBLAS takes
     * its shapes from the host */
    int *hc = (int *)malloc(sizeof(int) * 4 * (size_t)ne);
    if (!hc) return -1;
    int *ge = hc + ne, *goff = hc + 2 * ne, *gcnt = hc + 3 * ne, ng = 0, max_cnt = 0, rc = -1;
    if (cu_check(c, cudaMemcpyAsync(hc, counts, sizeof(int) * (size_t)ne, cudaMemcpyDeviceToHost, c->cs),
                 "MoE counts") ||
        cu_check(c, cudaStreamSynchronize(c->cs), "MoE routing"))
        goto out;
    for (int e = 0, o = 0; e < ne; e++)
        if (hc[e] > 0) {
            ge[ng] = e; goff[ng] = o; gcnt[ng] = hc[e]; ng++;
            o += hc[e];
            if (hc[e] > max_cnt) max_cnt = hc[e];
        }
    cu_prof_end(c, CU_P_MOE_COUNTS, t0);
    t0 = cu_prof_begin(c);
    {
        const int stride = cu_moe_stride(c, w3, rows, ng, max_cnt);
        const size_t prows = stride > 0 ? (size_t)ng * (size_t)stride : (size_t)rows;
        if (c->prof) {
            c->moe_calls++;
            if (stride > 0) { c->moe_padded++; c->moe_rows_routed += rows; c->moe_rows_padded += (long long)prows; }
        }
        /* padded rows whose gate and up take the same halves are gathered
         * straight into them; other rows first in f32 (xg) */
        const cudaDataType_t at = cu_matmul_act_type(wg);
        const int fused = stride > 0 && at != CUDA_R_32F && at == cu_matmul_act_type(wu);
        /* gathered rows: src_tok | xg (dim wide, unless fused) | gate, up
         * (nff wide) | down (dim wide) */
        size_t end = 0;
        const size_t o_tok = cu_moe_take(&end, prows), o_x = fused ? 0 : cu_moe_take(&end, prows * dim);
        const size_t o_gate = cu_moe_take(&end, prows * nff), o_up = cu_moe_take(&end, prows * nff);
        const size_t o_down = cu_moe_take(&end, prows * dim);
        if (cu_buf_need(c, &c->moe_rows, end)) goto out;
        uint8_t *base = (uint8_t *)c->moe_rows.p;
        int *src_tok = (int *)(base + o_tok);
        float *xg = fused ? NULL : (float *)(base + o_x), *gate = (float *)(base + o_gate);
        float *up = (float *)(base + o_up), *down = (float *)(base + o_down);
        if (stride > 0 && cu_check(c, cudaMemsetAsync(src_tok, 0xff, sizeof(int) * prows, c->cs), "MoE padding"))
            goto out;
        k_moe_place<<<ne, 256, 0, c->cs>>>(sel, rows, k, counts, stride, slot_row, src_tok);
        cu_act xa = { at, xg, NULL };
        if (fused) {
            if (cu_matmul_act_room(c, at, NULL, prows * dim, &xa)) goto out;
            if (at == CUDA_R_16BF)
                k_moe_gather_half<<<cu_moe_blocks(prows * dim), 256, 0, c->cs>>>(
                    x, src_tok, (int)prows, dim, (__nv_bfloat16 *)xa.hi, (__nv_bfloat16 *)xa.lo);
            else
                k_moe_gather_half<<<cu_moe_blocks(prows * dim), 256, 0, c->cs>>>(x, src_tok, (int)prows, dim,
                                                                                 (__half *)xa.hi, (__half *)xa.lo);
        } else {
            k_moe_gather<<<cu_moe_blocks(prows * dim), 256, 0, c->cs>>>(x, src_tok, (int)prows, dim, xg);
            if (stride > 0 && cu_matmul_act(c, at, xg, prows * dim, &xa)) goto out;
        }
        if (cu_check(c, cudaGetLastError(), "MoE grouping")) goto out;
        cu_prof_end(c, CU_P_MOE_GATHER, t0);
        cu_moe_experts(c, w3, ng, ge, goff, gcnt, stride, prows, dim, nff, xg, &xa, gate, up, down);
        t0 = cu_prof_begin(c);
        k_moe_combine<<<cu_moe_blocks((size_t)n_tok * dim), 256, 0, c->cs>>>(down, sel, selw, slot_row, n_tok, k,
                                                                             dim, y);
        rc = cu_check(c, cudaGetLastError(), "MoE combine");
        cu_prof_end(c, CU_P_MOE_COMBINE, t0);
    }
out:
    free(hc);
    return c->failed ? -1 : rc;
}

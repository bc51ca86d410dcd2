/* cuda_moe.cu - the qwen3moe feed-forward block on the device.
 *
 *   1. router logits = W_gate_inp x                       (cu_matmul)
 *   2. per token: softmax, top-k, renormalise            (k_moe_route, the
 *      arithmetic of moe_select_experts, ties to the lower index)
 *   3. rows grouped by expert, in token order            (k_moe_count,
 *      one block per expert                                 k_moe_place)
 *   4. the experts' row counts come back to the host (the one wait of the
 *      block: cuBLAS takes its shapes from the host)
 *   5. gathered rows through gate, up, SwiGLU and down, all experts in one
 *      grouped GEMM per matrix                            (cu_matmul_experts)
 *   6. each token's k outputs summed with their weights, in expert order
 *      as the CPU backend adds them                        (k_moe_combine)
 */
#include <stdlib.h>

#include "cuda_internal.h"

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
 * warp, the warps' totals across). */
__global__ void k_moe_place(const int *sel, int n_sel, int k, const int *counts, int *offs, int *slot_row,
                            int *src_tok) {
    __shared__ int part[32];
    const int e = blockIdx.x, lane = threadIdx.x % 32, warp = threadIdx.x / 32, nw = blockDim.x / 32;
    int before = 0;
    for (int i = threadIdx.x; i < e; i += blockDim.x) before += counts[i];
    int j = cu_block_sum(before, part);         /* this expert's first row */
    if (threadIdx.x == 0) offs[e] = j;
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

__global__ void k_moe_gather(const float *x, const int *src_tok, int rows, int dim, float *xg) {
    size_t n = (size_t)rows * dim;
    for (size_t i = blockIdx.x * (size_t)blockDim.x + threadIdx.x; i < n; i += (size_t)gridDim.x * blockDim.x)
        xg[i] = x[(size_t)src_tok[i / dim] * dim + i % dim];
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

int cu_moe_ffn(cu_impl *c, const be_moe *m, const float *x, int n_tok, float *y) {
    const int ne = m->n_expert, k = m->n_expert_used;
    if (ne > CU_MOE_MAX_EXPERTS || k > ne || k < 1 || n_tok < 1) return -1;
    cu_weight *gi = cu_weight_of(c, m->gate_inp), *wg = cu_weight_of(c, m->gate_exps);
    cu_weight *wu = cu_weight_of(c, m->up_exps), *wd = cu_weight_of(c, m->down_exps);
    if (!gi || !wg || !wu || !wd) return -1;
    const int dim = (int)m->gate_inp->ne[0], nff = (int)m->gate_exps->ne[1], rows = n_tok * k;
    /* scratch: logits, sel, selw, slot_row, src_tok, counts, offs | xg, gate, up, down */
    size_t ints = (size_t)rows * 3 + 2 * (size_t)ne, fl = (size_t)n_tok * ne + (size_t)rows;
    size_t big = (size_t)rows * (2 * (size_t)dim + 2 * (size_t)nff);
    if (cu_buf_need(c, &c->moe, sizeof(float) * (fl + ints + big + 64))) return -1;
    float *logits = (float *)c->moe.p, *selw = logits + (size_t)n_tok * ne;
    int *sel = (int *)(selw + rows), *slot_row = sel + rows, *src_tok = slot_row + rows;
    int *counts = src_tok + rows, *offs = counts + ne;
    float *xg = (float *)(offs + ne), *gate = xg + (size_t)rows * dim, *up = gate + (size_t)rows * nff;
    float *down = up + (size_t)rows * nff;

    double t0 = cu_prof_begin(c);
    cu_matmul(c, gi, 0, x, n_tok, logits);
    k_moe_route<<<(n_tok + 63) / 64, 64, 0, c->cs>>>(logits, n_tok, ne, k, m->norm_topk, sel, selw);
    k_moe_count<<<ne, 256, 0, c->cs>>>(sel, rows, counts);
    k_moe_place<<<ne, 256, 0, c->cs>>>(sel, rows, k, counts, offs, slot_row, src_tok);
    k_moe_gather<<<cu_moe_blocks((size_t)rows * dim), 256, 0, c->cs>>>(x, src_tok, rows, dim, xg);
    if (cu_check(c, cudaGetLastError(), "MoE routing")) return -1;
    int *hc = (int *)malloc(sizeof(int) * 5 * (size_t)ne);
    if (!hc) return -1;
    int *ho = hc + ne, *ge = hc + 2 * ne, *goff = hc + 3 * ne, *gcnt = hc + 4 * ne, ng = 0;
    if (cu_check(c, cudaMemcpyAsync(hc, counts, sizeof(int) * 2 * (size_t)ne, cudaMemcpyDeviceToHost, c->cs), "MoE counts") ||
        cu_check(c, cudaStreamSynchronize(c->cs), "MoE routing")) {
        free(hc);
        return -1;
    }
    for (int e = 0; e < ne; e++)
        if (hc[e] > 0) { ge[ng] = e; goff[ng] = ho[e]; gcnt[ng] = hc[e]; ng++; }
    cu_prof_end(c, CU_P_MOE_ROUTE, t0);
    t0 = cu_prof_begin(c);
    cu_matmul_experts(c, wg, ng, ge, goff, gcnt, xg, gate);
    cu_matmul_experts(c, wu, ng, ge, goff, gcnt, xg, up);
    cu_launch_swiglu(c, gate, up, gate, (size_t)rows * nff);
    cu_matmul_experts(c, wd, ng, ge, goff, gcnt, gate, down);
    free(hc);
    cu_prof_end(c, CU_P_MOE_GEMM, t0);
    t0 = cu_prof_begin(c);
    k_moe_combine<<<cu_moe_blocks((size_t)n_tok * dim), 256, 0, c->cs>>>(down, sel, selw, slot_row, n_tok, k, dim, y);
    int rc = cu_check(c, cudaGetLastError(), "MoE combine");
    cu_prof_end(c, CU_P_MOE_COMBINE, t0);
    return rc;
}

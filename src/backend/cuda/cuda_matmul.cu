/* cuda_matmul.cu - matrix products of the CUDA backend.
 *
 * Two paths, chosen by the number of activation rows:
 *
 *   <= CU_MMV_MAX_TOK rows (decode): a matrix-vector kernel, one warp per
 *   weight row, that reads each weight once for all rows, decodes it from
 *   its stored form (F32, F16, BF16, or GGUF blocks) and accumulates in f32
 *   against the f32 activations. Bandwidth-bound, as decode is.
 *
 *   more rows (prefill): cublasGemmEx on tensor cores with f32 accumulation.
 *   F16 and BF16 weights (and quantized weights dequantized to F16 at load)
 *   meet activations converted to the same half type; with gemm_split (the
 *   default) the activations go in as hi + lo halves, two products summed,
 *   which keeps about 22 bits of each activation (the CPU backend multiplies
 *   half weights by unrounded f32 activations, and rounding them to 11 bits
 *   flips near-tied MoE routing). TANDEM_CUDA_GEMM_SPLIT=0 trades that for
 *   one product. F32 weights use an f32 GEMM. Quantized weights that stayed
 *   quantized (no room for F16) are dequantized into a scratch buffer per
 *   product.
 *
 * Shapes: W row-major [ne1][ne0] is, to cuBLAS (column-major), ne0 x ne1
 * with lda = ne0; X [n][ne0] is ne0 x n; Y [n][ne1] is ne1 x n. So
 * Y = W^T-as-stored * X: gemm(T, N, m = ne1, n = n_tok, k = ne0).
 */
#include <stdio.h>
#include <stdlib.h>

#include "backend/cuda/cuda_internal.h"
#include "base/log.h"

/* Rows up to which the matrix-vector kernel beats cuBLAS: it reads the
 * weights once however many rows, and 8 accumulators per lane fit in
 * registers. Not measured yet on a GPU (see docs/architecture.md). */
#define CU_MMV_MAX_TOK 8
/* Weight rows per block of the matrix-vector kernel (one warp each). */
#define CU_MMV_WARPS 4

/* ==== Matrix-vector ==== */

template <uint32_t T>
__global__ void k_mmv(const uint8_t *w, size_t rb, int64_t ncols, int64_t nrows, const float *x, int n_tok, float *y) {
    int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
    int64_t r = (int64_t)blockIdx.x * CU_MMV_WARPS + warp;
    if (r >= nrows) return;
    const uint8_t *row = w + (size_t)r * rb;
    float acc[CU_MMV_MAX_TOK];
#pragma unroll
    for (int t = 0; t < CU_MMV_MAX_TOK; t++) acc[t] = 0.0f;
    for (int64_t c = lane; c < ncols; c += 32) {
        float wv = cu_dq<T>(row, c);
#pragma unroll
        for (int t = 0; t < CU_MMV_MAX_TOK; t++)
            if (t < n_tok) acc[t] += wv * x[(size_t)t * ncols + c];
    }
#pragma unroll
    for (int t = 0; t < CU_MMV_MAX_TOK; t++) {
        float v = acc[t];
        for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
        if (lane == 0 && t < n_tok) y[(size_t)t * nrows + r] = v;
    }
}

static void cu_mmv(cu_impl *c, const cu_weight *w, int expert, const float *x, int n_tok, float *y) {
    unsigned blocks = (unsigned)((w->ne1 + CU_MMV_WARPS - 1) / CU_MMV_WARPS);
    if (w->half) {
        const uint8_t *base = (const uint8_t *)(w->half + (size_t)expert * w->ne1 * w->ne0);
        k_mmv<GGML_TYPE_F16><<<blocks, 32 * CU_MMV_WARPS, 0, c->cs>>>(base, (size_t)w->ne0 * 2, w->ne0, w->ne1, x,
                                                                     n_tok, y);
    } else {
        const uint8_t *base = (const uint8_t *)w->raw + (size_t)expert * w->ne1 * w->row_bytes;
        CU_TYPE_SWITCH(w->type, k_mmv<TT><<<blocks, 32 * CU_MMV_WARPS, 0, c->cs>>>(base, w->row_bytes, w->ne0, w->ne1,
                                                                                 x, n_tok, y));
    }
    cu_check(c, cudaGetLastError(), "mul_mat (matrix-vector)");
}

/* ==== cuBLAS ==== */

/* The type w meets cuBLAS in: its resident half copy or native type, else
 * F16 (quantized weights dequantized per product). */
cudaDataType_t cu_matmul_act_type(const cu_weight *w) {
    if (w->half) return CUDA_R_16F;
    switch (w->type) {
    case GGML_TYPE_F32: return CUDA_R_32F;
    case GGML_TYPE_BF16: return CUDA_R_16BF;
    default: return CUDA_R_16F;
    }
}

/* Expert e of w as a cuBLAS operand of type cu_matmul_act_type(w) (dequantizing a
 * quantized weight into the scratch buffer if it has no F16 copy). */
static const void *cu_gemm_weight(cu_impl *c, const cu_weight *w, int expert) {
    size_t n = (size_t)w->ne1 * (size_t)w->ne0;
    if (w->half) return w->half + (size_t)expert * n;
    const uint8_t *raw = (const uint8_t *)w->raw + (size_t)expert * w->ne1 * w->row_bytes;
    if (cu_is_half_native(w->type)) return raw;
    if (cu_buf_need(c, &c->wtmp, n * 2) || cu_launch_dequant(c, w->type, raw, (uint16_t *)c->wtmp.p, (int64_t)n))
        return NULL;
    return c->wtmp.p;
}

int cu_matmul_act_room(cu_impl *c, cudaDataType_t type, const float *x, size_t n, cu_act *a) {
    *a = (cu_act){ type, x, NULL };
    if (type == CUDA_R_32F) return 0;
    const int split = c->gemm_split != 0;
    if (cu_buf_need(c, &c->act, n * 2 * (split ? 2 : 1))) return -1;
    uint16_t *h = (uint16_t *)c->act.p;
    a->hi = h;
    a->lo = split ? h + n : NULL;
    return 0;
}

int cu_matmul_act(cu_impl *c, cudaDataType_t type, const float *x, size_t n, cu_act *a) {
    if (cu_matmul_act_room(c, type, x, n, a)) return -1;
    if (type != CUDA_R_32F) cu_launch_to_half(c, type == CUDA_R_16BF, x, (void *)a->hi, (void *)a->lo, n);
    return c->failed ? -1 : 0;
}

/* y = W_e x for n_tok rows whose activations cu_matmul_act prepared (bl
 * may be NULL): one product, or two summed. */
static void cu_gemm_run(cu_impl *c, const cu_weight *w, int expert, cudaDataType_t at, const void *bh,
                        const void *bl, int n_tok, float *y) {
    const void *a = cu_gemm_weight(c, w, expert);
    if (!a) return;
    const float one = 1.0f, zero = 0.0f;
    int m = (int)w->ne1, k = (int)w->ne0;
    cu_check_blas(c, cublasGemmEx(c->blas, CUBLAS_OP_T, CUBLAS_OP_N, m, n_tok, k, &one, a, at, k, bh, at, k, &zero,
                                  y, CUDA_R_32F, m, CUBLAS_COMPUTE_32F, CUBLAS_GEMM_DEFAULT), "cublasGemmEx");
    if (bl)
        cu_check_blas(c, cublasGemmEx(c->blas, CUBLAS_OP_T, CUBLAS_OP_N, m, n_tok, k, &one, a, at, k, bl, at, k, &one,
                                      y, CUDA_R_32F, m, CUBLAS_COMPUTE_32F, CUBLAS_GEMM_DEFAULT), "cublasGemmEx (lo)");
}

static void cu_gemm(cu_impl *c, const cu_weight *w, int expert, const float *x, int n_tok, float *y) {
    cu_act a;
    if (cu_matmul_act(c, cu_matmul_act_type(w), x, (size_t)n_tok * w->ne0, &a)) return;
    cu_gemm_run(c, w, expert, a.type, a.hi, a.lo, n_tok, y);
}

int cu_matmul_uses_mmv(int n_tok) { return n_tok <= CU_MMV_MAX_TOK; }

void cu_matmul(cu_impl *c, const cu_weight *w, int expert, const float *x, int n_tok, float *y) {
    if (n_tok <= 0 || c->failed) return;
    if (cu_matmul_uses_mmv(n_tok)) cu_mmv(c, w, expert, x, n_tok, y);
    else cu_gemm(c, w, expert, x, n_tok, y);
}

/* ==== Several experts ==== */

/* The pointer arrays of a batched call, 4 x n_group of them (A, B hi,
 * B lo, C), into the backend's ptrs buffer in stream order; the device
 * copy, or NULL with the failure recorded. The host array may be freed on
 * return: a copy from pageable memory has taken its bytes by then. */
static const void **cu_upload_ptrs(cu_impl *c, const void *const *ptr, int n_group, const char *what) {
    const size_t bytes = sizeof(void *) * 4 * (size_t)n_group;
    if (cu_buf_need(c, &c->ptrs, bytes) ||
        cu_check(c, cudaMemcpyAsync(c->ptrs.p, ptr, bytes, cudaMemcpyHostToDevice, c->cs), what))
        return NULL;
    return (const void **)c->ptrs.p;
}

/* One cublasGemmGroupedBatchedEx call for all groups (each a group of one
 * problem), over activations a converted for w: weights with a resident
 * half or f32 form only. Returns 0 if it ran, 1 if the caller must loop
 * instead. */
static int cu_grouped(cu_impl *c, const cu_weight *w, int n_group, const int *e, const int *off, const int *cnt,
                      const cu_act *a, float *y) {
    const cudaDataType_t at = a->type;
    const unsigned tbit = 1u << (at == CUDA_R_16F ? 0 : at == CUDA_R_16BF ? 1 : 2);
    if (c->moe_grouped_no & tbit) return 1;
    size_t esz = at == CUDA_R_32F ? 4 : 2;
    const uint8_t *wbase = w->half ? (const uint8_t *)w->half : (const uint8_t *)w->raw;
    size_t wexp = (size_t)w->ne1 * (size_t)w->ne0 * esz;
    /* host arrays: per group shapes; device arrays: A, B(hi), B(lo), C pointers */
    int *hi = (int *)malloc(sizeof(int) * 7 * (size_t)n_group);
    float *ab = (float *)malloc(sizeof(float) * 2 * (size_t)n_group);
    cublasOperation_t *ops = (cublasOperation_t *)malloc(sizeof *ops * 2 * (size_t)n_group);
    const void **ptr = (const void **)malloc(sizeof(void *) * 4 * (size_t)n_group);
    int rc = 0;
    if (!hi || !ab || !ops || !ptr) { cu_check(c, cudaErrorMemoryAllocation, "grouped GEMM tables"); goto out; }
    {
        int *mm = hi, *nn = hi + n_group, *kk = hi + 2 * n_group, *lda = hi + 3 * n_group, *ldb = hi + 4 * n_group,
            *ldc = hi + 5 * n_group, *gs = hi + 6 * n_group;
        for (int g = 0; g < n_group; g++) {
            mm[g] = (int)w->ne1; nn[g] = cnt[g]; kk[g] = (int)w->ne0;
            lda[g] = (int)w->ne0; ldb[g] = (int)w->ne0; ldc[g] = (int)w->ne1; gs[g] = 1;
            ab[g] = 1.0f; ab[n_group + g] = 0.0f;
            ops[g] = CUBLAS_OP_T; ops[n_group + g] = CUBLAS_OP_N;
            ptr[g] = wbase + (size_t)e[g] * wexp;
            ptr[n_group + g] = (const uint8_t *)a->hi + (size_t)off[g] * w->ne0 * esz;
            ptr[2 * n_group + g] = a->lo ? (const uint8_t *)a->lo + (size_t)off[g] * w->ne0 * esz : NULL;
            ptr[3 * n_group + g] = y + (size_t)off[g] * w->ne1;
        }
        const void **dp = cu_upload_ptrs(c, ptr, n_group, "grouped GEMM pointers");
        if (!dp) goto out;
        cublasStatus_t s = cublasGemmGroupedBatchedEx(c->blas, ops, ops + n_group, mm, nn, kk, ab, dp, at, lda,
                                                      dp + n_group, at, ldb, ab + n_group, (void *const *)(dp + 3 * n_group),
                                                      CUDA_R_32F, ldc, n_group, gs, CUBLAS_COMPUTE_32F);
        if (s == CUBLAS_STATUS_NOT_SUPPORTED) {
            log_info(NULL, "CUDA backend: cublasGemmGroupedBatchedEx does not take %s weights here; their MoE "
                           "experts go one cublasGemmEx each", at == CUDA_R_16F ? "F16" : at == CUDA_R_16BF ? "BF16" : "F32");
            c->moe_grouped_no |= tbit;
            rc = 1;
            goto out;
        }
        if (cu_check_blas(c, s, "cublasGemmGroupedBatchedEx")) goto out;
        if (a->lo) {
            for (int g = 0; g < n_group; g++) ab[n_group + g] = 1.0f;   /* beta: add the lo product */
            cu_check_blas(c, cublasGemmGroupedBatchedEx(c->blas, ops, ops + n_group, mm, nn, kk, ab, dp, at, lda,
                                                        dp + 2 * n_group, at, ldb, ab + n_group,
                                                        (void *const *)(dp + 3 * n_group), CUDA_R_32F, ldc, n_group,
                                                        gs, CUBLAS_COMPUTE_32F),
                          "cublasGemmGroupedBatchedEx (lo)");
        }
    }
out:
    /* the host arrays are read when the call is made, not when it runs */
    free(hi);
    free(ab);
    free(ops);
    free(ptr);
    return rc;
}

void cu_matmul_experts(cu_impl *c, const cu_weight *w, int n_group, const int *e, const int *off, const int *cnt,
                       const float *x, const cu_act *a, float *y) {
    if (n_group <= 0 || c->failed) return;
    const int total = off[n_group - 1] + cnt[n_group - 1];
    const cudaDataType_t at = cu_matmul_act_type(w);
    if (a && a->type != at) a = NULL;   /* converted for another type: not for these */
    cu_act own;
    /* decode-sized groups read each expert once in the matrix-vector kernel */
    if (c->moe_grouped && total > CU_MMV_MAX_TOK * n_group && (w->half || cu_is_half_native(w->type))) {
        if (!a && cu_matmul_act(c, at, x, (size_t)total * w->ne0, &own)) return;
        if (cu_grouped(c, w, n_group, e, off, cnt, a ? a : &own, y) == 0 || c->failed) return;
        if (!a) a = &own;
    }
    /* one expert at a time: the activations of all groups converted once,
     * each group then one product (or the matrix-vector kernel) */
    const size_t esz = at == CUDA_R_32F ? 4 : 2;
    int any_gemm = 0;
    for (int g = 0; g < n_group; g++) any_gemm |= !cu_matmul_uses_mmv(cnt[g]);
    if (any_gemm && !a) {
        if (cu_matmul_act(c, at, x, (size_t)total * w->ne0, &own)) return;
        a = &own;
    }
    for (int g = 0; g < n_group && !c->failed; g++) {
        const size_t xo = (size_t)off[g] * w->ne0;
        float *yg = y + (size_t)off[g] * w->ne1;
        if (cu_matmul_uses_mmv(cnt[g])) cu_mmv(c, w, e[g], x + xo, cnt[g], yg);
        else cu_gemm_run(c, w, e[g], at, (const uint8_t *)a->hi + xo * esz,
                         a->lo ? (const uint8_t *)a->lo + xo * esz : NULL, cnt[g], yg);
    }
}

/* ==== Several experts, padded to one shape ==== */

/* The rows of each group's operands and products stay 16-byte aligned. */
int cu_matmul_pads(const cu_weight *w) {
    return (w->half != NULL || cu_is_half_native(w->type)) && w->ne0 % 8 == 0 && w->ne1 % 4 == 0;
}

/* Every group is stride rows (the MoE block zero-filled the rows past a
 * group's count), so all of them are one uniform batched GEMM: strided when
 * the groups are all the experts in order (a long pass uses every one),
 * else through pointer arrays. cuBLAS runs a uniform batch as one kernel
 * over every expert at once, where the grouped call's small problems of
 * different sizes ran at a fraction of the card (docs/bench.md). */
void cu_matmul_experts_padded(cu_impl *c, const cu_weight *w, int n_group, const int *e, int stride,
                              const cu_act *a, float *y) {
    if (n_group <= 0 || stride <= 0 || c->failed) return;
    if (a->type != cu_matmul_act_type(w)) { cu_check(c, cudaErrorInvalidValue, "batched GEMM activations"); return; }
    const cudaDataType_t at = a->type;
    const size_t esz = at == CUDA_R_32F ? 4 : 2;
    const uint8_t *wbase = w->half ? (const uint8_t *)w->half : (const uint8_t *)w->raw;
    const size_t wexp = (size_t)w->ne1 * (size_t)w->ne0;          /* elements of one expert */
    const int m = (int)w->ne1, k = (int)w->ne0;
    const long long sb = (long long)stride * k, sc = (long long)stride * m;
    const float one = 1.0f, zero = 0.0f;
    int in_order = (int64_t)n_group * w->ne1 == w->rows;
    for (int g = 0; g < n_group && in_order; g++) in_order = e[g] == g;
    if (in_order) {
        const void *half[2] = { a->hi, a->lo };
        for (int h = 0; h < 2 && half[h]; h++)
            cu_check_blas(c, cublasGemmStridedBatchedEx(c->blas, CUBLAS_OP_T, CUBLAS_OP_N, m, stride, k, &one, wbase,
                                                        at, k, (long long)wexp, half[h], at, k, sb, h ? &one : &zero, y,
                                                        CUDA_R_32F, m, sc, n_group, CUBLAS_COMPUTE_32F,
                                                        CUBLAS_GEMM_DEFAULT),
                          h ? "cublasGemmStridedBatchedEx (lo)" : "cublasGemmStridedBatchedEx");
        return;
    }
    /* pointer arrays A, B(hi), B(lo), C */
    const void **ptr = (const void **)malloc(sizeof(void *) * 4 * (size_t)n_group);
    if (!ptr) { cu_check(c, cudaErrorMemoryAllocation, "batched GEMM pointers"); return; }
    for (int g = 0; g < n_group; g++) {
        ptr[g] = wbase + (size_t)e[g] * wexp * esz;
        ptr[n_group + g] = (const uint8_t *)a->hi + (size_t)g * sb * esz;
        ptr[2 * n_group + g] = a->lo ? (const uint8_t *)a->lo + (size_t)g * sb * esz : NULL;
        ptr[3 * n_group + g] = y + (size_t)g * sc;
    }
    const void *const *dp = cu_upload_ptrs(c, ptr, n_group, "batched GEMM pointers");
    free(ptr);
    if (!dp) return;
    for (int h = 0; h < 2 && (h == 0 || a->lo); h++)
        cu_check_blas(c, cublasGemmBatchedEx(c->blas, CUBLAS_OP_T, CUBLAS_OP_N, m, stride, k, &one, dp, at, k,
                                             dp + (1 + h) * n_group, at, k, h ? &one : &zero,
                                             (void *const *)(dp + 3 * n_group), CUDA_R_32F, m, n_group,
                                             CUBLAS_COMPUTE_32F, CUBLAS_GEMM_DEFAULT),
                      h ? "cublasGemmBatchedEx (lo)" : "cublasGemmBatchedEx");
}

/* ==== The cuBLAS ceiling (tandem bench) ==== */

/* Seconds of one F16 x F16 -> F32 cublasGemmEx of m x n x k in the layout of
 * cu_gemm (T, N), f32 accumulation, on the backend's stream: the median of
 * 7 timed calls after 2 warm-ups, on operands filled with small values. */
extern "C" int backend_cuda_gemm_seconds(backend *be, int m, int n, int k, double *seconds, char *err, size_t errlen) {
    cu_impl *c = cu_of(be);
    cudaSetDevice(c->device);
    void *a = NULL, *b = NULL, *y = NULL;
    cudaEvent_t e0 = NULL, e1 = NULL;
    float ms[7];
    int rc = -1;
    const float one = 1.0f, zero = 0.0f;
    cudaError_t ce = cudaMalloc(&a, (size_t)m * k * 2);
    if (ce == cudaSuccess) ce = cudaMalloc(&b, (size_t)n * k * 2);
    if (ce == cudaSuccess) ce = cudaMalloc(&y, (size_t)m * n * 4);
    if (ce == cudaSuccess) ce = cudaMemsetAsync(a, 0x11, (size_t)m * k * 2, c->cs);   /* f16 0x1111: about 6e-4 */
    if (ce == cudaSuccess) ce = cudaMemsetAsync(b, 0x11, (size_t)n * k * 2, c->cs);
    if (ce == cudaSuccess) ce = cudaEventCreate(&e0);
    if (ce == cudaSuccess) ce = cudaEventCreate(&e1);
    if (ce != cudaSuccess) { snprintf(err, errlen, "cuBLAS ceiling: %s", cudaGetErrorString(ce)); goto out; }
    for (int i = 0; i < 9; i++) {
        cudaEventRecord(e0, c->cs);
        cublasStatus_t s = cublasGemmEx(c->blas, CUBLAS_OP_T, CUBLAS_OP_N, m, n, k, &one, a, CUDA_R_16F, k, b,
                                        CUDA_R_16F, k, &zero, y, CUDA_R_32F, m, CUBLAS_COMPUTE_32F, CUBLAS_GEMM_DEFAULT);
        cudaEventRecord(e1, c->cs);
        if (s != CUBLAS_STATUS_SUCCESS) { snprintf(err, errlen, "cuBLAS ceiling: %s", cublasGetStatusString(s)); goto out; }
        if ((ce = cudaEventSynchronize(e1)) != cudaSuccess) { snprintf(err, errlen, "cuBLAS ceiling: %s", cudaGetErrorString(ce)); goto out; }
        if (i >= 2) cudaEventElapsedTime(&ms[i - 2], e0, e1);
    }
    for (int i = 1; i < 7; i++)   /* insertion sort for the median */
        for (int j = i; j > 0 && ms[j] < ms[j - 1]; j--) { float t = ms[j]; ms[j] = ms[j - 1]; ms[j - 1] = t; }
    *seconds = ms[3] / 1e3;
    rc = 0;
out:
    cudaGetLastError();
    if (e0) cudaEventDestroy(e0);
    if (e1) cudaEventDestroy(e1);
    cudaFree(a); cudaFree(b); cudaFree(y);
    return rc;
}

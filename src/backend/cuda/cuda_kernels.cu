/* cuda_kernels.cu - the CUDA backend's element-wise and row-wise kernels:
 * embedding rows, RMS norm, bias, SwiGLU, add, RoPE, the KV store, and the
 * conversions that feed cuBLAS (weight dequantization, activations to
 * F16/BF16). Each follows the CPU backend's arithmetic (ops.c, quant.c):
 * RMS norm sums squares in double, SwiGLU uses expf, RoPE's angles are
 * computed as in backend_cpu.c, and KV rows are encoded bit for bit as
 * quant_quantize_act_row does.
 */
#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include "backend/cuda/cuda_internal.h"

/* Threads per block of the row kernels and the element-wise kernels. */
#define CU_ROW_THREADS 256
#define CU_EW_THREADS 256
/* Grid size cap for grid-stride loops: enough blocks to fill any current GPU. */
#define CU_MAX_BLOCKS 65535

static unsigned cu_blocks(size_t n, unsigned threads) {
    size_t b = (n + threads - 1) / threads;
    return (unsigned)(b < 1 ? 1 : b > CU_MAX_BLOCKS ? CU_MAX_BLOCKS : b);
}

static void cu_launched(cu_impl *c, const char *what) { cu_check(c, cudaGetLastError(), what); }

/* ==== Embedding rows ==== */

template <uint32_t T>
__global__ void k_get_rows(const uint8_t *w, size_t rb, const int32_t *ids, int n, int64_t ne0, float *out) {
    for (int r = blockIdx.y; r < n; r += gridDim.y) {
        const uint8_t *row = w + (size_t)ids[r] * rb;
        for (int64_t i = blockIdx.x * (int64_t)blockDim.x + threadIdx.x; i < ne0; i += (int64_t)gridDim.x * blockDim.x)
            out[(size_t)r * ne0 + i] = cu_dq<T>(row, i);
    }
}

int cu_launch_get_rows(cu_impl *c, const cu_weight *w, const int32_t *ids, int n, float *out) {
    if (n <= 0) return 0;
    dim3 grid(cu_blocks((size_t)w->ne0, CU_EW_THREADS), n < CU_MAX_BLOCKS ? n : CU_MAX_BLOCKS);
    if (w->half) {
        k_get_rows<GGML_TYPE_F16><<<grid, CU_EW_THREADS, 0, c->cs>>>((const uint8_t *)w->half, (size_t)w->ne0 * 2,
                                                                   ids, n, w->ne0, out);
    } else {
        int ok = 0;
        CU_TYPE_SWITCH(w->type, (k_get_rows<TT><<<grid, CU_EW_THREADS, 0, c->cs>>>((const uint8_t *)w->raw,
                                 w->row_bytes, ids, n, w->ne0, out), ok = 1));
        if (!ok) return -1;
    }
    cu_launched(c, "get_rows");
    return 0;
}

/* ==== RMS norm ==== */

/* Sum over the block (blockDim.x a multiple of 32, at most 1024). */
__device__ double cu_block_sum(double v, double *red) {
    for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
    int w = threadIdx.x / 32, l = threadIdx.x % 32;
    if (l == 0) red[w] = v;
    __syncthreads();
    double s = 0.0;
    for (int i = 0; i < (int)(blockDim.x / 32); i++) s += red[i];   /* same order in every thread */
    __syncthreads();
    return s;
}

__global__ void k_rms_norm(const float *x, const float *w, float *y, int n_rows, int dim, float eps) {
    __shared__ double red[32];
    for (int r = blockIdx.x; r < n_rows; r += gridDim.x) {
        const float *xr = x + (size_t)r * dim;
        float *yr = y + (size_t)r * dim;
        double s = 0.0;
        for (int i = threadIdx.x; i < dim; i += blockDim.x) s += (double)(xr[i] * xr[i]);
        s = cu_block_sum(s, red);
        float scale = 1.0f / sqrtf((float)(s / (double)dim) + eps);
        for (int i = threadIdx.x; i < dim; i += blockDim.x) {
            float v = xr[i] * scale;
            yr[i] = w ? v * w[i] : v;
        }
    }
}

void cu_launch_rms_norm(cu_impl *c, const float *x, const float *w, float *y, int n_rows, int dim, float eps) {
    if (n_rows <= 0 || c->failed) return;
    k_rms_norm<<<n_rows < CU_MAX_BLOCKS ? n_rows : CU_MAX_BLOCKS, CU_ROW_THREADS, 0, c->cs>>>(x, w, y, n_rows, dim, eps);
    cu_launched(c, "rms_norm");
}

/* ==== Element-wise ==== */

__global__ void k_add_bias(float *x, const float *b, size_t n, int dim) {
    for (size_t i = blockIdx.x * (size_t)blockDim.x + threadIdx.x; i < n; i += (size_t)gridDim.x * blockDim.x)
        x[i] += b[i % dim];
}

void cu_launch_add_bias(cu_impl *c, float *x, const float *b, int n_tok, int dim) {
    size_t n = (size_t)n_tok * dim;
    if (!n || c->failed) return;
    k_add_bias<<<cu_blocks(n, CU_EW_THREADS), CU_EW_THREADS, 0, c->cs>>>(x, b, n, dim);
    cu_launched(c, "add_bias");
}

__global__ void k_swiglu(const float *g, const float *u, float *y, size_t n) {
    for (size_t i = blockIdx.x * (size_t)blockDim.x + threadIdx.x; i < n; i += (size_t)gridDim.x * blockDim.x)
        y[i] = g[i] / (1.0f + expf(-g[i])) * u[i];
}

void cu_launch_swiglu(cu_impl *c, const float *g, const float *u, float *y, size_t n) {
    if (!n || c->failed) return;
    k_swiglu<<<cu_blocks(n, CU_EW_THREADS), CU_EW_THREADS, 0, c->cs>>>(g, u, y, n);
    cu_launched(c, "swiglu");
}

__global__ void k_add(float *x, const float *y, size_t n) {
    for (size_t i = blockIdx.x * (size_t)blockDim.x + threadIdx.x; i < n; i += (size_t)gridDim.x * blockDim.x)
        x[i] += y[i];
}

void cu_launch_add(cu_impl *c, float *x, const float *y, size_t n) {
    if (!n || c->failed) return;
    k_add<<<cu_blocks(n, CU_EW_THREADS), CU_EW_THREADS, 0, c->cs>>>(x, y, n);
    cu_launched(c, "add");
}

/* ==== RoPE ==== */

/* One block per row: the row's cos/sin are computed once into shared
 * memory (n_rot / 2 <= 256 pairs: head_dim is at most 512), then every
 * head's pairs are rotated. */
__global__ void k_rope(float *x, int n_tok, int n_head, int head_dim, const int32_t *pos, int mode, int n_rot,
                       float theta_scale, float freq_scale, const float *ff) {
    __shared__ float cs[256], sn[256];
    int half = n_rot / 2;
    for (int t = blockIdx.x; t < n_tok; t += gridDim.x) {
        for (int i = threadIdx.x; i < half; i += blockDim.x)
            cu_rope_angle(pos[t], i, theta_scale, ff ? ff[i] : 1.0f, freq_scale, &cs[i], &sn[i]);
        __syncthreads();
        for (int k = threadIdx.x; k < n_head * half; k += blockDim.x) {
            int h = k / half, i = k % half;
            float *v = x + ((size_t)t * n_head + h) * head_dim;
            int a = mode == ROPE_NEOX ? i : 2 * i, b = mode == ROPE_NEOX ? i + half : 2 * i + 1;
            float x0 = v[a], x1 = v[b];
            v[a] = x0 * cs[i] - x1 * sn[i];
            v[b] = x0 * sn[i] + x1 * cs[i];
        }
        __syncthreads();
    }
}

void cu_launch_rope(cu_impl *c, float *x, int n_tok, int n_head, int head_dim, const int32_t *pos,
                    const rope_cfg *rc, const float *ff) {
    if (n_tok <= 0 || c->failed) return;
    if (rc->n_rot > 512 || rc->n_rot < 2) { cu_check(c, cudaErrorInvalidValue, "rope (n_rot above 512)"); return; }
    float theta_scale = powf(rc->freq_base, -2.0f / (float)rc->n_rot);   /* on the host, as the CPU backend */
    k_rope<<<n_tok < CU_MAX_BLOCKS ? n_tok : CU_MAX_BLOCKS, CU_ROW_THREADS, 0, c->cs>>>(
        x, n_tok, n_head, head_dim, pos, rc->mode, rc->n_rot, theta_scale, rc->freq_scale, ff);
    cu_launched(c, "rope");
}

/* ==== KV store ==== */

/* Row r of k and v ([n][dim] f32) -> the cache rows kdst[r], vdst[r]. */
__global__ void k_kv_store(uint32_t dt, int dim, int n, uint8_t *const *kdst, uint8_t *const *vdst,
                           const float *k, const float *v) {
    const float *src = blockIdx.y ? v : k;
    uint8_t *const *dst = blockIdx.y ? vdst : kdst;
    for (int r = blockIdx.x; r < n; r += gridDim.x) {
        const float *x = src + (size_t)r * dim;
        uint8_t *y = dst[r];
        if (dt == GGML_TYPE_Q8_0)
            for (int b = threadIdx.x; b < dim / 32; b += blockDim.x) cu_kv_encode_q8_0(x + 32 * b, y + 34 * b);
        else
            for (int i = threadIdx.x; i < dim; i += blockDim.x) cu_kv_encode_half(dt, x[i], y + 2 * i);
    }
}

void cu_launch_kv_store(cu_impl *c, uint32_t dt, int dim, int n_tok, uint8_t *const *kdst, uint8_t *const *vdst,
                        const float *k, const float *v) {
    if (n_tok <= 0 || c->failed) return;
    dim3 grid(n_tok < CU_MAX_BLOCKS ? n_tok : CU_MAX_BLOCKS, 2);
    k_kv_store<<<grid, 128, 0, c->cs>>>(dt, dim, n_tok, kdst, vdst, k, v);
    cu_launched(c, "kv_store");
}

/* ==== Conversions for cuBLAS ==== */

/* A whole quantized tensor -> F16 (its rows are whole blocks, so the
 * tensor reads as one long row). */
template <uint32_t T>
__global__ void k_dequant(const uint8_t *raw, uint16_t *half, int64_t n) {
    for (int64_t i = blockIdx.x * (int64_t)blockDim.x + threadIdx.x; i < n; i += (int64_t)gridDim.x * blockDim.x)
        half[i] = cu_f32_to_f16(cu_dq<T>(raw, i));
}

int cu_launch_dequant(cu_impl *c, uint32_t type, const void *raw, uint16_t *half, int64_t n) {
    if (n <= 0) return 0;
    int ok = 0;
    CU_TYPE_SWITCH(type, (k_dequant<TT><<<cu_blocks((size_t)n, CU_EW_THREADS), CU_EW_THREADS, 0, c->cs>>>(
                              (const uint8_t *)raw, half, n), ok = 1));
    if (!ok) return -1;
    return cu_check(c, cudaGetLastError(), "dequantize");
}

/* x -> hi = half(x) and, if lo, lo = half(x - hi): hi + lo carries about
 * 22 bits of x (16 for BF16), against 11 (8) for hi alone. */
__global__ void k_to_half(int bf16, const float *x, void *hi, void *lo, size_t n) {
    for (size_t i = blockIdx.x * (size_t)blockDim.x + threadIdx.x; i < n; i += (size_t)gridDim.x * blockDim.x) {
        float v = x[i];
        if (bf16) {
            __nv_bfloat16 h = __float2bfloat16_rn(v);
            ((__nv_bfloat16 *)hi)[i] = h;
            if (lo) ((__nv_bfloat16 *)lo)[i] = __float2bfloat16_rn(v - __bfloat162float(h));
        } else {
            __half h = __float2half_rn(v);
            ((__half *)hi)[i] = h;
            if (lo) ((__half *)lo)[i] = __float2half_rn(v - __half2float(h));
        }
    }
}

void cu_launch_to_half(cu_impl *c, int bf16, const float *x, void *hi, void *lo, size_t n) {
    if (!n || c->failed) return;
    k_to_half<<<cu_blocks(n, CU_EW_THREADS), CU_EW_THREADS, 0, c->cs>>>(bf16, x, hi, lo, n);
    cu_launched(c, "to_half");
}

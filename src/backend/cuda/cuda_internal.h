/* cuda_internal.h - state and helpers shared by the CUDA backend's files
 * (C++ compiled by nvcc; nothing here is visible to the C code).
 *
 * The block decoders and KV encoders are __host__ __device__ and written
 * from the GGUF block layouts (facts of the format) in the same arithmetic
 * as quant.c, so that backend_cuda_host_* can test them without a GPU.
 */
#ifndef TANDEM_CUDA_INTERNAL_H
#define TANDEM_CUDA_INTERNAL_H

#include <cublas_v2.h>
#include <cuda_runtime.h>
#include <math.h>
#include <pthread.h>
#include <stdint.h>
#include <string.h>

extern "C" {
#include "engine/backend.h"
#include "engine/gguf.h"
#include "engine/kvcache.h"
}
#include "backend/cuda/backend_cuda.h"

#define HD __host__ __device__ __forceinline__

/* ==== Scalar conversions (bit-exact with quant.c) ==== */

HD float cu_bits_f32(uint32_t u) { union { uint32_t u; float f; } x; x.u = u; return x.f; }
HD uint32_t cu_f32_bits(float f) { union { uint32_t u; float f; } x; x.f = f; return x.u; }

HD float cu_f16_to_f32(uint16_t h) {
    uint32_t sign = (uint32_t)(h & 0x8000) << 16, exp = (h >> 10) & 0x1f, mant = h & 0x3ff;
    if (exp == 0) { float v = (float)mant * 5.9604644775390625e-08f; return sign ? -v : v; }  /* 2^-24 */
    if (exp == 31) return cu_bits_f32(sign | 0x7f800000u | (mant << 13));
    return cu_bits_f32(sign | ((exp + 112) << 23) | (mant << 13));
}

/* round to nearest even, overflow to infinity, subnormals kept */
HD uint16_t cu_f32_to_f16(float f) {
    uint32_t x = cu_f32_bits(f), sign = (x >> 16) & 0x8000, ax = x & 0x7fffffffu;
    if (ax > 0x7f800000u) return (uint16_t)(sign | 0x7e00 | ((ax >> 13) & 0x3ff));
    if (ax >= 0x477ff000u) return (uint16_t)(sign | 0x7c00);
    if (ax < 0x38800000u) {
        uint32_t e = ax >> 23;
        if (e < 102) return (uint16_t)sign;
        uint32_t mant = (ax & 0x7fffff) | 0x800000, shift = 126 - e;
        uint32_t r = mant >> shift, rem = mant & ((1u << shift) - 1), half = 1u << (shift - 1);
        if (rem > half || (rem == half && (r & 1))) r++;
        return (uint16_t)(sign | r);
    }
    uint32_t r = (((ax >> 23) - 112) << 10) | ((ax & 0x7fffff) >> 13), rem = ax & 0x1fff;
    if (rem > 0x1000 || (rem == 0x1000 && (r & 1))) r++;
    return (uint16_t)(sign | r);
}

HD float cu_bf16_to_f32(uint16_t h) { return cu_bits_f32((uint32_t)h << 16); }

HD uint16_t cu_f32_to_bf16(float f) {
    uint32_t u = cu_f32_bits(f);
    if ((u & 0x7fffffffu) > 0x7f800000u) return (uint16_t)((u >> 16) | 0x40);
    return (uint16_t)((u + 0x7fff + ((u >> 16) & 1)) >> 16);
}

HD uint16_t cu_ld16(const uint8_t *p) { return (uint16_t)(p[0] | (p[1] << 8)); }

/* ==== Block decoders: element i of a row of `type` ==== */
/* Block sizes in bytes (GGUF layouts): Q4_0 18, Q5_0 22, Q8_0 34, Q4_1 20,
 * Q5_1 24 (32 elements); Q4_K 144, Q5_K 176, Q6_K 210 (256 elements). */

/* 6-bit scale and min of sub-block j (0..7) of a Q4_K/Q5_K block */
HD void cu_scale_min_k4(int j, const uint8_t *q, int *sc, int *m) {
    if (j < 4) { *sc = q[j] & 63; *m = q[j + 4] & 63; }
    else { *sc = (q[j + 4] & 0xF) | ((q[j - 4] >> 6) << 4); *m = (q[j + 4] >> 4) | ((q[j] >> 6) << 4); }
}

HD float cu_dq_q4_0(const uint8_t *row, int64_t i) {
    const uint8_t *b = row + (i / 32) * 18;
    int j = (int)(i % 32), q = j < 16 ? (b[2 + j] & 0xF) : (b[2 + j - 16] >> 4);
    return cu_f16_to_f32(cu_ld16(b)) * (float)(q - 8);
}

HD float cu_dq_q5_0(const uint8_t *row, int64_t i) {
    const uint8_t *b = row + (i / 32) * 22;
    int j = (int)(i % 32);
    uint32_t qh = (uint32_t)b[2] | ((uint32_t)b[3] << 8) | ((uint32_t)b[4] << 16) | ((uint32_t)b[5] << 24);
    int q = j < 16 ? ((b[6 + j] & 0xF) | (int)(((qh >> j) & 1) << 4))
                   : ((b[6 + j - 16] >> 4) | (int)(((qh >> j) & 1) << 4));
    return cu_f16_to_f32(cu_ld16(b)) * (float)(q - 16);
}

/* Q4_1 / Q5_1: d * q + m (d, m f16), q unsigned; Q5_1's fifth bits as Q5_0's */
HD float cu_dq_q4_1(const uint8_t *row, int64_t i) {
    const uint8_t *b = row + (i / 32) * 20;
    int j = (int)(i % 32), q = j < 16 ? (b[4 + j] & 0xF) : (b[4 + j - 16] >> 4);
    return cu_f16_to_f32(cu_ld16(b)) * (float)q + cu_f16_to_f32(cu_ld16(b + 2));
}

HD float cu_dq_q5_1(const uint8_t *row, int64_t i) {
    const uint8_t *b = row + (i / 32) * 24;
    int j = (int)(i % 32);
    uint32_t qh = (uint32_t)b[4] | ((uint32_t)b[5] << 8) | ((uint32_t)b[6] << 16) | ((uint32_t)b[7] << 24);
    int q = j < 16 ? ((b[8 + j] & 0xF) | (int)(((qh >> j) & 1) << 4))
                   : ((b[8 + j - 16] >> 4) | (int)(((qh >> j) & 1) << 4));
    return cu_f16_to_f32(cu_ld16(b)) * (float)q + cu_f16_to_f32(cu_ld16(b + 2));
}

HD float cu_dq_q8_0(const uint8_t *row, int64_t i) {
    const uint8_t *b = row + (i / 32) * 34;
    return cu_f16_to_f32(cu_ld16(b)) * (float)(int8_t)b[2 + i % 32];
}

/* Q4_K and Q5_K: chunk c (of 4) of 64 elements uses sub-blocks 2c (low
 * nibbles) and 2c + 1 (high nibbles); Q5_K's fifth bit of element l of
 * sub-block j is bit j of qh[l]. */
HD float cu_dq_q45_K(const uint8_t *row, int64_t i, int five) {
    const uint8_t *b = row + (i / 256) * (five ? 176 : 144);
    int e = (int)(i % 256), j = e / 32, l = e % 32, c = j / 2;
    const uint8_t *scales = b + 4, *qs = b + (five ? 48 : 16);
    int sc, m;
    cu_scale_min_k4(j, scales, &sc, &m);
    int q = (j & 1) ? (qs[32 * c + l] >> 4) : (qs[32 * c + l] & 0xF);
    if (five) q |= ((b[16 + l] >> j) & 1) << 4;
    float d = cu_f16_to_f32(cu_ld16(b)), dmin = cu_f16_to_f32(cu_ld16(b + 2));
    return d * (float)sc * (float)q - dmin * (float)m;
}

HD float cu_dq_q6_K(const uint8_t *row, int64_t i) {
    const uint8_t *b = row + (i / 256) * 210;
    int e = (int)(i % 256), half = e / 128, g = (e % 128) / 32, l = e % 32;
    const uint8_t *ql = b + 64 * half, *qh = b + 128 + 32 * half;
    int lo = (g & 1) ? ql[l + 32] : ql[l];
    lo = (g & 2) ? (lo >> 4) : (lo & 0xF);
    int q = lo | (((qh[l] >> (2 * g)) & 3) << 4);
    return cu_f16_to_f32(cu_ld16(b + 208)) * (float)(int8_t)b[192 + e / 16] * (float)(q - 32);
}

template <uint32_t T> HD float cu_dq(const uint8_t *row, int64_t i) {
    if (T == GGML_TYPE_F32) return ((const float *)row)[i];
    if (T == GGML_TYPE_F16) return cu_f16_to_f32(((const uint16_t *)row)[i]);
    if (T == GGML_TYPE_BF16) return cu_bf16_to_f32(((const uint16_t *)row)[i]);
    if (T == GGML_TYPE_Q4_0) return cu_dq_q4_0(row, i);
    if (T == GGML_TYPE_Q5_0) return cu_dq_q5_0(row, i);
    if (T == GGML_TYPE_Q8_0) return cu_dq_q8_0(row, i);
    if (T == GGML_TYPE_Q4_1) return cu_dq_q4_1(row, i);
    if (T == GGML_TYPE_Q5_1) return cu_dq_q5_1(row, i);
    if (T == GGML_TYPE_Q4_K) return cu_dq_q45_K(row, i, 0);
    if (T == GGML_TYPE_Q5_K) return cu_dq_q45_K(row, i, 1);
    if (T == GGML_TYPE_Q6_K) return cu_dq_q6_K(row, i);
    return 0.0f;
}

/* Runs the statement with the compile-time constant TT set to a runtime
 * weight type (one kernel instance per type); nothing for other types. */
#define CU_TYPE_SWITCH(type, ...) \
    switch (type) { \
    case GGML_TYPE_F32: { const uint32_t TT = GGML_TYPE_F32; __VA_ARGS__; } break; \
    case GGML_TYPE_F16: { const uint32_t TT = GGML_TYPE_F16; __VA_ARGS__; } break; \
    case GGML_TYPE_BF16: { const uint32_t TT = GGML_TYPE_BF16; __VA_ARGS__; } break; \
    case GGML_TYPE_Q4_0: { const uint32_t TT = GGML_TYPE_Q4_0; __VA_ARGS__; } break; \
    case GGML_TYPE_Q5_0: { const uint32_t TT = GGML_TYPE_Q5_0; __VA_ARGS__; } break; \
    case GGML_TYPE_Q8_0: { const uint32_t TT = GGML_TYPE_Q8_0; __VA_ARGS__; } break; \
    case GGML_TYPE_Q4_1: { const uint32_t TT = GGML_TYPE_Q4_1; __VA_ARGS__; } break; \
    case GGML_TYPE_Q5_1: { const uint32_t TT = GGML_TYPE_Q5_1; __VA_ARGS__; } break; \
    case GGML_TYPE_Q4_K: { const uint32_t TT = GGML_TYPE_Q4_K; __VA_ARGS__; } break; \
    case GGML_TYPE_Q5_K: { const uint32_t TT = GGML_TYPE_Q5_K; __VA_ARGS__; } break; \
    case GGML_TYPE_Q6_K: { const uint32_t TT = GGML_TYPE_Q6_K; __VA_ARGS__; } break; \
    default: break; \
    }

/* ==== KV row encoders (f32 -> cache dtype, as quant_quantize_act_row) ==== */

/* One Q8_0 block of a KV row: d = amax / 127 stored as f16, q = roundf(x / d)
 * with the f32 d (llama.cpp's reference quantizer, as quant.c). */
HD void cu_kv_encode_q8_0(const float *x, uint8_t *y) {
    float amax = 0.0f;
    for (int j = 0; j < 32; j++) amax = fmaxf(amax, fabsf(x[j]));
    float d = amax / 127.0f, id = d != 0.0f ? 1.0f / d : 0.0f;
    uint16_t h = cu_f32_to_f16(d);
    y[0] = (uint8_t)(h & 0xff);
    y[1] = (uint8_t)(h >> 8);
    for (int j = 0; j < 32; j++) y[2 + j] = (uint8_t)(int8_t)roundf(x[j] * id);
}

/* One F16 or BF16 element of a KV row (little-endian bytes). */
HD void cu_kv_encode_half(uint32_t dt, float x, uint8_t *y) {
    uint16_t h = dt == GGML_TYPE_F16 ? cu_f32_to_f16(x) : cu_f32_to_bf16(x);
    y[0] = (uint8_t)(h & 0xff);
    y[1] = (uint8_t)(h >> 8);
}

/* Element e of a cache row of dtype dt (F16, BF16 or Q8_0). */
template <uint32_t DT> HD float cu_kv_get(const uint8_t *row, int e) {
    if (DT == GGML_TYPE_Q8_0) return cu_dq_q8_0(row, e);
    if (DT == GGML_TYPE_BF16) return cu_bf16_to_f32(cu_ld16(row + 2 * e));
    return cu_f16_to_f32(cu_ld16(row + 2 * e));
}

/* ==== Rope angles ==== */
/* theta advances by repeated multiplication in float, as the CPU backend
 * does; cos/sin are taken in double and rounded, which is what a correctly
 * rounded cosf/sinf (glibc) gives. */
HD void cu_rope_angle(int pos, int i, float theta_scale, float ff, float freq_scale, float *c, float *s) {
    float theta = (float)pos;
    for (int k = 0; k < i; k++) theta *= theta_scale;
    float th = theta / ff * freq_scale;
    *c = (float)cos((double)th);
    *s = (float)sin((double)th);
}

/* ==== Backend state ==== */

/* The device copy of one weight, shared by every be_weight with the same
 * host data (tied embeddings bind one tensor twice). */
typedef struct cu_weight {
    const void *host;
    uint32_t type;              /* GGUF type of `raw` */
    int64_t ne0, ne1, rows;     /* row length; rows of one expert; rows over all experts */
    size_t row_bytes;
    void *raw;                  /* the GGUF bytes, unless dequantized to `half` */
    uint16_t *half;             /* F16 rows (quantized weights dequantized at load), or NULL */
    struct cu_weight *next;
} cu_weight;

/* The device mirror of one host KV cache (same layout). */
typedef struct cu_kv {
    const kvcache *kv;
    int n_layer, n_ctx, dim;
    uint32_t dtype;
    size_t row_bytes;
    uint8_t *k, *v;             /* [n_layer][n_ctx][row_bytes] */
    int *valid;                 /* [n_layer]: positions [0, valid) equal the host rows */
    struct cu_kv *next;
} cu_kv;

/* One layer's rows on their way back to the host caches. */
typedef struct {
    kvcache *kv;
    int pos0, n;
    size_t off;                 /* K at off, V at off + n * row_bytes in the staging buffer */
} cu_span;

typedef struct {
    int pending, layer;
    cudaEvent_t done;
    uint8_t *host;              /* pinned staging */
    size_t cap;
    cu_span *span;
    int n_span, span_cap;
} cu_kv_slot;

/* ==== Op timing (TANDEM_CUDA_PROFILE=1) ==== */
/* With profiling on, every op waits for the stream before and after it and
 * adds its wall time to its kind; the table goes to stderr when the backend
 * is destroyed. The waits serialise the copy-back stream with compute, so
 * the sum is the pass without overlap: a breakdown, not a speed. */
enum {
    CU_P_GET_ROWS, CU_P_RMS_NORM, CU_P_MMV, CU_P_GEMM, CU_P_BIAS, CU_P_ROPE, CU_P_KV_STORE, CU_P_ATTN,
    CU_P_SWIGLU, CU_P_ADD, CU_P_MOE_LOGITS, CU_P_MOE_TOPK, CU_P_MOE_COUNTS, CU_P_MOE_GATHER, CU_P_MOE_GATE_UP,
    CU_P_MOE_DOWN, CU_P_MOE_COMBINE, CU_P_SYNC_KV, CU_P_N
};

/* A grow-only device buffer. */
typedef struct { void *p; size_t cap; } cu_buf;

typedef struct {
    int device;
    char dev_name[128];
    cudaStream_t cs;            /* compute */
    cudaStream_t xs;            /* KV copies back to the host */
    cublasHandle_t blas;
    cudaEvent_t stored;         /* compute stream: the layer's K/V rows are in the mirror */
    cu_kv_slot slot[2];         /* by layer parity: one layer's copy in flight while the next computes */
    pthread_mutex_t mu;         /* weights, mirrors and slots (session_free comes from other threads) */
    cu_weight *weights;
    cu_kv *kvs;
    cu_buf stage;               /* per-op tables uploaded from the host */
    cu_buf act;                 /* activations converted to F16/BF16 for cuBLAS */
    cu_buf wtmp;                /* a quantized weight dequantized for one product */
    cu_buf moe;                 /* MoE routing */
    cu_buf moe_rows;            /* MoE gathered rows and their products */
    cu_buf ptrs;                /* grouped GEMM pointer arrays */
    const float *ff_host;       /* rope frequency factors: host pointer and its device copy */
    float *ff_dev;
    int ff_n;
    int gemm_split;             /* F16/BF16 GEMMs: activations as hi + lo halves (two products) */
    int dequant;                /* -1 auto (memory permitting), 0 never, 1 always */
    int moe_grouped;            /* MoE experts in one grouped GEMM call */
    unsigned moe_grouped_no;    /* bit 0 F16, 1 BF16, 2 F32: cuBLAS refused the grouped call for that type */
    int moe_pad;                /* MoE experts padded to one batched GEMM: 0 never, 1 when it wastes little, 2 always */
    int attn_tc;                /* long prompts' attention on tensor cores (TANDEM_CUDA_ATTN=cores: off) */
    int attn_split;             /* tensor-core attention: bit 0 q, bit 1 probabilities as hi + lo halves */
    size_t smem_optin;          /* shared memory a block may opt in to (sm_90: 227 KiB, sm_120: 99 KiB) */
    size_t reserve;             /* device bytes kept free for caches and activations */
    int prof;                   /* TANDEM_CUDA_PROFILE: per-op wall time */
    double prof_s[CU_P_N];
    long prof_n[CU_P_N];
    long moe_calls, moe_padded;                 /* profile: MoE blocks, how many padded */
    long long moe_rows_routed, moe_rows_padded; /* padded blocks: routed rows, rows multiplied */
    int failed;
    char err[256];
} cu_impl;

static inline cu_impl *cu_of(backend *be) { return (cu_impl *)be->impl; }

/* ==== Shared helpers (backend_cuda.cu) ==== */
/* Records the first CUDA/cuBLAS failure (printed once); later int-returning
 * ops then fail. Returns 0 if ok, else -1. */
int cu_check(cu_impl *c, cudaError_t e, const char *what);
int cu_check_blas(cu_impl *c, cublasStatus_t s, const char *what);
/* Grow-only device buffer; waits for the compute stream before freeing. */
int cu_buf_need(cu_impl *c, cu_buf *b, size_t bytes);
/* Op timing: t0 = cu_prof_begin(c); ...; cu_prof_end(c, CU_P_X, t0). Both
 * do nothing unless c->prof. */
double cu_prof_begin(cu_impl *c);
void cu_prof_end(cu_impl *c, int op, double t0);
/* Whether weights of type t go to cuBLAS as stored (F32, F16, BF16), with no
 * F16 copy or per-product dequantization. */
static inline int cu_is_half_native(uint32_t t) {
    return t == GGML_TYPE_F32 || t == GGML_TYPE_F16 || t == GGML_TYPE_BF16;
}
/* The device copy of w (made now if load_weight did not run), or NULL. */
cu_weight *cu_weight_of(cu_impl *c, const be_weight *w);

/* ==== Kernels' launchers (cuda_kernels.cu) ==== */
int cu_launch_get_rows(cu_impl *c, const cu_weight *w, const int32_t *ids_dev, int n, float *out);
void cu_launch_rms_norm(cu_impl *c, const float *x, const float *w, float *y, int n_rows, int dim, float eps);
void cu_launch_add_bias(cu_impl *c, float *x, const float *b, int n_tok, int dim);
void cu_launch_swiglu(cu_impl *c, const float *g, const float *u, float *y, size_t n);
void cu_launch_add(cu_impl *c, float *x, const float *y, size_t n);
void cu_launch_rope(cu_impl *c, float *x, int n_tok, int n_head, int head_dim, const int32_t *pos_dev,
                    const rope_cfg *rc, const float *ff_dev);
void cu_launch_kv_store(cu_impl *c, uint32_t dt, int dim, int n_tok, uint8_t *const *kdst_dev,
                        uint8_t *const *vdst_dev, const float *k, const float *v);
int cu_launch_dequant(cu_impl *c, uint32_t type, const void *raw, uint16_t *half, int64_t n);
void cu_launch_to_half(cu_impl *c, int bf16, const float *x, void *hi, void *lo, size_t n);

/* ==== Matrix products (cuda_matmul.cu) ==== */
/* y[t][r] = sum_c W_e[r][c] x[t][c] for t < n_tok, r < ne1 (expert e of a 3-D weight). */
void cu_matmul(cu_impl *c, const cu_weight *w, int expert, const float *x, int n_tok, float *y);
/* Whether cu_matmul takes n_tok rows through the matrix-vector kernel. */
int cu_matmul_uses_mmv(int n_tok);
/* Activations as a product takes them for weights of one type (type):
 * f32 as they are (hi), or converted to hi (and, with gemm_split, lo)
 * halves in the backend's act buffer, where the next conversion replaces
 * them (in stream order: products already queued read the old ones). */
typedef struct {
    cudaDataType_t type;
    const void *hi, *lo;        /* lo NULL: one product */
} cu_act;
/* The type w's products take their activations in. */
cudaDataType_t cu_matmul_act_type(const cu_weight *w);
/* Room in the act buffer for n activations of type (a->hi, a->lo set, the
 * caller writes them), or x itself for f32; 0, or -1 with the failure
 * recorded. cu_matmul_act fills it from the n floats of x. */
int cu_matmul_act_room(cu_impl *c, cudaDataType_t type, const float *x, size_t n, cu_act *a);
int cu_matmul_act(cu_impl *c, cudaDataType_t type, const float *x, size_t n, cu_act *a);
/* The same for several experts at once: group g multiplies expert e[g]
 * with cnt[g] rows of x at row off[g] into y at row off[g]. a: x already
 * converted for w (cu_matmul_act), or NULL. */
void cu_matmul_experts(cu_impl *c, const cu_weight *w, int n_group, const int *e, const int *off,
                       const int *cnt, const float *x, const cu_act *a, float *y);
/* Whether w can go through cu_matmul_experts_padded (a resident half or
 * f32 form). */
int cu_matmul_pads(const cu_weight *w);
/* Padded groups: group g multiplies expert e[g] with the stride rows of the
 * activations a (converted for w) at row g * stride into y at row g *
 * stride (rows past a group's own are zeros, and their products are not
 * read); one batched GEMM. */
void cu_matmul_experts_padded(cu_impl *c, const cu_weight *w, int n_group, const int *e, int stride,
                              const cu_act *a, float *y);

/* ==== Attention (cuda_attention.cu) ==== */
typedef struct {
    const uint8_t *k, *v;       /* the layer's row 0 in the mirror */
    int t0, n, pos0;
} cu_attn_seq;
int cu_launch_attention(cu_impl *c, uint32_t dt, const float *q, const cu_attn_seq *seqs_host, int n_seq,
                        int n_head, int n_head_kv, int head_dim, size_t row_bytes, float scale, float *out);

/* ==== MoE (cuda_moe.cu) ==== */
int cu_moe_ffn(cu_impl *c, const be_moe *m, const float *x, int n_tok, float *y);

#endif

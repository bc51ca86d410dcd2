/* quant.h - weight block formats, conversion, and dot-product kernels.
 *
 * Block layouts are facts of the GGUF/ggml format. Quantized weights are
 * multiplied against activations quantized to 8 bits, as llama.cpp does:
 *   Q4_0, Q5_0, Q8_0 weights  x  Q8_0 activations  (blocks of 32)
 *   Q4_1, Q5_1 weights        x  Q8_1 activations  (blocks of 32; the
 *     activation block carries s = d * sum(q), which meets the weight's min)
 *   Q4_K, Q5_K, Q6_K weights  x  Q8_K activations  (blocks of 256)
 *   F16, BF16 and F32 weights x F32 activations (f32 accumulation, as the
 *   primary oracle ik_llama.cpp does; mainline ggml rounds them to f16),
 *   except a MoE block's F16 experts, whose f32 inputs the CPU backend
 *   rounds to f16 first, as both oracles do there (backend_cpu.c)
 *
 * Every kernel exists as a plain C reference (quant_ref_*) and in SIMD kernel
 * sets (src/backend/cpu/): "avx2" (AVX2/FMA/F16C), "avxvnni" (the same with
 * AVX-VNNI), "avx512" (AVX-512 F/BW/VL/DQ/VNNI), "neon" (arm64). Each x86 set
 * is compiled with its own flags while the rest of the build targets the
 * baseline, and the dispatcher picks, at first use, the best set the CPU runs
 * (cpuid), unless TANDEM_KERNELS names another (ref, avx2, avxvnni, avx512)
 * or quant_use_kernels / quant_force_reference chose one; the tests compare
 * every set present with the reference.
 */
#ifndef TANDEM_QUANT_H
#define TANDEM_QUANT_H

#include <stddef.h>
#include <stdint.h>
#include "engine/gguf.h"

#define QK4_0 32
#define QK5_0 32
#define QK8_0 32
#define QK4_1 32
#define QK5_1 32
#define QK8_1 32
#define QK_K 256
#define K_SCALE_SIZE 12

/* ==== Block layouts ==== */
typedef uint16_t fp16_t;   /* IEEE half, raw bits */
typedef uint16_t bf16_t;   /* bfloat16, raw bits */

typedef struct { fp16_t d; uint8_t qs[QK4_0 / 2]; } block_q4_0;               /* 18 B */
typedef struct { fp16_t d; uint8_t qh[4]; uint8_t qs[QK5_0 / 2]; } block_q5_0;  /* 22 B */
typedef struct { fp16_t d; int8_t qs[QK8_0]; } block_q8_0;                      /* 34 B */
/* Q4_1 / Q5_1: value = d * q + m with q in 0..15 (0..31 with qh's fifth bits) */
typedef struct { fp16_t d, m; uint8_t qs[QK4_1 / 2]; } block_q4_1;                /* 20 B */
typedef struct { fp16_t d, m; uint8_t qh[4]; uint8_t qs[QK5_1 / 2]; } block_q5_1; /* 24 B */
/* Q8_1: activations only; s = d * sum(qs), rounded to fp16 from the f32 d */
typedef struct { fp16_t d, s; int8_t qs[QK8_1]; } block_q8_1;                     /* 36 B */
typedef struct { fp16_t d, dmin; uint8_t scales[K_SCALE_SIZE]; uint8_t qs[QK_K / 2]; } block_q4_K; /* 144 B */
typedef struct { fp16_t d, dmin; uint8_t scales[K_SCALE_SIZE]; uint8_t qh[QK_K / 8]; uint8_t qs[QK_K / 2]; } block_q5_K; /* 176 B */
typedef struct { uint8_t ql[QK_K / 2]; uint8_t qh[QK_K / 4]; int8_t scales[QK_K / 16]; fp16_t d; } block_q6_K; /* 210 B */
typedef struct { float d; int8_t qs[QK_K]; int16_t bsums[QK_K / 16]; } block_q8_K; /* 292 B, activations only */

/* ==== Scalar conversions ==== */
float fp16_to_f32(fp16_t h);
fp16_t f32_to_fp16(float f);          /* round to nearest even */
float bf16_to_f32(bf16_t h);
bf16_t f32_to_bf16(float f);          /* round to nearest even, NaN kept */

/* ==== Type queries ==== */
/* 1 if this engine can compute with weights of this type. */
int quant_is_supported(uint32_t type);
/* The activation type a weight type is multiplied against (see above). */
uint32_t quant_vec_dot_type(uint32_t wtype);

/* ==== Rows ==== */
/* Weight row -> f32 (all supported weight types). n: elements. */
void quant_dequantize_row(uint32_t type, const void *x, float *y, int64_t n);
/* f32 -> activation row of type F32, F16, BF16, Q8_0, Q8_1 or Q8_K. */
void quant_quantize_act_row(uint32_t type, const float *x, void *y, int64_t n);
/* f32 -> weight rows (for writing model files): F32, F16, BF16, Q8_0, Q4_0,
 * Q5_0, Q4_1, Q5_1, Q4_K, Q5_K, Q6_K. Returns 0, or -1 for a type it cannot write. */
int quant_quantize_weight_rows(uint32_t type, const float *x, void *y, int64_t nrows, int64_t n);

/* ==== Dot products ==== */
/* s = dot(weight row x of type wtype, activation row y of quant_vec_dot_type(wtype)), n elements. */
void quant_vec_dot(uint32_t wtype, int64_t n, float *s, const void *x, const void *y);

/* Tile: out[j * out_stride + i] = dot(w row i, act row j) for i < nw, j < na.
 * w rows are w_stride bytes apart; act rows a_stride bytes apart. The fast
 * versions reuse each loaded weight block across several activation rows. */
void quant_mul_mat_tile(uint32_t wtype, int64_t n,
                        const void *w, size_t w_stride, int nw,
                        const void *a, size_t a_stride, int na,
                        float *out, size_t out_stride);

/* ==== Packed weights ====
 * A CPU backend may copy a weight at load into an interleaved layout that the
 * wide kernels stream in one sequential pass (as ik_llama.cpp's -rtr does):
 * groups of QUANT_PACK_ROWS rows, each group the same number of bytes as the
 * rows it replaces, so group g starts at g * QUANT_PACK_ROWS * row_bytes and
 * a 3-D weight's experts stay where they were. Q8_0, per block b of the row:
 * bytes [544 b, 544 b + 32) the 16 rows' fp16 scales, then 8 runs of 64
 * bytes: run k holds bytes 4k..4k+3 of each row's block in row order, each
 * XORed with 0x80 (w + 128 as an unsigned byte: what vpdpbusd multiplies).
 * Q4_0, Q5_0, Q4_K, Q5_K and Q6_K: see quant.c. Other types have no packed layout. */
#define QUANT_PACK_ROWS 16
/* 1 if the active kernel set multiplies packed weights of this type (so
 * packing them pays); the reference multiplies them too, only slower. */
int quant_pack_pays(uint32_t wtype);
/* n_rows (a multiple of QUANT_PACK_ROWS) rows of row_bytes -> packed; 0, or
 * -1 for a type without a packed layout. Groups are independent: threads may
 * pack disjoint runs of them (src and dst advanced by whole groups). */
int quant_pack_rows(uint32_t wtype, const void *src, size_t row_bytes, int64_t n_rows, void *dst);
/* Row `lane` (0..15) of one packed group -> a plain row of row_bytes. */
void quant_unpack_row(uint32_t wtype, const void *group, size_t row_bytes, int lane, void *dst);
/* quant_mul_mat_tile over packed rows: w is the first row of a group, nw a
 * multiple of QUANT_PACK_ROWS, w_stride the plain row_bytes. Every set gives
 * the reference's result bit for bit (a set without packed kernels runs the
 * plain C walk of the packed layout). */
void quant_mul_mat_tile_packed(uint32_t wtype, int64_t n,
                               const void *w, size_t w_stride, int nw,
                               const void *a, size_t a_stride, int na,
                               float *out, size_t out_stride);

/* Reference (plain C) versions, always available, used by the tests. */
void quant_ref_vec_dot(uint32_t wtype, int64_t n, float *s, const void *x, const void *y);
void quant_ref_mul_mat_tile(uint32_t wtype, int64_t n, const void *w, size_t w_stride, int nw,
                            const void *a, size_t a_stride, int na, float *out, size_t out_stride);
void quant_ref_quantize_act_row(uint32_t type, const float *x, void *y, int64_t n);

/* ==== Dispatch ==== */
/* on: the reference kernels; off: the best set this CPU runs. */
void quant_force_reference(int on);
/* Use the named set; -1 if the name is unknown or this CPU cannot run it. */
int quant_use_kernels(const char *name);
/* Names of the sets this CPU runs, "ref" first and the best last; returns
 * how many there are (names gets at most cap of them). */
int quant_kernel_sets(const char **names, int cap);
const char *quant_kernel_name(void);  /* the active set: "ref", "avx2", "avxvnni", "avx512", "neon", "dotprod", "i8mm" */
/* The element-wise ops (ops.h) that go with the active set: plain C, the
 * AVX2 ones (ops_avx2.c), AVX2 and AVX-512 (ops_avx512.c), or NEON
 * (ops_neon.c). */
enum { QK_VEC_NONE = 0, QK_VEC_AVX2 = 1, QK_VEC_AVX512 = 2, QK_VEC_NEON = 3 };
int quant_kernel_vec_ops(void);

#endif

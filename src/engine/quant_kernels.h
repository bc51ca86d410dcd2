/* quant_kernels.h - the table each SIMD kernel set exports (internal).
 *
 * A kernel set is one file of src/backend/cpu/ compiled with its own
 * instruction-set flags (see the Makefile); everything else is built for the
 * baseline target, and quant_dispatch.c picks a set at first use from what
 * cpuid (or the hwcaps, on arm64 Linux) say the CPU has. A set's functions return 1 when
 * they handled a request and 0 when the caller must use the reference.
 */
#ifndef TANDEM_QUANT_KERNELS_H
#define TANDEM_QUANT_KERNELS_H

#include <stddef.h>
#include <stdint.h>

/* The CPU features the sets need: x86-64's from cpuid (with the OS saving
 * the ymm / zmm registers), arm64's from the kernel's hwcaps. */
enum {
    QK_CPU_AVX2 = 1 << 0,       /* AVX2 + FMA + F16C */
    QK_CPU_AVXVNNI = 1 << 1,    /* AVX-VNNI (VEX-encoded dpbusd) */
    QK_CPU_AVX512 = 1 << 2,     /* AVX-512 F, BW, VL, DQ and VNNI */
    QK_CPU_AVX512BF16 = 1 << 3,
    QK_CPU_DOTPROD = 1 << 4,    /* arm64 sdot/udot (FEAT_DotProd, armv8.2-a and later) */
    QK_CPU_I8MM = 1 << 5,       /* arm64 smmla (FEAT_I8MM, optional from armv8.2-a, in armv8.6-a) */
};

/* 1: the AVX-512 decode walks of packed weights prefetch ahead in software;
 * 0: they leave it to the hardware prefetchers. Set with the CPU's features
 * (quant_dispatch.c, "Walk prefetch"), read once per walk. */
extern volatile int quant_walk_prefetch;

typedef struct {
    const char *name;           /* what TANDEM_KERNELS names it by */
    unsigned needs;             /* QK_CPU_* bits the CPU must have */
    int built;                  /* 0 when the build target lacked the flags: the set is empty */
    int vec_ops;                /* QK_VEC_*: the vector element-wise ops that go with it */
    int (*mul_mat_tile)(uint32_t wtype, int64_t n, const void *w, size_t w_stride, int nw,
                        const void *a, size_t a_stride, int na, float *out, size_t out_stride);
    int (*quantize_act_row)(uint32_t type, const float *x, void *y, int64_t n);
    /* weights in the packed layout of quant.h (NULL: the set has no packed
     * kernels), for the types whose bit (1 << type) is in packed_types */
    uint64_t packed_types;
    int (*mul_mat_tile_packed)(uint32_t wtype, int64_t n, const void *w, size_t w_stride, int nw,
                               const void *a, size_t a_stride, int na, float *out, size_t out_stride);
} quant_kset;

extern const quant_kset quant_kset_avx2, quant_kset_avxvnni, quant_kset_avx512, quant_kset_neon, quant_kset_dotprod,
    quant_kset_i8mm;

#endif

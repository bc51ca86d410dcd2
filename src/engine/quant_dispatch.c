/* quant_dispatch.c - the run-time choice of a kernel set: the CPU's
 * features (cpuid, the hwcaps, sysctl), whether the decode walks prefetch,
 * and the entry points that hand a request to the active set or the
 * reference (quant.c). */

#include "engine/quant.h"
#include "engine/quant_kernels.h"

#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "engine/quant_internal.h"

/* ==== CPU features ==== */
#if defined(__x86_64__) || defined(__i386__)
#include <cpuid.h>

/* XCR0: which register states the OS saves on a context switch. */
static uint64_t quant_xgetbv(void) {
    uint32_t lo, hi;
    __asm__ volatile("xgetbv" : "=a"(lo), "=d"(hi) : "c"(0));
    return ((uint64_t)hi << 32) | lo;
}

static unsigned quant_cpu_features(void) {
    unsigned a, b, c, d, f = 0;
    if (!__get_cpuid(1, &a, &b, &c, &d)) return 0;
    /* bits of cpuid 1 ecx: 12 FMA, 27 OSXSAVE, 28 AVX, 29 F16C */
    if (!(c & (1u << 27)) || !(c & (1u << 28))) return 0;
    int fma = (c >> 12) & 1, f16c = (c >> 29) & 1;
    uint64_t xcr0 = quant_xgetbv();
    if ((xcr0 & 0x6) != 0x6) return 0;                   /* xmm + ymm state */
    int zmm = (xcr0 & 0xe6) == 0xe6;                     /* + opmask, zmm0-15 upper, zmm16-31 */
    if (__get_cpuid_max(0, NULL) < 7) return 0;
    __cpuid_count(7, 0, a, b, c, d);
    /* leaf 7.0: ebx 5 AVX2, 16 AVX512F, 17 DQ, 30 BW, 31 VL; ecx 11 AVX512_VNNI */
    if (((b >> 5) & 1) && fma && f16c) f |= QK_CPU_AVX2;
    if (zmm && ((b >> 16) & 1) && ((b >> 17) & 1) && ((b >> 30) & 1) && ((b >> 31) & 1) && ((c >> 11) & 1))
        f |= QK_CPU_AVX512;
    unsigned eax1;
    __cpuid_count(7, 1, eax1, b, c, d);
    /* leaf 7.1: eax 4 AVX-VNNI, 5 AVX512_BF16 */
    if ((eax1 >> 4) & 1) f |= QK_CPU_AVXVNNI;
    if (zmm && ((eax1 >> 5) & 1)) f |= QK_CPU_AVX512BF16;
    return f;
}
#elif defined(__aarch64__) && defined(__linux__)
#include <sys/auxv.h>

/* The kernel's hwcaps (asm/hwcap.h): bit 20 of AT_HWCAP is HWCAP_ASIMDDP,
 * the dot-product instructions (sdot/udot); bit 13 of AT_HWCAP2 is
 * HWCAP2_I8MM, the int8 matrix multiplies (smmla). NEON itself is in every
 * arm64. */
static unsigned quant_cpu_features(void) {
    unsigned f = (getauxval(AT_HWCAP) >> 20 & 1) ? QK_CPU_DOTPROD : 0;
#ifdef AT_HWCAP2
    if (getauxval(AT_HWCAP2) >> 13 & 1) f |= QK_CPU_I8MM;
#endif
    return f;
}
#elif defined(__aarch64__) && defined(__APPLE__)
#include <sys/sysctl.h>

/* macOS names the features in sysctl (macOS 12 and later): every Apple
 * M-series core has the dot product, M2 and later the int8 matrix
 * multiplies. (Not compiled on this project's Linux machines: no macOS SDK
 * there.) */
static int quant_sysctl_flag(const char *name) {
    int v = 0;
    size_t n = sizeof v;
    return sysctlbyname(name, &v, &n, NULL, 0) == 0 && v != 0;
}

static unsigned quant_cpu_features(void) {
    unsigned f = quant_sysctl_flag("hw.optional.arm.FEAT_DotProd") ? QK_CPU_DOTPROD : 0;
    if (quant_sysctl_flag("hw.optional.arm.FEAT_I8MM")) f |= QK_CPU_I8MM;
    return f;
}
#else
static unsigned quant_cpu_features(void) { return 0; }
#endif

/* ==== Walk prefetch ====
 * Decoding one token, the AVX-512 walks of packed weights prefetch ahead in
 * software: the K-quant walks every line twice, about 12 KiB and 32 KiB
 * ahead (qa_kp_pf_q4k, qa_kp_far), the Q8_0 / Q4_0 / Q5_0 walk 2 KiB ahead
 * (QA_P16_PF), all into L1. Tuned on a Zen 5 (48 KiB L1D), where they pay;
 * on a Zen 4 (32 KiB L1D) the hardware prefetchers alone do better.
 * - Zen 5, decode tokens alternated in one process at the machine's ~47
 *   GB/s: Qwen3-0.6B Q4_K_M +8-11% with a second prefetch 64 KiB ahead (-2%
 *   to +1% at its ~80 GB/s), and 32 KiB another 3-4% above 64 (16, 24 and
 *   48 KiB within 1.2% of 32); at 32 KiB Q5_K_M +2-6%, the 30B-A3B shape
 *   (8 layers) +7-10%. A 512 MiB Q4_K matrix walked by both cores: 36-39
 *   GB/s with the near prefetch alone, 41-45 with both.
 * - Zen 4, decode tokens alternated in one process (three runs of 48-64
 *   tokens per variant, each switching one thing): without the far
 *   prefetch the 30B-A3B shape 48.9-52.5 -> 54.0-56.6 t/s and Qwen3-0.6B
 *   Q4_K_M 58.5-62.8 -> 69.3-73.3 (16 KiB ahead the same as none, 24 KiB
 *   less); then without the near one too, 52.9-58.0 -> 54.5-59.8 and
 *   69.4-75.8 -> 68.9-77.1; without the Q8_0 walk's, Qwen2.5-0.5B Q8_0
 *   46.3-60.3 -> 52.4-75.8 and Qwen3-0.6B Q8_0 43.5-47.6 -> 46.2-49.7
 *   (512 bytes and 8 KiB ahead no better than 2 KiB). A 512 MiB matrix
 *   walked by both cores: Q4_K 22.7 GB/s with both K-quant prefetches, 28.0
 *   with the near one, 32.7 with none; Q6_K 26.6, 33.2, 35.7.
 * The two cores differ in many ways; what this goes by is the L1D: on
 * where it holds 48 KiB or more, off where it is smaller or unknown. */
volatile int quant_walk_prefetch = 0;
#define QUANT_WALK_PREFETCH_L1D (48 << 10)

static size_t quant_cpu_l1d_bytes(void) {
#if defined(_SC_LEVEL1_DCACHE_SIZE)
    long v = sysconf(_SC_LEVEL1_DCACHE_SIZE);
    return v > 0 ? (size_t)v : 0;
#else
    return 0;
#endif
}

/* ==== Dispatch ==== */
/* Candidate sets, best last; a set is usable when it was built and the CPU
 * has what it needs. */
static const quant_kset *const quant_ksets[] = {
    &quant_kset_neon, &quant_kset_dotprod, &quant_kset_i8mm,
    &quant_kset_avx2, &quant_kset_avxvnni, &quant_kset_avx512,
};
#define QUANT_N_KSETS (int)(sizeof quant_ksets / sizeof quant_ksets[0])
static const quant_kset quant_kset_ref = { .name = "ref", .built = 1 };

/* The active set; NULL until the first use decides. */
static _Atomic(const quant_kset *) quant_active;

/* What this CPU has, read once: its instruction-set features (the return)
 * and whether the decode walks prefetch (quant_walk_prefetch). */
static unsigned quant_cpu_probe(void) {
    static atomic_int feats = -1;
    int f = atomic_load_explicit(&feats, memory_order_acquire);
    if (f < 0) {
        quant_walk_prefetch = quant_cpu_l1d_bytes() >= QUANT_WALK_PREFETCH_L1D;
        f = (int)quant_cpu_features();
        atomic_store_explicit(&feats, f, memory_order_release);
    }
    return (unsigned)f;
}

static int quant_kset_usable(const quant_kset *k) {
    return k->built && (k->needs & ~quant_cpu_probe()) == 0;
}

static const quant_kset *quant_kset_best(void) {
    for (int i = QUANT_N_KSETS - 1; i >= 0; i--)
        if (quant_kset_usable(quant_ksets[i])) return quant_ksets[i];
    return &quant_kset_ref;
}

static const quant_kset *quant_kset_find(const char *name) {
    if (!strcmp(name, "ref")) return &quant_kset_ref;
    for (int i = 0; i < QUANT_N_KSETS; i++)
        if (!strcmp(quant_ksets[i]->name, name) && quant_kset_usable(quant_ksets[i])) return quant_ksets[i];
    return NULL;
}

/* First use: TANDEM_KERNELS names a set, else the best this CPU runs. */
const quant_kset *quant_kset_get(void) {
    const quant_kset *k = atomic_load_explicit(&quant_active, memory_order_acquire);
    if (k) return k;
    const char *e = getenv("TANDEM_KERNELS");
    k = e && *e ? quant_kset_find(e) : NULL;
    if (e && *e && !k)
        fprintf(stderr, "tandem: TANDEM_KERNELS=%s is not a kernel set this CPU runs; using %s\n", e,
                quant_kset_best()->name);
    if (!k) k = quant_kset_best();
    const quant_kset *expect = NULL;
    atomic_compare_exchange_strong(&quant_active, &expect, k);
    return atomic_load(&quant_active);
}

void quant_force_reference(int on) { atomic_store(&quant_active, on ? &quant_kset_ref : quant_kset_best()); }

int quant_use_kernels(const char *name) {
    const quant_kset *k = quant_kset_find(name);
    if (!k) return -1;
    atomic_store(&quant_active, k);
    return 0;
}

int quant_kernel_sets(const char **names, int cap) {
    int n = 0;
    if (n < cap) names[n] = "ref";
    n++;
    for (int i = 0; i < QUANT_N_KSETS; i++)
        if (quant_kset_usable(quant_ksets[i])) { if (n < cap) names[n] = quant_ksets[i]->name; n++; }
    return n;
}

const char *quant_kernel_name(void) { return quant_kset_get()->name; }

int quant_kernel_vec_ops(void) { return quant_kset_get()->vec_ops; }

void quant_quantize_act_row(uint32_t type, const float *x, void *y, int64_t n) {
    const quant_kset *k = quant_kset_get();
    if (k->quantize_act_row && k->quantize_act_row(type, x, y, n)) return;
    quant_ref_quantize_act_row(type, x, y, n);
}

void quant_mul_mat_tile(uint32_t wtype, int64_t n, const void *w, size_t w_stride, int nw,
                        const void *a, size_t a_stride, int na, float *out, size_t out_stride) {
    if (nw <= 0 || na <= 0) return;
    const quant_kset *k = quant_kset_get();
    if (k->mul_mat_tile && k->mul_mat_tile(wtype, n, w, w_stride, nw, a, a_stride, na, out, out_stride)) return;
    quant_ref_mul_mat_tile(wtype, n, w, w_stride, nw, a, a_stride, na, out, out_stride);
}

void quant_vec_dot(uint32_t wtype, int64_t n, float *s, const void *x, const void *y) {
    quant_mul_mat_tile(wtype, n, x, 0, 1, y, 0, 1, s, 0);
}

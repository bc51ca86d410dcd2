/* selftest.c - checks tools/peer_fit against plain C (a benchmark helper's
 * test, not part of tandem). Built with AVX-VNNI and AVX512-FP16 so that it
 * holds the instructions relocate.py replaces: VEX vpdpbusd / vpdpwssd in a
 * loop, with a rip-relative operand, in jump tables and in cases that fall
 * through; an entry into a block's middle that no branch names (the int3
 * path); and each form of vmovw and vmovsh. Every result is compared with a
 * scalar reference; exit 0 when all agree. On a CPU without those
 * extensions it dies with SIGILL unless peer_fit's preload is applied. */
#include <immintrin.h>
#include <stdint.h>
#include <stdio.h>
#include <string.h>
static const int16_t W16[16] = {1,-2,3,-4,5,-6,7,-8,9,-10,11,-12,13,-14,15,-16};
__attribute__((noinline)) int dot_u8s8(const uint8_t *a, const int8_t *b, int n) {
    __m256i acc = _mm256_setzero_si256(), acc2 = acc;
    int i = 0;
    for (; i + 64 <= n; i += 64) {
        acc = _mm256_dpbusd_avx_epi32(acc, _mm256_loadu_si256((const __m256i *)(a + i)), _mm256_loadu_si256((const __m256i *)(b + i)));
        acc2 = _mm256_dpbusd_avx_epi32(acc2, _mm256_loadu_si256((const __m256i *)(a + i + 32)), _mm256_loadu_si256((const __m256i *)(b + i + 32)));
    }
    acc = _mm256_add_epi32(acc, acc2);
    int32_t t[8]; _mm256_storeu_si256((__m256i *)t, acc);
    int s = 0; for (int k = 0; k < 8; k++) s += t[k];
    for (; i < n; i++) s += a[i] * b[i];
    return s;
}
__attribute__((noinline)) int dot_w16(const int16_t *x) {   /* memory operand from a constant table */
    __m256i acc = _mm256_set1_epi32(7);
    acc = _mm256_dpwssd_avx_epi32(acc, _mm256_loadu_si256((const __m256i *)x), _mm256_loadu_si256((const __m256i *)W16));
    __m128i a4 = _mm_dpwssd_avx_epi32(_mm_set1_epi32(1), _mm_loadu_si128((const __m128i *)x), _mm_loadu_si128((const __m128i *)(W16 + 8)));
    int32_t t[8], u[4]; _mm256_storeu_si256((__m256i *)t, acc); _mm_storeu_si128((__m128i *)u, a4);
    int s = 0; for (int k = 0; k < 8; k++) s += t[k]; for (int k = 0; k < 4; k++) s += 3 * u[k];
    return s;
}
__attribute__((noinline)) int sw(int k, const uint8_t *a, const int8_t *b) {   /* a jump table */
    __m256i v = _mm256_loadu_si256((const __m256i *)a), w = _mm256_loadu_si256((const __m256i *)b), r;
    switch (k) {
    case 0: r = _mm256_dpbusd_avx_epi32(_mm256_set1_epi32(1), v, w); break;
    case 1: r = _mm256_dpbusd_avx_epi32(_mm256_set1_epi32(2), w, v); break;
    case 2: r = _mm256_dpwssd_avx_epi32(_mm256_set1_epi32(3), v, w); break;
    case 3: r = _mm256_add_epi32(v, w); break;
    case 4: r = _mm256_dpbusd_avx_epi32(v, v, w); break;
    case 5: r = _mm256_dpwssd_avx_epi32(w, w, v); break;
    case 6: r = _mm256_sub_epi32(v, w); break;
    default: r = _mm256_dpbusd_avx_epi32(w, v, v); break;
    }
    int32_t t[8]; _mm256_storeu_si256((__m256i *)t, r);
    int s = 0; for (int j = 0; j < 8; j++) s ^= t[j] * (j + 1);
    return s;
}
static int ref_sw(int k, const uint8_t *a, const int8_t *b) {
    int32_t t[8];
    for (int j = 0; j < 8; j++) {
        int32_t va, wa; memcpy(&va, a + 4 * j, 4); memcpy(&wa, b + 4 * j, 4);
        int64_t r = 0;
        switch (k) {
        case 0: r = 1; for (int q = 0; q < 4; q++) r += a[4*j+q] * b[4*j+q]; break;
        case 1: r = 2; for (int q = 0; q < 4; q++) r += ((uint8_t)b[4*j+q]) * (int8_t)a[4*j+q]; break;
        case 2: { const int16_t *x = (const int16_t *)a, *y = (const int16_t *)b; r = 3 + x[2*j]*y[2*j] + x[2*j+1]*y[2*j+1]; break; }
        case 3: r = (int32_t)((uint32_t)va + (uint32_t)wa); break;
        case 4: r = va; for (int q = 0; q < 4; q++) r += a[4*j+q] * b[4*j+q]; break;
        case 5: { const int16_t *x = (const int16_t *)b, *y = (const int16_t *)a; r = wa + x[2*j]*y[2*j] + x[2*j+1]*y[2*j+1]; break; }
        case 6: r = (int32_t)((uint32_t)va - (uint32_t)wa); break;
        default: r = wa; for (int q = 0; q < 4; q++) r += a[4*j+q] * (int8_t)a[4*j+q]; break;
        }
        t[j] = (int32_t)r;
    }
    int s = 0; for (int j = 0; j < 8; j++) s ^= t[j] * (j + 1);
    return s;
}
__attribute__((noinline)) int ft(int k, const uint8_t *a, const int8_t *b) {   /* fall-through cases */
    __m256i v = _mm256_loadu_si256((const __m256i *)a), w = _mm256_loadu_si256((const __m256i *)b), r = _mm256_set1_epi32(k);
    switch (k) {
    case 0: r = _mm256_dpbusd_avx_epi32(r, v, w); /* fall through */
    case 1: r = _mm256_dpbusd_avx_epi32(r, w, v); /* fall through */
    case 2: r = _mm256_dpwssd_avx_epi32(r, v, w); /* fall through */
    case 3: r = _mm256_dpbusd_avx_epi32(r, v, v); /* fall through */
    case 4: r = _mm256_dpwssd_avx_epi32(r, w, w); break;
    default: r = _mm256_add_epi32(r, v);
    }
    int32_t t[8]; _mm256_storeu_si256((__m256i *)t, r);
    int s = 0; for (int j = 0; j < 8; j++) s += t[j] * (j + 1);
    return s;
}
static int ref_ft(int k, const uint8_t *a, const int8_t *b) {
    int32_t t[8]; const int16_t *x = (const int16_t *)a, *y = (const int16_t *)b;
    for (int j = 0; j < 8; j++) {
        int32_t r = k, va; memcpy(&va, a + 4 * j, 4);
        if (k > 4) { t[j] = (int32_t)((uint32_t)r + (uint32_t)va); continue; }
        if (k <= 0) for (int q = 0; q < 4; q++) r += a[4*j+q] * b[4*j+q];
        if (k <= 1) for (int q = 0; q < 4; q++) r += ((uint8_t)b[4*j+q]) * (int8_t)a[4*j+q];
        if (k <= 2) r += x[2*j]*y[2*j] + x[2*j+1]*y[2*j+1];
        if (k <= 3) for (int q = 0; q < 4; q++) r += a[4*j+q] * (int8_t)a[4*j+q];
        r += y[2*j]*y[2*j] + y[2*j+1]*y[2*j+1];
        t[j] = r;
    }
    int s = 0; for (int j = 0; j < 8; j++) s += t[j] * (j + 1);
    return s;
}
__attribute__((noinline)) int ij(int skip, const uint8_t *pa, const int8_t *pb) {   /* an entry no branch names */
    __m256i a = _mm256_loadu_si256((const __m256i *)pa), b = _mm256_loadu_si256((const __m256i *)pb), r = _mm256_set1_epi32(5);
    __asm__ volatile("lea 0f(%%rip), %%rax\n\t"
                     "test %[s], %[s]\n\t"
                     "jz 2f\n\t"
                     "add $(1f-0f), %%rax\n"
                     "2:\tjmp *%%rax\n"
                     "0:\t%{vex%} vpdpbusd %[b], %[a], %[r]\n"
                     "1:\t%{vex%} vpdpbusd %[a], %[a], %[r]\n\t"
                     : [r] "+x"(r) : [a] "x"(a), [b] "x"(b), [s] "r"(skip) : "rax");
    int32_t t[8]; _mm256_storeu_si256((__m256i *)t, r);
    int s = 0; for (int j = 0; j < 8; j++) s += t[j] * (j + 1);
    return s;
}
static int ref_ij(int skip, const uint8_t *a, const int8_t *b) {
    int s = 0;
    for (int j = 0; j < 8; j++) {
        int r = 5;
        for (int q = 0; q < 4; q++) r += a[4*j+q] * (int8_t)a[4*j+q] + (skip ? 0 : a[4*j+q] * b[4*j+q]);
        s += r * (j + 1);
    }
    return s;
}
typedef int (*dotfn)(const uint8_t *, const int8_t *, int);
dotfn volatile FP = dot_u8s8;
__attribute__((noinline)) uint32_t fp16moves(uint32_t g, uint16_t *m) {
    __m128i x, y = _mm_set1_epi32(-1), z;
    uint32_t r1, r2;
    __asm__ volatile("vmovw %1, %0" : "=v"(x) : "r"(g));                  /* gpr -> xmm */
    __asm__ volatile("vmovw %1, %0" : "=r"(r1) : "v"(y));                 /* xmm -> gpr */
    __asm__ volatile("vmovw %1, %0" : "=v"(z) : "m"(m[1]));               /* m16 -> xmm */
    __asm__ volatile("vmovw %1, %0" : "=m"(m[2]) : "v"(x));               /* xmm -> m16 */
    __asm__ volatile("vmovsh %2, %1, %0" : "=v"(y) : "v"(y), "v"(z));     /* low word of z into y */
    __asm__ volatile("vmovd %1, %0" : "=r"(r2) : "v"(y));
    int32_t t[4], u[4]; _mm_storeu_si128((__m128i *)t, x); _mm_storeu_si128((__m128i *)u, z);
    return r1 * 3 + r2 * 5 + (uint32_t)t[0] * 7 + (uint32_t)(t[1] | t[2] | t[3]) + (uint32_t)u[0] * 11 + (uint32_t)(u[1] | u[2] | u[3]);
}
int main(void) {
    uint8_t a[1000]; int8_t b[1000]; int16_t x[16];
    uint32_t s = 1; int fails = 0, checks = 0;
    for (int i = 0; i < 1000; i++) { s = s * 1103515245 + 12345; a[i] = s >> 16; b[i] = s >> 8; }
    for (int n = 0; n <= 1000; n += 37) {
        int r = 0; for (int i = 0; i < n; i++) r += a[i] * b[i];
        checks++; if (FP(a, b, n) != r) { fails++; printf("dot n=%d %d != %d\n", n, FP(a, b, n), r); }
    }
    for (int i = 0; i < 16; i++) x[i] = (int16_t)(a[i] * 37 - 4000);
    int r = 56; for (int i = 0; i < 16; i++) r += x[i] * W16[i];
    for (int i = 0; i < 8; i++) r += 3 * (x[i] * W16[8 + i]) + (i % 2 == 0 ? 3 : 0);
    r += 0; checks++; if (dot_w16(x) != r) { fails++; printf("w16 %d != %d\n", dot_w16(x), r); }
    for (int k = 0; k < 9; k++) for (int o = 0; o < 900; o += 97) {
        checks++; if (sw(k, a + o, b + o) != ref_sw(k, a + o, b + o)) { fails++; printf("sw k=%d o=%d\n", k, o); }
    }
    for (int k = 0; k < 7; k++) for (int o = 0; o < 900; o += 97) {
        checks++; if (ft(k, a + o, b + o) != ref_ft(k, a + o, b + o)) { fails++; printf("ft k=%d o=%d\n", k, o); }
    }
    for (int k = 0; k < 2; k++) for (int o = 0; o < 900; o += 97) {
        checks++; if (ij(k, a + o, b + o) != ref_ij(k, a + o, b + o)) { fails++; printf("ij k=%d o=%d\n", k, o); }
    }
    uint16_t m[4] = {0x1111, 0xbeef, 0x3333, 0x4444};
    uint32_t g = 0xdead1234;
    uint32_t want = 0xffffu * 3 + 0xffffbeefu * 5 + 0x1234u * 7 + 0 + 0xbeefu * 11 + 0;
    checks++; uint32_t got = fp16moves(g, m);
    if (got != want || m[2] != 0x1234 || m[1] != 0xbeef || m[3] != 0x4444) { fails++; printf("fp16 moves %#x != %#x, m2 %#x\n", got, want, m[2]); }
    printf("%d checks, %d failed\n", checks, fails);
    return fails != 0;
}
